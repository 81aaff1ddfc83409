"""Named voices: built-ins plus a directory of JSON files, one per voice (no I/O but files).

A named voice is a speaker (a ChatTTS speaker-embedding string, or the speaker drawn from a
seed, stored as the seed and never as a tensor) plus optional default sampling params.
Every voice names its engine (``engine`` in the voice lists): seed and speaker voices are
the server's primary engine's; the voices of other engines (each piper model loaded,
``piper:NAME``) are registered by the service as built-ins of that engine
(:meth:`VoiceStore.add_engine_voice`), and routing by engine happens in the core.
Wherever a request carries ``voice`` (the native ``start`` message, ``/v1/tts``, OpenAI's
``voice``), :meth:`VoiceStore.apply` swaps a registered name for its speaker and fills the
params the request left at their protocol defaults (see :meth:`VoiceStore.apply`).

The store is a plain directory (``--voices-dir``; ``$RTTS_VOICES_DIR``; by default
``$RTTS_HOME/voices`` or ``~/.cache/rtts/voices``) that several instances may share (a
mounted volume): every file is written under a temporary name and then linked into place,
so a reader never sees half a file and two instances cannot both create one name; reads
check the file's mtime on every lookup, so a voice created on one instance resolves on
every other without a restart.

**Owners.** With API keys, a voice belongs to the key that created it: it is filed under
``<dir>/by-key/<owner>/<name>.json`` (``owner``: :meth:`rtts.api.auth.Authenticator.owner`,
stable across instances and restarts), and only that key lists, uses, replaces or deletes
it. The files directly in ``<dir>`` are the *shared* namespace: every key (and Wyoming,
which has no keys) may use them, but only the operator writes them (files placed there,
or the API of a server without keys). A key's own name shadows nothing: a name in the
shared namespace cannot be created by a key. ``max_per_owner`` caps a key's voices. The
file::

    {"name": "narrator", "speaker": null, "seed": 1234,
     "params": {"temperature": 0.2, "top_P": 0.7}, "created_at": 1767225600.0}

**Samples.** A voice may also hold a *sample*: audio codes and their transcript
(``"sample": {"codes": "<ChatTTS packed codes>", "text": "..."}``, the codes in ChatTTS's
own ``spk_smp`` form, at most :data:`~rtts.core.params.MAX_SAMPLE_SECONDS` of them). Every
segment spoken with the voice is conditioned on it (ChatTTS's ``spk_smp``/``txt_smp``). A
voice made from an uploaded clip has the sample alone (its prompt uses ``[empty_spk]``); a
voice saved from a context the server spoke keeps that context's speaker and its first
segment's codes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import orjson

from rtts.core.params import (
    FRAMES_PER_SECOND,
    MAX_SAMPLE_SECONDS,
    MAX_SAMPLE_TEXT_CHARS,
    NO_SPEAKER,
    SpeakerSample,
    SynthParams,
)
from rtts.core.params import parse_params as parse_synth_params
from rtts.core.speaker import MAX_SPEAKER_CHARS, SpeakerError, decode_codes, encode_codes
from rtts.core.speaker import decode_speaker as _decode_bounded
from rtts.errors import ProtocolError, RttsError

__all__ = ["BUILTIN_VOICES", "NAME_RE", "PARAM_KEYS", "Voice", "VoiceError", "VoiceStore",
           "check_name", "check_sample", "check_speaker", "decode_speaker",
           "default_voices_dir", "parse_params", "sample_json"]

logger = logging.getLogger("rtts.core.voices")

NAME_RE: Final = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
_OWNER_RE: Final = re.compile(r"^[0-9a-f]{8,64}$")
# Stable built-in names -> the seed their speaker is drawn from (never change a mapping:
# clients rely on a name sounding the same everywhere). "default" is the engine's default.
BUILTIN_VOICES: Final[dict[str, int]] = {
    "default": 2, "calm": 1031, "bright": 4099, "warm": 1597, "deep": 2333, "soft": 8191,
    "clear": 6007,
}
# Params a voice may carry as defaults (the SynthParams fields besides ``voice``).
PARAM_KEYS: Final = ("seed", "temperature", "top_P", "top_K", "speed", "refine", "anchor",
                     "oral", "laugh", "breaks", "repetition_penalty")
_DEFAULTS: Final = SynthParams()


class VoiceError(RttsError, ValueError):
    """A rejected voice operation; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 api_code: str | None = None) -> None:
        super().__init__(message, code="invalid_voice")
        self.api_code = api_code  # the API's error code, when the status alone does not say it
        self.status = status
        self.param = param


@dataclass(frozen=True)
class Voice:
    name: str
    speaker: str | None = None  # a ChatTTS speaker-embedding string ...
    seed: int | None = None  # ... or the seed its speaker is drawn from
    params: Mapping[str, Any] = field(default_factory=dict)
    created_at: float | None = None
    builtin: bool = False
    engine: str | None = None  # the engine that speaks it (None: the server's primary)
    target: str | None = None  # another engine's voice string (``piper:NAME``)
    sample: SpeakerSample | None = None  # codes + transcript every prompt is conditioned on

    @property
    def voice(self) -> str:
        """The engine's voice string: ``target``, the speaker string, ``seed:N``, or
        :data:`~rtts.core.params.NO_SPEAKER` for a sample alone."""
        if self.target is not None:
            return self.target
        if self.speaker is not None:
            return self.speaker
        return f"seed:{self.seed}" if self.seed is not None else NO_SPEAKER

    def to_file(self) -> dict[str, Any]:
        out = {"name": self.name, "speaker": self.speaker, "seed": self.seed,
               "params": dict(self.params), "created_at": self.created_at}
        if self.sample is not None:
            out["sample"] = sample_json(self.sample)
        return out

    def describe(self) -> dict[str, Any]:
        """The public description (``GET /v1/voices``); the speaker string only by length."""
        out: dict[str, Any] = {"name": self.name, "builtin": self.builtin}
        if self.engine is not None:
            out["engine"] = self.engine
        if self.target is not None:
            out["voice"] = self.target
        if self.seed is not None:
            out["seed"] = self.seed
        if self.speaker is not None:
            out["speaker"] = True
        if self.sample is not None:
            out["sample"] = {"seconds": round(self.sample.seconds, 2),
                             "text": self.sample.text}
        if self.params:
            out["params"] = dict(self.params)
        if self.created_at is not None:
            out["created_at"] = self.created_at
        return out


def default_voices_dir() -> Path:
    """``$RTTS_VOICES_DIR``, else ``voices`` beside the default model dir's parent."""
    env = os.environ.get("RTTS_VOICES_DIR")
    if env:
        return Path(env)
    base = os.environ.get("RTTS_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rtts")
    return Path(base) / "voices"


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise VoiceError("name must be 1-64 characters of a-z, 0-9, '_' and '-', starting "
                         "with a letter or digit", param="name")
    return name


def parse_params(obj: Any) -> dict[str, Any]:
    """Validate a voice's default params (the protocol's own ranges); only the keys given."""
    if obj is None:
        return {}
    if not isinstance(obj, dict):
        raise VoiceError("params must be a JSON object", param="params")
    unknown = sorted(set(obj) - set(PARAM_KEYS))
    if unknown:
        raise VoiceError(f"unknown params {', '.join(map(str, unknown))}; allowed: "
                         f"{', '.join(PARAM_KEYS)}", param="params")
    try:
        params = parse_synth_params(obj)
    except ProtocolError as exc:
        raise VoiceError(f"params: {exc.message}", param="params") from None
    return {k: getattr(params, k) for k in PARAM_KEYS if k in obj}


def decode_speaker(speaker: str) -> npt.NDArray[np.float32] | None:
    """Decode a ChatTTS speaker string (base16384 of raw-LZMA2 float16, as
    ``ChatTTS.model.Speaker._decode``, but bounded: see :mod:`rtts.core.speaker`); None
    when pybase16384 is not installed. Raises :class:`VoiceError` when it does not decode,
    decodes to more values than a speaker has, or holds non-finite values."""
    try:
        return _decode_bounded(speaker)
    except ImportError:
        return None
    except SpeakerError as exc:
        raise VoiceError(f"speaker: {exc}", param="speaker") from None


def check_speaker(speaker: Any, validate: Callable[[str], None] | None = None) -> str:
    """A speaker string the engine can use, else :class:`VoiceError` (400). ``validate``
    is the engine's check (dimension); the decode and finiteness checks are done here."""
    if not isinstance(speaker, str) or not 0 < len(speaker) <= MAX_SPEAKER_CHARS:
        raise VoiceError(f"speaker must be a non-empty string of at most {MAX_SPEAKER_CHARS} "
                         "characters", param="speaker")
    if speaker.startswith("seed:") or NAME_RE.match(speaker):
        raise VoiceError("speaker must be a ChatTTS speaker embedding string; give a seed "
                         "voice as \"seed\": N", param="speaker")
    decode_speaker(speaker)
    if validate is not None:
        try:
            validate(speaker)
        except (ValueError, ProtocolError) as exc:
            message = exc.message if isinstance(exc, ProtocolError) else str(exc)
            raise VoiceError(f"speaker: {message}", param="speaker") from None
    return speaker


def sample_json(sample: SpeakerSample) -> dict[str, str]:
    """A sample as a voice file (and a create request) holds it."""
    return {"codes": encode_codes(sample.codes, sample.num_vq), "text": sample.text}


def check_sample(obj: Any) -> SpeakerSample:
    """A voice's sample: ``{"codes": <ChatTTS packed codes>, "text": <transcript>}``,
    bounded (:data:`~rtts.core.params.MAX_SAMPLE_SECONDS` of codes), else VoiceError."""
    if not isinstance(obj, dict) or set(obj) - {"codes", "text"}:
        raise VoiceError("sample must be an object with codes and text", param="sample")
    text = obj.get("text", "")
    if not isinstance(text, str) or len(text) > MAX_SAMPLE_TEXT_CHARS:
        raise VoiceError(f"sample text must be a string of at most {MAX_SAMPLE_TEXT_CHARS} "
                         "characters", param="sample")
    try:
        codes, vq = decode_codes(obj.get("codes"),  # type: ignore[arg-type]
                                 max_frames=int(MAX_SAMPLE_SECONDS * FRAMES_PER_SECOND) + 1,
                                 max_code=1024)
    except SpeakerError as exc:
        raise VoiceError(f"sample: {exc}", param="sample") from None
    return SpeakerSample(codes, text, vq)


def _check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= 2**31 - 1:
        raise VoiceError("seed must be an integer from 0 to 2147483647", param="seed")
    return seed


def voice_from_json(obj: Any, name: str | None = None) -> Voice:
    """Validate a voice object (a file's content, or a create request without I/O)."""
    if not isinstance(obj, dict):
        raise VoiceError("a voice must be a JSON object")
    unknown = sorted(set(obj) - {"name", "speaker", "seed", "params", "created_at",
                                 "sample"})
    if unknown:
        raise VoiceError(f"unknown fields {', '.join(map(str, unknown))}")
    got = check_name(obj.get("name"))
    if name is not None and got != name:
        raise VoiceError(f"the file for {name!r} names {got!r}")
    speaker, seed = obj.get("speaker"), obj.get("seed")
    sample = check_sample(obj["sample"]) if obj.get("sample") is not None else None
    if speaker is not None and seed is not None or (
            speaker is None and seed is None and sample is None):
        raise VoiceError("give exactly one of seed (an integer) or speaker (a ChatTTS speaker "
                         "embedding string), or a sample", param="seed" if seed is not None
                         else "speaker")
    created = obj.get("created_at")
    if created is not None and (isinstance(created, bool) or not isinstance(
            created, int | float) or not math.isfinite(created)):
        raise VoiceError("created_at must be a number", param="created_at")
    return Voice(got, speaker=check_speaker(speaker) if speaker is not None else None,
                 seed=_check_seed(seed) if seed is not None else None,
                 params=parse_params(obj.get("params")),
                 created_at=float(created) if created is not None else None, sample=sample)


_BUILTINS: Final = {n: Voice(n, seed=s, builtin=True) for n, s in BUILTIN_VOICES.items()}


class VoiceStore:
    """Built-in voices plus ``directory/<name>.json`` (``directory=None``: built-ins only).

    Thread-safe; every lookup stats the file and re-reads it only when its mtime, size or
    inode changed, so it sees other instances' creates and deletes at once.
    """

    def __init__(self, directory: Path | None, reserved: Iterable[str] = (),
                 max_per_owner: int = 100) -> None:
        self.directory = directory
        self.reserved = frozenset(reserved)  # names nobody may create (e.g. OpenAI's)
        self.max_per_owner = max_per_owner
        self._cache: dict[Path, tuple[tuple[int, int, int], Voice | None]] = {}
        self._lock = threading.Lock()
        self.default_engine: str | None = None  # shown as the engine of seed/speaker voices
        self._engine_voices: dict[str, Voice] = {}  # other engines' voices (built-in)

    def add_engine_voice(self, voice: Voice) -> None:
        """Register another engine's voice (``voice.target``, e.g. ``piper:NAME``) under
        its name, as a built-in: it cannot be created over or deleted."""
        check_name(voice.name)
        if voice.name in _BUILTINS or voice.name in self._engine_voices:
            raise ValueError(f"two voices are named {voice.name!r}")
        self._engine_voices[voice.name] = voice

    def _stamp(self, voice: Voice) -> Voice:
        if voice.engine is None and self.default_engine is not None:
            return replace(voice, engine=self.default_engine)
        return voice

    def _builtin(self, name: str) -> Voice | None:
        voice = _BUILTINS.get(name) or self._engine_voices.get(name)
        return None if voice is None else self._stamp(voice)

    def _dir(self, owner: str | None) -> Path:
        assert self.directory is not None
        if owner is None:
            return self.directory
        if not _OWNER_RE.match(owner):
            raise ValueError("bad owner id")
        return self.directory / "by-key" / owner

    def _path(self, name: str, owner: str | None = None) -> Path:
        return self._dir(owner) / f"{name}.json"

    # -- reading ---------------------------------------------------------------------

    def get(self, name: str, owner: str | None = None) -> Voice | None:
        """The voice ``name`` as ``owner`` sees it: a built-in, ``owner``'s own, else a
        shared one (``owner=None``: built-ins and shared voices only)."""
        builtin = self._builtin(name)
        if builtin is not None:
            return builtin
        if self.directory is None or not NAME_RE.match(name):
            return None
        if owner is not None:
            own = self._read(self._path(name, owner), name)
            if own is not None:
                return own
        return self._read(self._path(name), name)

    def _read(self, path: Path, name: str) -> Voice | None:
        try:
            st = path.stat()
        except OSError:
            with self._lock:
                self._cache.pop(path, None)
            return None
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        with self._lock:
            cached = self._cache.get(path)
        if cached is not None and cached[0] == key:
            return None if cached[1] is None else self._stamp(cached[1])
        voice: Voice | None
        try:
            voice = voice_from_json(orjson.loads(path.read_bytes()), name)
        except FileNotFoundError:
            return None
        except (OSError, orjson.JSONDecodeError, VoiceError) as exc:
            logger.warning("ignoring voice file %s: %s", path, exc)
            voice = None
        with self._lock:
            self._cache[path] = (key, voice)
        return None if voice is None else self._stamp(voice)

    def _names(self, owner: str | None) -> list[str]:
        try:
            return sorted(p.name[:-5] for p in self._dir(owner).iterdir()
                          if p.name.endswith(".json") and not p.name.startswith(".")
                          and NAME_RE.match(p.name[:-5]))
        except OSError:
            return []

    def list(self, owner: str | None = None) -> list[Voice]:
        """Built-ins first (the primary engine's, then other engines'), then the stored
        voices ``owner`` may use (its own and the shared ones) by name."""
        stored: list[Voice] = []
        if self.directory is not None:
            names = set(self._names(None))
            own = set(self._names(owner)) if owner is not None else set()
            for name in sorted(names | own):
                if name in _BUILTINS or name in self._engine_voices:
                    continue
                voice = self.get(name, owner)
                if voice is not None:
                    stored.append(voice)
        return [*map(self._stamp, _BUILTINS.values()),
                *map(self._stamp, self._engine_voices.values()), *stored]

    # -- writing ---------------------------------------------------------------------

    def create(self, body: Any, validate: Callable[[str], None] | None = None,
               now: float | None = None, owner: str | None = None) -> Voice:
        """Validate and store a new voice from a create request (``name``, ``seed`` or
        ``speaker``, optional ``params``) as ``owner``'s (None: a shared voice);
        :class:`VoiceError` 400/409 (403 past ``max_per_owner``) otherwise."""
        if not isinstance(body, dict):
            raise VoiceError("the request body must be a JSON object")
        name = check_name(body.get("name"))
        self.check_new(name, owner)
        voice = voice_from_json({**body, "created_at": time.time() if now is None else now})
        if voice.speaker is not None:
            check_speaker(voice.speaker, validate)
        try:
            self._write_new(voice, owner)
        except VoiceError:
            raise
        except OSError as exc:  # read-only or full volume, permissions
            logger.error("cannot write voice %s to %s: %s", name, self.directory, exc)
            raise VoiceError(f"cannot store the voice: {exc.strerror or exc}",
                             status=500) from None
        return self._stamp(voice)

    def check_new(self, name: str, owner: str | None = None) -> None:
        """Whether ``owner`` may create ``name`` now (before costly work, e.g. encoding an
        uploaded clip); :class:`VoiceError` otherwise. :meth:`create` checks again."""
        check_name(name)
        if name in _BUILTINS or name in self._engine_voices or name in self.reserved:
            raise VoiceError(f"{name!r} is a built-in voice name", status=409, param="name")
        if self.directory is None:
            raise VoiceError("this server has no voices directory", status=403)
        if owner is not None:
            if self._path(name).exists():
                raise VoiceError(f"{name!r} is a shared voice name", status=409, param="name")
            if len(self._names(owner)) >= self.max_per_owner:
                raise VoiceError(f"at most {self.max_per_owner} voices per key; delete one "
                                 "first", status=403, param="name", api_code="voice_limit")
        if self._path(name, owner).exists():
            raise VoiceError(f"a voice named {name!r} exists", status=409, param="name")

    def _write_new(self, voice: Voice, owner: str | None = None) -> None:
        """Write to a temporary file, then link it to its name: atomic, and exclusive (a
        second instance creating the same name at once gets 409, never half a file)."""
        directory = self._dir(owner)
        directory.mkdir(parents=True, exist_ok=True)
        final = self._path(voice.name, owner)
        tmp = directory / f".{voice.name}.{uuid.uuid4().hex}.tmp"
        data = orjson.dumps(voice.to_file(), option=orjson.OPT_INDENT_2)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, final)
            except FileExistsError:
                raise VoiceError(f"a voice named {voice.name!r} exists", status=409,
                                 param="name") from None
            except OSError:  # no hard links on this filesystem: replace, after a check
                if final.exists():
                    raise VoiceError(f"a voice named {voice.name!r} exists", status=409,
                                     param="name") from None
                os.replace(tmp, final)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def delete(self, name: str, owner: str | None = None) -> None:
        """Delete ``owner``'s voice ``name`` (None: a shared voice)."""
        if name in _BUILTINS or name in self._engine_voices or name in self.reserved:
            raise VoiceError(f"{name!r} is a built-in voice; it cannot be deleted", status=403,
                             param="name")
        if self.directory is None or not NAME_RE.match(name):
            raise VoiceError(f"no voice named {name[:64]!r}", status=404, param="name")
        path = self._path(name, owner)
        try:
            path.unlink()
        except FileNotFoundError:
            if owner is not None and self._path(name).exists():
                raise VoiceError(f"{name!r} is a shared voice; only the operator changes "
                                 "it", status=403, param="name", api_code="shared_voice") from None
            raise VoiceError(f"no voice named {name!r}", status=404, param="name") from None
        with self._lock:
            self._cache.pop(path, None)

    # -- resolution ------------------------------------------------------------------

    def apply(self, params: SynthParams, owner: str | None = None) -> SynthParams:
        """``params`` with a registered voice name replaced by its speaker, and the voice's
        default params filling every param the request left at its protocol default
        (``seed`` unset; ``temperature`` 0.3, ``top_P`` 0.7, ``top_K`` 20, ``speed`` 5,
        ``refine`` false: a request cannot tell "not set" from "set to the default").
        Anything else (``seed:N``, a speaker string, an unknown name) is returned as is.
        ``owner``: whose voices the name may be (see :meth:`get`)."""
        name = params.voice
        if name is None or not NAME_RE.match(name):
            return params
        voice = self.get(name, owner)
        if voice is None:
            return params
        changes: dict[str, Any] = {"voice": voice.voice}
        if voice.sample is not None:
            changes["sample"] = voice.sample
        for key, value in voice.params.items():
            if getattr(params, key) == getattr(_DEFAULTS, key):
                changes[key] = value
        return replace(params, **changes)
