"""OpenAI-compatible speech: ``POST /v1/audio/speech``, ``GET /v1/models``,
``GET /v1/audio/models``, ``GET /v1/audio/voices``.

Request fields as OpenAI documents them: ``model`` (any id; see :data:`MODELS`),
``input`` (1-4096 characters), ``voice`` (a name or ``{"id": ...}``), ``response_format``
(``mp3`` default, ``opus`` (Ogg), ``aac``, ``flac``, ``wav``, ``pcm`` = raw s16le 24 kHz
mono; rtts also takes ``mulaw``, ``alaw`` and ``webm``), ``speed`` (0.25-4.0, mapped onto
ChatTTS's ``[speed_0]``..``[speed_9]``), ``instructions`` (mapped onto ChatTTS's refine
prompt where it names something ChatTTS has: :func:`refine_from_instructions`),
``stream_format`` (``audio``: the body is the audio file, streamed; ``sse``:
``speech.audio.delta`` events with base64 audio, then ``speech.audio.done``).

The body streams: the response starts when the first segment's first audio exists, and
each later piece is encoded and sent as the engine makes it.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, Final

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rtts.api.auth import Authenticator
from rtts.api.http.common import ApiError, authorize_listing, b64, read_body, sse
from rtts.api.http.speech import SpeechBody, SpeechRequest, speak
from rtts.audio.codecs import codec_for
from rtts.core.params import SynthParams
from rtts.core.service import Service
from rtts.core.voicenames import OPENAI_VOICES, speed_from_factor
from rtts.core.voicenames import resolve_voice as resolve_core_voice
from rtts.errors import ProtocolError
from rtts.text.ssml import INLINE_CHARS as SSML_INLINE_CHARS
from rtts.text.ssml import SsmlError
from rtts.text.ssml import parse as parse_ssml

__all__ = ["MAX_INPUT_CHARS", "MODELS", "VOICES", "OpenAIEndpoints", "resolve_voice"]

MAX_INPUT_CHARS: Final = 4096
# Any model id is accepted (clients hard-code these); all of them are this server's engine.
MODELS: Final = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts", "rtts")
VOICES: Final = OPENAI_VOICES  # OpenAI's names (rtts.core.voicenames)
OPENAI_FORMATS: Final = ("mp3", "opus", "aac", "flac", "wav", "pcm")
EXTRA_FORMATS: Final = ("mulaw", "alaw", "webm", "pcm16")
PCM_RATE: Final = 24000


def resolve_voice(voice: Any, service: Service, owner: str | None = None) -> str:
    """An OpenAI voice value (a name or ``{"id": name}``) -> the rtts ``voice`` string, or
    a 400 :class:`ApiError` (:func:`rtts.core.voicenames.resolve_voice`)."""
    if isinstance(voice, dict):
        voice = voice.get("id")
    if not isinstance(voice, str) or not voice:
        raise ApiError(400, "voice must be a voice name or {\"id\": name}", param="voice",
                       code="invalid_value")
    try:
        return resolve_core_voice(voice, service, owner)
    except ProtocolError as exc:
        raise ApiError(400, exc.message, param="voice", code="invalid_value") from None


def _bad(message: str, param: str | None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


# words in OpenAI ``instructions`` -> ChatTTS refine levels (oral 0-9, laugh 0-2,
# break 0-7); the first match per level wins, explicit tags ([oral_3]) win over words
_INSTRUCTION_WORDS: Final = (
    ("laugh", re.compile(r"\blaugh(s|ing|ter)?\b"), 2),
    ("laugh", re.compile(r"\b(cheerful|happy|joyful|playful|amused|giggl\w*)\b"), 1),
    ("oral", re.compile(r"\b(casual|conversational|chatty|relaxed|informal|natural)\b"), 6),
    ("oral", re.compile(r"\b(formal|precise|professional|newsreader|crisp)\b"), 0),
    ("breaks", re.compile(r"\b(pauses?|slow(ly)?|calm(ly)?|measured|thoughtful|soothing)\b"), 5),
    ("breaks", re.compile(r"\b(brisk|fast|quick(ly)?|urgent|energetic)\b"), 1),
)
_TAG_RE: Final = re.compile(r"\[(oral|laugh|break)_(\d)\]")
_TAG_LIMITS: Final = {"oral": 9, "laugh": 2, "break": 7}


def refine_from_instructions(instructions: str | None) -> dict[str, int]:
    """OpenAI's free-text ``instructions`` -> ChatTTS refine levels (``oral``, ``laugh``,
    ``breaks``): its own tags (``[oral_2][laugh_0][break_4]``) as given, else a few words
    (laughing, cheerful, casual, formal, pauses, slow, brisk...). Nothing matched: {} (no
    refine pass, which costs an extra GPT pass per segment)."""
    if not instructions:
        return {}
    out: dict[str, int] = {}
    for tag, level in _TAG_RE.findall(instructions[:2000]):
        key = "breaks" if tag == "break" else tag
        if key not in out and int(level) <= _TAG_LIMITS[tag]:
            out[key] = int(level)
    if out:
        return out
    lowered = instructions[:2000].lower()
    for key, pattern, value in _INSTRUCTION_WORDS:
        if key not in out and pattern.search(lowered):
            out[key] = value
    return out


def parse_speech_request(body: Any, service: Service, owner: str | None = None
                         ) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None, "invalid_json")
    for name in ("model", "input", "voice"):
        if body.get(name) is None:
            raise _bad(f"missing required parameter: '{name}'", name, "missing_required_parameter")
    model = body["model"]
    if not isinstance(model, str) or not model.strip():
        raise _bad("model must be a non-empty string", "model")
    text = body["input"]
    if not isinstance(text, str):
        raise _bad("input must be a string", "input")
    if not text.strip():
        raise _bad("input must not be empty", "input")
    if len(text) > MAX_INPUT_CHARS:
        raise _bad(f"input is {len(text)} characters; at most {MAX_INPUT_CHARS} are allowed",
                   "input", "string_above_max_length")
    voice = resolve_voice(body["voice"], service, owner)
    fmt = body.get("response_format") or "mp3"
    if not isinstance(fmt, str) or fmt not in OPENAI_FORMATS + EXTRA_FORMATS:
        raise _bad(f"response_format must be one of {', '.join(OPENAI_FORMATS)} "
                   f"(or {', '.join(EXTRA_FORMATS)})", "response_format")
    speed = body.get("speed", 1.0)
    if speed is None:
        speed = 1.0
    if isinstance(speed, bool) or not isinstance(speed, int | float) or not (
            0.25 <= speed <= 4.0):
        raise _bad("speed must be a number from 0.25 to 4.0", "speed")
    instructions = body.get("instructions")
    if instructions is not None and (not isinstance(instructions, str)
                                     or len(instructions) > MAX_INPUT_CHARS):
        raise _bad(f"instructions must be a string of at most {MAX_INPUT_CHARS} characters",
                   "instructions")
    stream_format = body.get("stream_format") or "audio"
    if stream_format not in ("audio", "sse"):
        raise _bad("stream_format must be 'audio' or 'sse'", "stream_format")
    ssml = body.get("ssml", False)  # rtts's own (the SDK sends it as extra_body)
    if not isinstance(ssml, bool):
        raise _bad("ssml must be true or false", "ssml")
    return {"input": text, "voice": voice, "format": fmt, "speed": speed_from_factor(float(speed)),
            "stream_format": stream_format, "ssml": ssml,
            "refine": refine_from_instructions(instructions)}


class OpenAIEndpoints:
    def __init__(self, service: Service, auth: Authenticator) -> None:
        self.service = service
        self.auth = auth

    def routes(self) -> list[Route]:
        return [
            Route("/v1/audio/speech", self.speech, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/v1/audio/models", self.audio_models, methods=["GET"]),
            Route("/v1/audio/voices", self.voices, methods=["GET"]),
        ]

    async def models(self, request: Request) -> Response:
        self._auth_only(request)
        return JSONResponse({"object": "list", "data": [_model(m) for m in MODELS]})

    async def model(self, request: Request) -> Response:
        self._auth_only(request)
        name = request.path_params["model"]
        if name not in MODELS:
            raise ApiError(404, f"the model {name!r} does not exist", param="model",
                           code="model_not_found")
        return JSONResponse(_model(name))

    async def audio_models(self, request: Request) -> Response:
        self._auth_only(request)
        return JSONResponse({"models": [{"id": m} for m in MODELS]})

    async def voices(self, request: Request) -> Response:
        owner = self._auth_only(request)
        names = [*VOICES, *(v.name for v in self.service.voices.list(owner))]
        return JSONResponse({"voices": [{"id": v, "name": v} for v in names]})

    def _auth_only(self, request: Request) -> str | None:
        """Authorize a listing; the key's voice owner id (None: no key, shared voices)."""
        kid = authorize_listing(self.auth, self.service, request)
        return self.auth.owner(kid) if kid else None

    async def speech(self, request: Request) -> Response:
        service = self.service
        parsed: list[dict[str, Any]] = []

        async def parse(owner: str | None) -> SpeechRequest:
            raw = await read_body(request, service.config.max_message_bytes,
                                  service.config.http_read_timeout_s)
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError:
                raise _bad("the request body is not valid JSON", None, "invalid_json") from None
            req = parse_speech_request(body, service, owner)
            parsed.append(req)
            pieces = None
            if req["ssml"]:
                text = req["input"]
                try:
                    pieces = tuple(parse_ssml(text) if len(text) <= SSML_INLINE_CHARS
                                   else await asyncio.to_thread(parse_ssml, text))
                except SsmlError as exc:
                    raise _bad(f"invalid SSML: {exc}", "input", "invalid_ssml") from None
                if not "".join(p.text for p in pieces).strip():
                    raise _bad("the SSML says nothing", "input", "invalid_ssml")
            return SpeechRequest(req["input"], SynthParams(voice=req["voice"],
                                                           speed=req["speed"], **req["refine"]),
                                 req["format"], PCM_RATE, pieces=pieces)

        stream = await speak(service, self.auth, request, parse)
        req = parsed[0]
        if req["stream_format"] == "sse":
            return stream.response(_sse(stream, len(req["input"])),
                                   media_type="text/event-stream")
        codec = codec_for(req["format"])
        assert codec is not None
        return stream.response(media_type=codec.media_type)


async def _sse(stream: SpeechBody, input_chars: int) -> Any:
    async for data in stream.chunks():
        yield sse({"type": "speech.audio.delta", "audio": b64(data)})
    if stream.error is not None:
        yield sse({"type": "error", "error": {"message": stream.error.message,
                                              "type": "server_error", "param": None,
                                              "code": str(stream.error.code)}})
        return
    samples = stream.done.samples if stream.done is not None else 0
    output_tokens = round(samples / stream.ctx.sample_rate * 50)  # one per 20 ms of audio
    yield sse({"type": "speech.audio.done",
               "usage": {"input_tokens": input_chars, "output_tokens": output_tokens,
                         "total_tokens": input_chars + output_tokens}})


def _model(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "rtts"}
