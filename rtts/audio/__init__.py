"""Audio that leaves the server: PCM conversion and resampling, and the streaming encoders.

- :mod:`rtts.audio.pcm`: float -> PCM16, the streaming resampler (pure)
- :mod:`rtts.audio.codecs`: mulaw/alaw/wav/mp3/opus/webm/aac/flac streaming encoders
"""
