"""The synthesis core: no wire formats, no sockets.

Import from the modules themselves (:mod:`rtts.config` imports the core's config classes,
so this package imports nothing eagerly).

:class:`~rtts.core.service.Service` owns the engines, schedulers, phrase cache, load
governor and counters; every protocol front-end in :mod:`rtts.api` talks to it through a
:class:`~rtts.core.context.SpeechContext` (feed text or add segments, flush, cancel, end;
iterate segment events), which reaches the engines by :meth:`Service.open_segment` (the one
cache -> scheduler path). Parameters: :mod:`rtts.core.params`; voice names:
:mod:`rtts.core.voicenames`; the registry: :mod:`rtts.core.voices`; speaker strings,
bounded: :mod:`rtts.core.speaker`.
"""
