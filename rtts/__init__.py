"""rtts: a self-hosted real-time streaming TTS server (WebSocket) on ChatTTS.

Importing this package is light: torch and ChatTTS load only when the ChatTTS engine
is built.
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
