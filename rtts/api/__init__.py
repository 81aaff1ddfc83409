"""Protocol front-ends, one module or package per wire protocol, each translating to
:mod:`rtts.core`, and what they share. ``docs/architecture.md`` names every module.

- native (``/v1/stream``): :mod:`rtts.api.native`
- OpenAI: :mod:`rtts.api.openai`; ``/v1/tts`` and friends: :mod:`rtts.api.rest`
- ElevenLabs: :mod:`rtts.api.elevenlabs`; Cartesia: :mod:`rtts.api.cartesia`;
  Deepgram: :mod:`rtts.api.deepgram`; Wyoming: :mod:`rtts.api.wyoming`
- voices and jobs APIs: :mod:`rtts.api.voices`, :mod:`rtts.api.jobs`
- shared: :mod:`rtts.api.listener` (one port), :mod:`rtts.api.admission`, :mod:`rtts.api.auth`,
  :mod:`rtts.api.handshake`, :mod:`rtts.api.sockets`, :mod:`rtts.api.tasks`, :mod:`rtts.api.compat`,
  :mod:`rtts.api.http` (the ASGI app, errors, the one HTTP speech handler)
"""
