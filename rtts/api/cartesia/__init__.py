"""Cartesia-compatible text to speech: :mod:`.protocol` (the wire format, pure) and
:mod:`.endpoint` (the ``/tts/websocket`` socket and ``POST /tts/bytes`` on the core)."""
