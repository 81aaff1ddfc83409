"""The native WebSocket protocol (``/v1/stream``, v1): the sans-I/O layers and their socket.

- :mod:`rtts.api.native.protocol`: message parsing and validation (pure)
- :mod:`rtts.api.native.session`: per-connection context state machine (pure)
- :mod:`rtts.api.native.pacing`: how far ahead of the listener audio is sent (pure)
- :mod:`rtts.api.native.connection`: the asyncio socket that drives them on the core
"""
