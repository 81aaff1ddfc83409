"""Deepgram-compatible text to speech: :mod:`.protocol` (the wire format, pure) and
:mod:`.endpoint` (the ``/v1/speak`` socket and ``POST /v1/speak`` on the core)."""
