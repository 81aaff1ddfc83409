"""The synthesis core: no wire formats, no sockets.

Import from the modules themselves (:mod:`rtts.config` imports the core's config classes,
so this package imports nothing eagerly).

:class:`~rtts.core.service.Service` owns the engine, scheduler, phrase cache, load
governor and counters; every protocol front-end in :mod:`rtts.api` talks to it, either
through a :class:`~rtts.core.context.SpeechContext` (feed text, flush, cancel, end; iterate
segment events) or, for the native socket's per-segment pipeline, through
:meth:`Service.open_segment` / :meth:`Service.store_segment` (the one cache -> scheduler
path).
"""
