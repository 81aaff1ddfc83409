"""Protocol front-ends, one module per wire protocol, each translating to :mod:`rtts.core`.

- :mod:`rtts.api.native.connection`: ``/v1/stream``, the native WebSocket protocol (v1)
- :mod:`rtts.api.rest`: ``/v1/tts``, ``/v1/token``, ``/v1/info``, ``/v1/formats``
- :mod:`rtts.api.openai`: ``/v1/audio/speech``, ``/v1/models``, ``/v1/audio/{models,voices}``
- :mod:`rtts.api.http.app`: the ASGI app (routes, CORS, health, metrics, static files, OpenAPI)
- :mod:`rtts.api.listener`: one port; WebSocket upgrades to ``websockets``, HTTP to uvicorn
"""
