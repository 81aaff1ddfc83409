"""Text normalization: what ChatTTS should say for what was written. Pure, no I/O."""

from rtts.text.normalize import SpokenText, normalize, spoken_text

__all__ = ["SpokenText", "normalize", "spoken_text"]
