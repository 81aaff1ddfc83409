"""ElevenLabs-compatible text to speech: the two input-streaming sockets and the HTTP streams.

WebSocket (same port, routed here by path in :mod:`rtts.server`):

* ``/v1/text-to-speech/{voice_id}/stream-input``: one context. Client messages
  ``{"text": " ", "voice_settings", "generation_config": {"chunk_length_schedule"},
  "xi_api_key"}`` (the opener), ``{"text": "..."}`` pieces, ``{"flush": true}``,
  ``try_trigger_generation`` (accepted, no effect: rtts cuts at punctuation), and
  ``{"text": ""}`` (end of input). The server sends ``{"audio": base64, "isFinal": null,
  "alignment", "normalizedAlignment"}`` messages, then ``{"isFinal": true}``, then closes 1000.
* ``/v1/text-to-speech/{voice_id}/multi-stream-input``: up to ``max_contexts`` contexts,
  each message carrying ``context_id`` (every server message carries ``contextId``).
  ``{"text": "", "context_id"}`` is a keep-alive there; ``close_context`` ends a context's
  input (what was sent is still spoken, then its ``isFinal``); ``close_socket`` closes 1000.

HTTP: ``POST /v1/text-to-speech/{voice_id}`` and ``/stream`` (the audio, streamed) and
``/stream/with-timestamps`` (JSON lines ``{"audio_base64", "alignment",
"normalized_alignment"}`` with times in seconds from the start of the audio).

Alignment: rtts has no aligner; each segment's characters get estimated timings
(:mod:`rtts.text.timings`) once the segment's audio is complete, so a segment's
``alignment`` arrives in an extra message (``"audio": ""``) right after its last audio; the
characters include the whitespace between segments, so all ``chars`` of a context joined
give back its text. Times are in ms from that message's audio, the way ElevenLabs documents
them ("relative to the returned chunk", the ``elevenlabs`` SDK's ``Alignment``) and pipecat
reads them (it adds each message's span to a running clock); with ``sync_alignment=true``
in the URL (LiveKit's plugin always sends it, and reads the times as running from the
context's start) they run from the start of the context's audio instead. Both clients'
word timelines then increase through a reply.

``auto_mode=true`` (pipecat and LiveKit send it when they send whole sentences): every text
message is spoken at once, as if flushed; without it rtts cuts at punctuation.

The URL's voice, ``output_format`` and ``inactivity_timeout`` are checked at the handshake:
a bad one is refused with an HTTP status and ``{"detail": {"status", "message"}}``, as a
wrong key is, so no client sees an accepted socket close before it has registered.

Errors: the socket sends ElevenLabs' error message ``{"message", "error", "code"}`` (and
``contextId`` on multi-stream-input) and closes with ``code`` (1008 for bad input, 1013 when
overloaded); HTTP answers ``{"detail": {"status", "message"}}`` with a 4xx/5xx status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import urllib.parse
import weakref
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Final

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request as WsRequest
from websockets.http11 import Response as WsResponse

from rtts.api.admission import Principal, WsAdmission
from rtts.api.auth import Authenticator, AuthError
from rtts.api.handshake import respond
from rtts.api.http.common import ApiError, authorize_listing, b64, read_body
from rtts.api.http.speech import SpeechBody, SpeechRequest, speak
from rtts.api.sockets import OpenSockets, close_within, send_within
from rtts.api.tasks import OwnedTasks
from rtts.audio.codecs import Encoder, codec_for, open_encoder
from rtts.core.context import Audio, Done, SegmentDone, SegmentFailed, SegmentStarted
from rtts.core.params import SynthParams
from rtts.core.service import Service
from rtts.core.voicenames import OPENAI_VOICES, resolve_voice, speed_from_factor
from rtts.errors import (
    CLOSE_NORMAL,
    CLOSE_POLICY_VIOLATION,
    CLOSE_TRY_AGAIN_LATER,
    ErrorCode,
    InternalError,
    ProtocolError,
    RttsError,
)
from rtts.text.segmenter import DEFAULT_SCHEDULE
from rtts.text.ssml import INLINE_CHARS as SSML_INLINE_CHARS
from rtts.text.ssml import Piece, SsmlError, SsmlReader
from rtts.text.ssml import parse as parse_ssml
from rtts.text.timings import CharTimings, estimate

__all__ = ["PATH_PREFIX", "ClientMessage", "ElevenError", "ElevenLabsEndpoints",
           "OutputFormat", "parse_message", "parse_output_format", "resolve_voice_id",
           "seconds_alignment", "socket_kind"]

logger = logging.getLogger("rtts.elevenlabs")

PATH_PREFIX: Final = "/v1/text-to-speech/"
_SOCKET_PATH = re.compile(r"^/v1/text-to-speech/([^/]+)/(stream-input|multi-stream-input)$")
# ElevenLabs voice ids are 20 characters of [A-Za-z0-9]; any such short id is accepted.
_VOICE_ID = re.compile(r"^[A-Za-z0-9_\-.]{1,63}$")
# The HTTP stream endpoints' text limit (as ElevenLabs' own: 40,960 characters).
MAX_TEXT_CHARS: Final = 40_960
_PCM_RATES: Final = (8000, 16000, 22050, 24000, 32000, 44100, 48000)
_MP3: Final = {(22050, 32), (24000, 48), (44100, 32), (44100, 64), (44100, 96),
               (44100, 128), (44100, 192)}
_OPUS_KBPS: Final = (32, 64, 96, 128, 192)
DEFAULT_FORMAT: Final = "mp3_44100_128"
DEFAULT_INACTIVITY_S: Final = 20.0
FIRST_MESSAGE_S: Final = 5.0  # a socket without a key must send its first message by then
MAX_INACTIVITY_S: Final = 180.0
_VOICE_SEEDS: Final = 100_000


# -- pure parsing ------------------------------------------------------------------------


class ElevenError(RttsError):
    """An error answered with ElevenLabs' shape: ``message``, ``error`` (a code), and the
    WebSocket close code / HTTP status."""

    def __init__(self, message: str, error: str = "invalid_request", *,
                 close: int = CLOSE_POLICY_VIOLATION, status: int = 400) -> None:
        super().__init__(message, code=error)
        self.error = error
        self.close = close
        self.status = status

    def event(self, context_id: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"message": self.message, "error": self.error, "code": self.close}
        if context_id is not None:
            out["contextId"] = context_id
        return out


@dataclass(frozen=True, slots=True)
class OutputFormat:
    """An ElevenLabs ``output_format`` as an rtts codec, rate and bit rate."""

    name: str
    codec: str  # rtts.audio.codecs name
    sample_rate: int
    bit_rate: int | None = None


def parse_output_format(value: str | None) -> OutputFormat:
    """``pcm_8000``…``pcm_48000``, ``wav_8000``…``wav_48000`` (what litellm asks for when
    told ``response_format="wav"``), ``ulaw_8000``, ``alaw_8000``, ``mp3_RATE_KBPS``,
    ``opus_48000_KBPS`` -> :class:`OutputFormat`, else :class:`ElevenError`."""
    name = value or DEFAULT_FORMAT
    parts = name.split("_")
    try:
        nums = [int(p) for p in parts[1:]]
    except ValueError:
        nums = []
    kind = parts[0]
    if kind == "pcm" and len(nums) == 1 and nums[0] in _PCM_RATES:
        return OutputFormat(name, "pcm16", nums[0])
    if kind == "wav" and len(nums) == 1 and nums[0] in _PCM_RATES:
        return OutputFormat(name, "wav", nums[0])
    if kind in ("ulaw", "alaw") and nums == [8000]:
        return OutputFormat(name, "mulaw" if kind == "ulaw" else "alaw", 8000)
    if kind == "mp3" and len(nums) == 2 and (nums[0], nums[1]) in _MP3:
        return OutputFormat(name, "mp3", nums[0], nums[1] * 1000)
    if kind == "opus" and len(nums) == 2 and nums[0] == 48000 and nums[1] in _OPUS_KBPS:
        return OutputFormat(name, "opus", 48000, nums[1] * 1000)
    raise ElevenError(f"invalid output_format {name[:64]!r}: use pcm_8000|16000|22050|24000|"
                      "32000|44100|48000 (or wav_ at the same rates), ulaw_8000, alaw_8000, "
                      "mp3_44100_128 (and the other mp3_RATE_KBPS), or "
                      "opus_48000_32|64|96|128|192",
                      "invalid_output_format", status=422)


def resolve_voice_id(voice_id: str, service: Service, owner: str | None = None) -> str:
    """An ElevenLabs voice id -> the rtts ``voice``. OpenAI's names, named voices, ``seed:N``
    and ChatTTS speaker strings resolve as on ``/v1/audio/speech``; any other short id
    (such as ElevenLabs' own ``21m00Tcm4TlvDq8ikWAM``) is a fixed speaker drawn from a seed
    derived from the id (CRC-32 mod 100000), so existing client configs work and one id
    always sounds the same."""
    try:
        return resolve_voice(voice_id, service, owner)
    except ProtocolError as exc:
        if len(voice_id) >= 64 or not _VOICE_ID.match(voice_id):
            raise ElevenError(exc.message, "invalid_voice_id", status=400) from None
    return f"seed:{zlib.crc32(voice_id.encode()) % _VOICE_SEEDS}"


def speed_of(voice_settings: Any) -> int:
    """ElevenLabs' ``voice_settings.speed`` (0.7-1.2, 1.0 normal; rtts takes 0.25-4.0)
    -> ChatTTS speed (the other settings: :func:`settings_of`)."""
    if voice_settings is None:
        return 5
    if not isinstance(voice_settings, dict):
        raise ElevenError("voice_settings must be an object")
    speed = voice_settings.get("speed")
    if speed is None:
        return 5
    if isinstance(speed, bool) or not isinstance(speed, int | float) or not 0.25 <= speed <= 4:
        raise ElevenError("voice_settings.speed must be a number from 0.25 to 4.0")
    return speed_from_factor(float(speed))


def settings_of(voice_settings: Any) -> dict[str, Any]:
    """ElevenLabs' ``voice_settings`` -> :class:`SynthParams` fields, where they map:

    * ``speed`` -> ChatTTS speed (:func:`speed_of`);
    * ``stability`` (0-1, more is steadier) -> temperature ``0.55 - 0.5 * stability``
      (0.5 gives ChatTTS's 0.3; 1.0 gives 0.05);
    * ``similarity_boost`` (0-1, how closely to hold the voice) -> speaker anchoring: 0
      turns it off, anything else keeps it on;
    * ``style`` (0-1, style exaggeration) -> ChatTTS's refine prompt ``[oral_N]``,
      N = round(9 * style), when above 0 (runs the refine pass);
    * ``use_speaker_boost``: no ChatTTS counterpart, accepted and ignored.
    """
    out: dict[str, Any] = {"speed": speed_of(voice_settings)}
    if not voice_settings:
        return out
    values = {}
    for key in ("stability", "similarity_boost", "style"):
        value = voice_settings.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
            raise ElevenError(f"voice_settings.{key} must be a number from 0 to 1")
        values[key] = float(value)
    if "stability" in values:
        out["temperature"] = round(0.55 - 0.5 * values["stability"], 4)
    if values.get("similarity_boost") == 0:
        out["anchor"] = False
    if values.get("style", 0) > 0:
        out["oral"] = round(9 * values["style"])
    return out


def chunk_schedule(generation_config: Any, auto_mode: bool) -> tuple[int, ...]:
    """``generation_config.chunk_length_schedule`` -> the segmenter's schedule: characters
    buffered before a cut at the next punctuation. ``auto_mode`` (or no schedule) keeps
    rtts's default (8, 40, 80, 120), which cuts the first chunk early."""
    if generation_config is None:
        return DEFAULT_SCHEDULE
    if not isinstance(generation_config, dict):
        raise ElevenError("generation_config must be an object")
    schedule = generation_config.get("chunk_length_schedule")
    if schedule is None or auto_mode:
        return DEFAULT_SCHEDULE
    if (not isinstance(schedule, list) or not 1 <= len(schedule) <= 16 or not all(
            isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 500
            for n in schedule)):
        raise ElevenError("generation_config.chunk_length_schedule must be a list of 1-16 "
                          "integers from 1 to 500")
    return tuple(schedule)


@dataclass(frozen=True, slots=True)
class ClientMessage:
    """One client message of the input-streaming sockets, validated."""

    text: str | None = None
    context_id: str | None = None
    flush: bool = False
    close_context: bool = False
    close_socket: bool = False
    voice_settings: dict[str, Any] | None = None
    generation_config: dict[str, Any] | None = None
    xi_api_key: str | None = None
    authorization: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def parse_message(raw: str | bytes, *, max_text_chars: int) -> ClientMessage:
    """Parse and check one client message; :class:`ElevenError` (1008) if it is unusable.
    Unknown fields are ignored (``try_trigger_generation``, ``pronunciation_dictionary_…``)."""
    if isinstance(raw, bytes):
        raise ElevenError("binary messages are not accepted; send JSON text", "invalid_message")
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise ElevenError("message is not valid JSON", "invalid_message") from None
    if not isinstance(obj, dict):
        raise ElevenError("message must be a JSON object", "invalid_message")
    text = obj.get("text")
    if text is not None and not isinstance(text, str):
        raise ElevenError("text must be a string", "invalid_message")
    if text is not None and len(text) > max_text_chars:
        raise ElevenError(f"text is longer than {max_text_chars} characters", "text_too_long")
    cid = obj.get("context_id", obj.get("contextId"))
    if cid is not None and (not isinstance(cid, str) or not 1 <= len(cid) <= 128):
        raise ElevenError("context_id must be a string of 1-128 characters", "invalid_message")
    flags: dict[str, bool] = {}
    for name in ("flush", "close_context", "close_socket", "try_trigger_generation"):
        value = obj.get(name, False)
        if value is None:
            value = False
        if not isinstance(value, bool):
            raise ElevenError(f"{name} must be true or false", "invalid_message")
        flags[name] = value
    for name in ("voice_settings", "generation_config"):
        if obj.get(name) is not None and not isinstance(obj[name], dict):
            raise ElevenError(f"{name} must be an object", "invalid_message")
    key, auth = obj.get("xi_api_key"), obj.get("authorization")
    if key is not None and not isinstance(key, str) or auth is not None and not isinstance(
            auth, str):
        raise ElevenError("xi_api_key and authorization must be strings", "invalid_message")
    return ClientMessage(text=text, context_id=cid, flush=flags["flush"],
                         close_context=flags["close_context"],
                         close_socket=flags["close_socket"],
                         voice_settings=obj.get("voice_settings"),
                         generation_config=obj.get("generation_config"),
                         xi_api_key=key, authorization=auth)


def socket_kind(path: str) -> tuple[str, bool] | None:
    """``(voice_id, multi)`` for an input-streaming socket path, else None."""
    m = _SOCKET_PATH.match(path.split("?", 1)[0])
    if m is None:
        return None
    return urllib.parse.unquote(m.group(1)), m.group(2) == "multi-stream-input"


def _query(path: str) -> dict[str, str]:
    return {k: v[0] for k, v in urllib.parse.parse_qs(urllib.parse.urlsplit(path).query).items()}


def _bool(value: str | None, default: bool) -> bool:
    if value is None:
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def seconds_alignment(timings: CharTimings) -> dict[str, list[str] | list[float]]:
    """The HTTP ``with-timestamps`` shape: characters with start/end times in seconds."""
    return {"characters": list(timings.chars),
            "character_start_times_seconds": [s / 1000 for s in timings.start_ms],
            "character_end_times_seconds": [(s + d) / 1000 for s, d in
                                            zip(timings.start_ms, timings.duration_ms,
                                                strict=True)]}


@dataclass(frozen=True, slots=True)
class SocketOptions:
    """What an input-streaming socket's URL sets, checked before the upgrade is accepted."""

    fmt: OutputFormat
    voice: str
    inactivity_s: float = DEFAULT_INACTIVITY_S
    auto_mode: bool = False
    normalize: bool = True
    sync_alignment: bool = False
    ssml: bool = False  # enable_ssml_parsing: each context's text is read as SSML


def socket_options(voice_id: str, query: dict[str, str], service: Service,
                   owner: str | None = None) -> SocketOptions:
    """The URL's voice and query -> :class:`SocketOptions`, or :class:`ElevenError` (answered
    at the handshake with its HTTP status, so a client never sees an accepted socket close
    before it has sent anything)."""
    fmt = parse_output_format(query.get("output_format"))
    voice = resolve_voice_id(voice_id, service, owner)
    inactivity_s = DEFAULT_INACTIVITY_S
    raw = query.get("inactivity_timeout")
    if raw is not None:
        try:
            seconds = float(raw)
        except ValueError:
            seconds = -1.0
        if not 1 <= seconds <= MAX_INACTIVITY_S:
            raise ElevenError(f"inactivity_timeout must be 1-{MAX_INACTIVITY_S:.0f} "
                              "seconds", "invalid_inactivity_timeout")
        inactivity_s = seconds
    return SocketOptions(fmt, voice, inactivity_s, auto_mode=_bool(query.get("auto_mode"), False),
                         normalize=query.get("apply_text_normalization", "auto").lower() != "off",
                         sync_alignment=_bool(query.get("sync_alignment"), False),
                         ssml=_bool(query.get("enable_ssml_parsing"), False))


# -- the text an alignment covers --------------------------------------------------------


class _Aligner:
    """A context's input text and where the last segment ended: each segment's alignment
    covers the text since the previous segment (the whitespace between them included).
    Where two sentences were joined with no space (``dog.Please``: pipecat sends each
    sentence without its trailing space), the second segment's alignment starts with one,
    so a client that splits words at spaces does not read ``dog.Please`` as one word."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self._joined = ""
        self._dirty = False
        self.end = 0
        self.segments = 0

    def feed(self, text: str) -> None:
        self.text.append(text)
        self._dirty = True

    def skip(self, end: int) -> None:
        """A segment that failed: its text gets no alignment (it has no audio)."""
        self.end = max(self.end, end)

    def segment(self, start: int, end: int, spoken: str, duration_ms: float
                ) -> tuple[CharTimings, CharTimings]:
        if self._dirty:
            self._joined = "".join(self.text)
            self.text = [self._joined]
            self._dirty = False
        covered = self._joined[self.end:end]
        if (self.segments and covered and self.end > 0 and not covered[0].isspace()
                and not self._joined[self.end - 1].isspace()
                and covered[0].isascii() and covered[0].isalnum()):
            covered = " " + covered  # sentences joined with no space between them
        self.end = end
        lead = " " if self.segments else ""
        self.segments += 1
        return estimate(covered, duration_ms), estimate(lead + spoken, duration_ms)


# -- WebSocket ------------------------------------------------------------------------------


class _Context:
    def __init__(self, sock: _Socket, cid: str | None, params: SynthParams,
                 schedule: tuple[int, ...]) -> None:
        service = sock.endpoint.service
        self.cid = cid
        self.sock = sock
        self.speech = service.open_context(params, owner=sock.owner, schedule=schedule,
                                           normalize=sock.normalize)
        fmt = sock.options.fmt
        self.encoder: Encoder = open_encoder(fmt.codec, service.sample_rate,
                                             fmt.sample_rate, fmt.bit_rate)
        self.aligner = _Aligner()
        # enable_ssml_parsing: the text goes through an SSML reader (an element split over
        # messages is held until it closes); alignments then cover the text it reads out
        self.ssml = SsmlReader() if sock.options.ssml else None
        self.offset_ms = 0  # audio sent before the current segment (sync_alignment)
        self.chars = 0
        self.ended = False
        self.task: asyncio.Task[None] | None = None

    async def feed(self, text: str) -> None:
        limit = self.sock.endpoint.service.config.limits.max_text_chars_per_context
        if self.chars + len(text) > limit:
            raise ElevenError(f"more than {limit} characters in one context", "text_too_long")
        self.chars += len(text)
        if self.ssml is None:
            self.aligner.feed(text)
            self.speech.feed(text)
            return
        try:
            if len(text) <= SSML_INLINE_CHARS:
                pieces = self.ssml.feed(text)
            else:  # (this socket's messages are applied one at a time: the reader is ours)
                pieces = await asyncio.to_thread(self.ssml.feed, text)
            self._feed_pieces(pieces)
        except SsmlError as exc:
            raise ElevenError(f"invalid SSML: {exc}", "invalid_ssml") from None

    def _feed_pieces(self, pieces: list[Piece]) -> None:
        for piece in pieces:
            self.aligner.feed(piece.text)
        self.speech.feed_pieces(pieces)

    def end(self) -> None:
        if not self.ended:
            if self.ssml is not None:
                try:
                    self._feed_pieces(self.ssml.end())
                except SsmlError as exc:
                    raise ElevenError(f"invalid SSML: {exc}", "invalid_ssml") from None
            self.ended = True
            self.speech.end()

    async def run(self) -> None:
        sock, rate = self.sock, self.speech.sample_rate
        spans: dict[int, tuple[int, int, str]] = {}
        events = self.speech.events()
        try:
            async for event in events:
                if isinstance(event, Audio):
                    data = self.encoder.encode(event.samples)
                    if data:
                        await sock.send(self._msg(audio=b64(data)))
                elif isinstance(event, SegmentStarted):
                    spans[event.index] = (event.start, event.end, event.spoken)
                elif isinstance(event, SegmentDone):
                    start, end, spoken = spans.pop(event.index)
                    ms = event.samples * 1000 / rate
                    written, said = self.aligner.segment(start, end, spoken, ms)
                    if sock.options.sync_alignment:  # times from the context's start
                        written = written.shifted(self.offset_ms)
                        said = said.shifted(self.offset_ms)
                    self.offset_ms += round(ms)
                    await sock.send(self._msg(audio="", alignment=written.as_dict(),
                                              normalizedAlignment=said.as_dict()))
                elif isinstance(event, SegmentFailed):
                    span = spans.pop(event.index, None)
                    if span is not None:
                        self.aligner.skip(span[1])
                    err = event.error
                    await sock.send(ElevenError(err.message, str(err.code)).event(self.cid))
                elif isinstance(event, Done):
                    tail = self.encoder.finish()
                    if tail:
                        await sock.send(self._msg(audio=b64(tail)))
                    if self.aligner.segments:
                        # the input's trailing space (ElevenLabs wants every text to end
                        # with one), at the end of the audio: it completes the last word for
                        # clients that wait for a space (pipecat)
                        space = CharTimings((" ",), (self.offset_ms if sock.options
                                                     .sync_alignment else 0,), (0,)).as_dict()
                        await sock.send(self._msg(audio="", alignment=space,
                                                  normalizedAlignment=space))
                    final: dict[str, Any] = {"isFinal": True}
                    if self.cid is not None:
                        final["contextId"] = self.cid
                    await sock.send(final)
                    sock.context_done(self)
                    return
        finally:
            self.speech.close()
            await events.aclose()

    def _msg(self, **fields: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"audio": "", "isFinal": None, "normalizedAlignment": None,
                               "alignment": None}
        out.update(fields)
        if self.cid is not None:
            out["contextId"] = self.cid
        return out


class _Socket:
    """One ElevenLabs input-streaming connection: reader loop, one task per context."""

    def __init__(self, endpoint: ElevenLabsEndpoints, ws: ServerConnection,
                 options: SocketOptions, multi: bool, principal: Principal) -> None:
        self.endpoint = endpoint
        self.ws = ws
        self.options = options
        self.multi = multi
        self.principal = principal  # kid None: the key must come in the first message
        self.contexts: dict[str | None, _Context] = {}
        self.voice = options.voice
        self.auto_mode = options.auto_mode
        self.normalize = options.normalize
        self.inactivity_s = options.inactivity_s
        self._closing = False
        self._input_ended = False
        self._tasks = OwnedTasks()

    @property
    def owner(self) -> str | None:
        """Whose named voices this socket may use (None: the shared ones only; a key sent
        in the first message counts from then on)."""
        kid = self.principal.kid
        return self.endpoint.auth.owner(kid) if kid else None

    # -- lifecycle

    async def run(self) -> None:
        try:
            self._configure()
            await self._reader()
        except ElevenError as exc:
            await self.fail(exc)
        except ConnectionClosed:
            pass
        finally:
            for ctx in self.contexts.values():
                ctx.speech.close()
            await self._tasks.cancel_all()
            self.contexts.clear()

    def _configure(self) -> None:
        service = self.endpoint.service
        if service.rejecting:
            service.stats.rejected += 1
            raise ElevenError(f"server overloaded ({service.governor.reason}); retry later",
                              str(ErrorCode.OVERLOADED), close=CLOSE_TRY_AGAIN_LATER)

    async def close(self, code: int, reason: str = "") -> None:
        if self._closing:
            return
        self._closing = True
        await close_within(self.ws, code, reason,
                           self.endpoint.service.config.close_timeout_s)

    async def fail(self, exc: ElevenError, context_id: str | None = None) -> None:
        """Send the error message and close with its code."""
        self.endpoint.service.stats.protocol_errors += 1
        with contextlib.suppress(ConnectionClosed, TimeoutError):
            await self.send(exc.event(context_id if self.multi else None))
        await self.close(exc.close, exc.error[:100])

    async def send(self, message: dict[str, Any]) -> None:
        await send_within(self.ws, orjson.dumps(message).decode(),
                          self.endpoint.service.config.slow_client_timeout_s, logger,
                          "elevenlabs socket")
        if message.get("audio"):
            self.endpoint.service.stats.frames_sent += 1

    # -- input

    async def _reader(self) -> None:
        limits = self.endpoint.service.config.limits
        while not self._closing:
            keyless = self.principal.kid is None
            try:
                # a socket that has sent no key gets FIRST_MESSAGE_S for it, whatever its
                # inactivity_timeout (2,000 keyless sockets held every slot)
                async with asyncio.timeout(FIRST_MESSAGE_S if keyless else self.inactivity_s):
                    raw = await self.ws.recv()
            except TimeoutError:
                if keyless:
                    raise ElevenError(f"no key within {FIRST_MESSAGE_S:g} seconds (send "
                                      "xi_api_key in the first message)",
                                      "input_timeout_exceeded",
                                      close=CLOSE_POLICY_VIOLATION) from None
                if any(not c.ended for c in self.contexts.values()) or not self.contexts:
                    raise ElevenError(f"Have not received new text in {self.inactivity_s:g} "
                                      "seconds. Closing connection.",
                                      "input_timeout_exceeded") from None
                continue  # only finishing contexts: their audio is on its way
            msg = parse_message(raw, max_text_chars=limits.max_text_chars_per_message)
            if self.principal.kid is None:
                self.endpoint.admit_first_message(self.principal, msg)
            try:
                await self._apply(msg)
            except ProtocolError as exc:
                raise ElevenError(exc.message, str(exc.code)) from None

    async def _apply(self, msg: ClientMessage) -> None:
        if msg.close_socket:
            await self.close(CLOSE_NORMAL)
            return
        cid = (msg.context_id or "default") if self.multi else None
        ctx = self.contexts.get(cid)
        if msg.close_context:
            if ctx is not None:
                if msg.text:
                    await ctx.feed(msg.text)
                ctx.end()
            return
        if msg.text is None and not msg.flush:
            return  # nothing to do (a bare try_trigger_generation, unknown fields)
        if msg.text == "" and not msg.flush:
            if not self.multi and ctx is not None:
                ctx.end()  # end of input on stream-input
                self._input_ended = True
            return  # on multi-stream-input: a keep-alive
        if ctx is None:
            if not msg.text and msg.flush:
                return  # flushing a context that does not exist: nothing buffered
            if not self.multi and self._input_ended:
                raise ElevenError("the input has ended; open a new connection",
                                  "input_ended")
            ctx = self._open(cid, msg)
        if msg.text:
            await ctx.feed(msg.text)
        # auto_mode: each message is a whole sentence or phrase, spoken without waiting for
        # more (ElevenLabs: it "disables the chunk schedule and all buffers"); pipecat sends
        # an LLM reply sentence by sentence this way, without a flush
        if msg.flush or (self.auto_mode and msg.text and msg.text.strip()):
            ctx.speech.flush()

    def _open(self, cid: str | None, msg: ClientMessage) -> _Context:
        service = self.endpoint.service
        limit = service.config.limits.max_contexts
        if len(self.contexts) >= limit:
            raise ElevenError(f"Maximum simultaneous contexts per WebSocket connection "
                              f"exceeded ({limit}). Please close an existing context before "
                              "opening a new one.", "max_active_conversations")
        service.check_admission()
        params = SynthParams(voice=self.voice, **settings_of(msg.voice_settings))
        service.validate_params(params, self.owner)
        ctx = _Context(self, cid, params, chunk_schedule(msg.generation_config, self.auto_mode))
        self.contexts[cid] = ctx
        ctx.task = self._tasks.spawn(self._run_context(ctx), f"rtts-elevenlabs-{cid}")
        return ctx

    async def _run_context(self, ctx: _Context) -> None:
        try:
            await ctx.run()
        except ConnectionClosed:
            pass
        except Exception as exc:
            error = InternalError.incident(logger, f"elevenlabs context {ctx.cid!r}", exc)
            with contextlib.suppress(ConnectionClosed):
                await self.fail(ElevenError(error.message, "internal_error", close=1011))
        finally:
            self.endpoint.service.activity.set()

    def context_done(self, ctx: _Context) -> None:
        if self.contexts.get(ctx.cid) is ctx:
            del self.contexts[ctx.cid]
        if not self.multi:
            self._tasks.spawn(self.close(CLOSE_NORMAL), "rtts-elevenlabs-close")


class ElevenLabsEndpoints:
    """The ElevenLabs-compatible sockets (handshake + handler) and HTTP routes."""

    def __init__(self, service: Service, auth: Authenticator,
                 admission: WsAdmission | None = None) -> None:
        self.service = service
        self.auth = auth
        # the WebSocket admission the sockets share with the native one (one count of
        # connections and sessions per key); None for an HTTP-only instance
        self.admission = admission
        self.sockets: OpenSockets[_Socket] = OpenSockets()
        self._options: weakref.WeakKeyDictionary[ServerConnection, SocketOptions] = (
            weakref.WeakKeyDictionary())

    # -- WebSocket handshake and handler

    def process_request(self, connection: ServerConnection, request: WsRequest
                        ) -> WsResponse | None:
        """The same handshake checks as the native socket (readiness, connection caps,
        origin, key, quotas: :class:`~rtts.api.admission.WsAdmission`), with
        ``xi-api-key`` read as the key. Without any key while keys are required, the
        upgrade goes through and the first message must carry ``xi_api_key``."""
        kind = socket_kind(request.path)
        if kind is None:
            return respond(404, "not found: the ElevenLabs sockets are "
                                "/v1/text-to-speech/{voice_id}/stream-input and "
                                "/multi-stream-input\n")
        assert self.admission is not None
        refused = self.admission.handshake(connection, request,
                                           key=request.headers.get("xi-api-key"),
                                           key_later=True)
        if refused is not None:
            return refused
        try:  # an unknown voice or a bad query: refused now, as a wrong key is
            self._options[connection] = socket_options(
                kind[0], _query(request.path), self.service,
                self.admission.owner_of(connection))  # (None: no key yet, shared voices)
        except ElevenError as exc:
            self.service.stats.protocol_errors += 1
            return respond(exc.status, orjson.dumps(
                {"detail": {"status": exc.error, "message": exc.message}}),
                content_type="application/json")
        return None

    def admit_first_message(self, principal: Principal, msg: ClientMessage) -> None:
        """A key (``xi_api_key``) or ``authorization`` in the first message, when the
        handshake had none; the same identify and admit as the handshake."""
        assert self.admission is not None
        try:
            self.admission.identify_later(principal, msg.authorization,
                                                 msg.xi_api_key)
        except AuthError as exc:
            raise ElevenError(exc.reason, "invalid_api_key" if exc.status == 401 else
                              "quota_exceeded", close=CLOSE_POLICY_VIOLATION) from None

    async def handle(self, ws: ServerConnection) -> None:
        assert self.admission is not None
        kind = socket_kind(ws.request.path if ws.request is not None else "")
        assert kind is not None
        voice_id, multi = kind
        options = self._options.pop(ws, None)
        async with self.admission.session(ws) as principal:
            if principal is None:
                return
            if options is None:  # pragma: no cover - the handshake always sets them
                options = socket_options(voice_id, _query(ws.request.path if ws.request
                                                          else ""), self.service)
            await self.sockets.serve(_Socket(self, ws, options, multi, principal),
                                     self.service)

    def busy(self) -> int:
        return sum(1 for s in self.sockets if s.contexts)

    async def close_all(self) -> None:
        await self.sockets.close_all()

    # -- HTTP

    def routes(self) -> list[Route]:
        base = "/v1/text-to-speech/{voice_id}"
        return [Route(base, self.speech, methods=["POST"]),
                Route(base + "/stream", self.speech, methods=["POST"]),
                Route(base + "/stream/with-timestamps", self.timestamps, methods=["POST"]),
                Route(base + "/with-timestamps", self.timestamps, methods=["POST"])]

    def listing(self) -> dict[str, Any]:
        """ElevenLabs' listing GETs, by path: ``/v1/voices``, ``/v1/voices/{name}`` and
        ``/v1/models`` are also rtts's and OpenAI's paths, so the HTTP app answers a request
        that carries ``xi-api-key`` (every ElevenLabs client sends it: LiveKit, Open WebUI,
        the SDK) with these and any other with the rtts/OpenAI shape."""
        return {"/v1/voices": self.list_voices, "/v1/voices/{name}": self.get_voice,
                "/v1/models": self.list_models}

    def _voices(self, owner: str | None = None) -> list[dict[str, Any]]:
        builtin = [_voice_entry(name, "premade", "OpenAI voice name; a fixed rtts speaker")
                   for name in OPENAI_VOICES]
        named = [_voice_entry(v.name, "generated", "rtts named voice")
                 for v in self.service.voices.list(owner) if v.name not in OPENAI_VOICES]
        return builtin + named

    async def list_voices(self, request: Request) -> Response:
        """``GET /v1/voices``: ``{"voices": [{"voice_id", "name", "category", ...}]}``, every
        voice id this server speaks by name (any other short id is a seeded speaker)."""
        try:
            kid = authorize_listing(self.auth, self.service, request,
                                    key=request.headers.get("xi-api-key"))
        except ApiError as exc:
            return _http_error(exc.status, exc.code or "error", exc.message, exc.headers)
        voices = self._voices(self.auth.owner(kid) if kid else None)
        return JSONResponse({"voices": voices, "has_more": False, "total_count": len(voices),
                             "next_page_token": None}, headers={"Cache-Control": "no-store"})

    async def get_voice(self, request: Request) -> Response:
        try:
            kid = authorize_listing(self.auth, self.service, request,
                                    key=request.headers.get("xi-api-key"))
        except ApiError as exc:
            return _http_error(exc.status, exc.code or "error", exc.message, exc.headers)
        name = request.path_params["name"]
        for voice in self._voices(self.auth.owner(kid) if kid else None):
            if voice["voice_id"] == name:
                return JSONResponse(voice, headers={"Cache-Control": "no-store"})
        return _http_error(404, "voice_not_found", f"no voice with id {name[:64]!r}", {})

    async def list_models(self, request: Request) -> Response:
        """``GET /v1/models``: ElevenLabs' JSON array of models. Every id is this server's
        engine; the ids are the ones ElevenLabs clients default to."""
        try:
            authorize_listing(self.auth, self.service, request,
                              key=request.headers.get("xi-api-key"))
        except ApiError as exc:
            return _http_error(exc.status, exc.code or "error", exc.message, exc.headers)
        return JSONResponse([_model_entry(m, n) for m, n in _MODELS],
                            headers={"Cache-Control": "no-store"})

    async def speech(self, request: Request) -> Response:
        return await self._answer(request, timestamps=False)

    async def timestamps(self, request: Request) -> Response:
        return await self._answer(request, timestamps=True)

    async def _answer(self, request: Request, timestamps: bool) -> Response:
        try:
            return await self._stream(request, timestamps)
        except ApiError as exc:
            return _http_error(exc.status, exc.code or "error", exc.message, exc.headers)
        except ElevenError as exc:
            return _http_error(exc.status, exc.error, exc.message, {})

    async def _stream(self, request: Request, timestamps: bool) -> Response:
        service = self.service
        texts: list[str] = []
        formats: list[OutputFormat] = []

        async def parse(owner: str | None) -> SpeechRequest:
            fmt = parse_output_format(request.query_params.get("output_format"))
            formats.append(fmt)
            raw = await read_body(request, service.config.max_message_bytes,
                                  service.config.http_read_timeout_s)
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError:
                raise ElevenError("the request body is not valid JSON") from None
            if not isinstance(body, dict):
                raise ElevenError("the request body must be a JSON object")
            text = body.get("text")
            if not isinstance(text, str) or not text.strip():
                raise ElevenError("text is required: a non-empty string")
            if len(text) > MAX_TEXT_CHARS:
                raise ElevenError(f"text is longer than {MAX_TEXT_CHARS} characters")
            texts.append(text)
            voice = resolve_voice_id(request.path_params["voice_id"], service, owner)
            params = SynthParams(voice=voice, **settings_of(body.get("voice_settings")))
            normalize = str(body.get("apply_text_normalization", "auto")).lower() != "off"
            pieces = None
            if _bool(request.query_params.get("enable_ssml_parsing"), False):
                try:
                    pieces = tuple(parse_ssml(text) if len(text) <= SSML_INLINE_CHARS
                                   else await asyncio.to_thread(parse_ssml, text))
                except SsmlError as exc:
                    raise ElevenError(f"invalid SSML: {exc}", "invalid_ssml") from None
                text = "".join(p.text for p in pieces)
                if not text.strip():
                    raise ElevenError("the SSML says nothing", "invalid_ssml")
                texts[-1] = text  # the alignment covers what the SSML reads out
            return SpeechRequest(text, params, fmt.codec, fmt.sample_rate, fmt.bit_rate,
                                 normalize, pieces=pieces)

        stream = await speak(service, self.auth, request, parse,
                             key=request.headers.get("xi-api-key"))
        if timestamps:
            return stream.response(_json_lines(stream, texts[0]),
                                   media_type="application/json")
        codec = codec_for(formats[0].codec)
        assert codec is not None
        return stream.response(media_type=codec.media_type)


async def _json_lines(stream: SpeechBody, text: str) -> AsyncIterator[bytes]:
    """``with-timestamps``: one JSON line per piece of audio; a segment's alignment (times in
    seconds from the start of the whole audio) rides on the line after its last audio."""
    aligner = _Aligner()
    aligner.feed(text)
    rate = stream.ctx.sample_rate
    offset_ms = 0
    spans: dict[int, tuple[int, int, str]] = {}
    encoder = stream.encoder
    try:
        async for event in stream.events():
            if isinstance(event, Audio):
                data = encoder.encode(event.samples)
                if data:
                    yield _line(data, None, None)
            elif isinstance(event, SegmentStarted):
                spans[event.index] = (event.start, event.end, event.spoken)
            elif isinstance(event, SegmentDone):
                start, end, spoken = spans.pop(event.index)
                ms = event.samples * 1000 / rate
                written, said = aligner.segment(start, end, spoken, ms)
                yield _line(b"", written.shifted(offset_ms), said.shifted(offset_ms))
                offset_ms += round(ms)
            elif isinstance(event, SegmentFailed):
                break  # the status is sent: end the body early
        tail = encoder.finish()
        if tail:
            yield _line(tail, None, None)
    finally:
        await stream.aclose()


def _line(audio: bytes, written: CharTimings | None, said: CharTimings | None) -> bytes:
    return orjson.dumps({
        "audio_base64": b64(audio),
        "alignment": None if written is None else seconds_alignment(written),
        "normalized_alignment": None if said is None else seconds_alignment(said),
    }) + b"\n"


# ElevenLabs' model ids clients default to (LiveKit: eleven_turbo_v2_5, pipecat and the SDK:
# eleven_flash_v2_5 / eleven_multilingual_v2), all served by this server's engine
_MODELS: Final = (("eleven_flash_v2_5", "Flash v2.5 (rtts)"),
                  ("eleven_turbo_v2_5", "Turbo v2.5 (rtts)"),
                  ("eleven_multilingual_v2", "Multilingual v2 (rtts)"),
                  ("rtts", "rtts"))


def _voice_entry(name: str, category: str, description: str) -> dict[str, Any]:
    return {"voice_id": name, "name": name, "category": category, "labels": {},
            "description": description, "preview_url": None, "settings": None,
            "available_for_tiers": [], "high_quality_base_model_ids": [m for m, _ in _MODELS],
            "verified_languages": []}


def _model_entry(model_id: str, name: str) -> dict[str, Any]:
    return {"model_id": model_id, "name": name, "can_do_text_to_speech": True,
            "can_do_voice_conversion": False, "can_be_finetuned": False,
            "can_use_style": False, "can_use_speaker_boost": False,
            "serves_pro_voices": False, "requires_alpha_access": False,
            "token_cost_factor": 1.0, "description": "served by rtts",
            "maximum_text_length_per_request": MAX_TEXT_CHARS, "languages": []}


def _http_error(status: int, code: str, message: str, headers: dict[str, str]) -> Response:
    return JSONResponse({"detail": {"status": code, "message": message}}, status_code=status,
                        headers={"Cache-Control": "no-store", **headers})
