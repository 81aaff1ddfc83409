"""Wyoming (Home Assistant) text to speech: an optional TCP listener (``--wyoming-port``).

Events (the ``wyoming`` package's classes and framing: a JSON header line, then optional
data and payload bytes):

* ``describe`` -> ``info`` with one TTS program, ``rtts``: the voices (OpenAI's names and
  the named voices), ``supports_synthesize_streaming: true``;
* ``synthesize`` {text, voice.name} -> ``audio-start``, ``audio-chunk``… (PCM16 mono at
  the engine's rate, sent as it is made), ``audio-stop``;
* ``synthesize-start`` {voice} / ``synthesize-chunk`` {text}… / ``synthesize-stop`` ->
  ``audio-start``, ``audio-chunk``… (the first before ``synthesize-stop`` when enough
  text has arrived), ``audio-stop``, ``synthesize-stopped``. A ``synthesize`` that arrives
  while streaming is the compatibility copy Home Assistant also sends, and is ignored;
* ``ping`` -> ``pong``.

Bad input (not JSON, unknown event, a chunk without a start, an unknown voice) gets an
``error`` event {text, code}; the connection stays open unless the framing itself is broken
(a header line over 64 KiB or a payload over ``max_message_bytes``), which is answered
with an ``error`` event and then closed.

Deadlines (there is no key to hold anyone to account): a connection with no synthesis
running that sends no event for ``IDLE_TIMEOUT_S`` (30 s), and an event whose announced
data or payload does not arrive within ``EVENT_TIMEOUT_S`` (10 s), get an ``error`` event
with code ``timeout`` and are closed. A streamed synthesis takes at most
``max_text_chars_per_context`` characters (100,000), as the other protocols' contexts.
``describe`` lists only the shared named voices (never a key's own).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event, async_write_event
from wyoming.info import Attribution, Describe, Info, TtsProgram, TtsVoice
from wyoming.ping import Ping, Pong
from wyoming.tts import (
    Synthesize,
    SynthesizeChunk,
    SynthesizeStart,
    SynthesizeStop,
    SynthesizeStopped,
)

from rtts import __version__
from rtts.api.admission import ConnectionCounts
from rtts.api.tasks import OwnedTasks
from rtts.audio.pcm import float_to_pcm16
from rtts.core.context import Audio, Done, SegmentFailed, SpeechContext
from rtts.core.params import SynthParams
from rtts.core.service import Service, State
from rtts.core.voicenames import OPENAI_VOICES, resolve_voice
from rtts.errors import InternalError, ProtocolError, RttsError

__all__ = ["MAX_HEADER_BYTES", "WyomingListener", "parse_header"]

logger = logging.getLogger("rtts.wyoming")

MAX_HEADER_BYTES = 64 * 1024
IDLE_TIMEOUT_S = 30.0  # no event, nothing running: closed (an ``error`` event, code timeout)
EVENT_TIMEOUT_S = 10.0  # an event's data and payload arrive within this of its header
_WRITE_TIMEOUT_S = 10.0
_LANGUAGES = ["en", "zh"]


class WyomingError(RttsError):
    """Answered with a Wyoming ``error`` event (``text``, ``code``); ``fatal`` closes the
    connection after it (the framing is lost)."""

    def __init__(self, text: str, code: str, fatal: bool = False) -> None:
        super().__init__(text, code=code)
        self.text = text
        self.fatal = fatal



def parse_header(line: bytes) -> dict[str, Any]:
    """One Wyoming header line -> its dict (``type``, ``data``, ``data_length``,
    ``payload_length``), checked; :class:`WyomingError` when unusable. Pure."""
    try:
        header = json.loads(line)
    except ValueError:
        raise WyomingError("the event header is not valid JSON", "invalid_json") from None
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise WyomingError("the event header must be a JSON object with a string 'type'",
                        "invalid_event")
    if header.get("data") is not None and not isinstance(header["data"], dict):
        raise WyomingError("'data' must be an object", "invalid_event")
    for name in ("data_length", "payload_length"):
        n = header.get(name)
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
            raise WyomingError(f"'{name}' must be a non-negative integer", "invalid_event",
                            fatal=True)
    return header


class _Connection:
    """One Wyoming client: reads events, runs one synthesis at a time."""

    def __init__(self, listener: WyomingListener, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.listener = listener
        self.service = listener.service
        self.reader = reader
        self.writer = writer
        self.streaming: SpeechContext | None = None  # between synthesize-start and -stop
        self.streamed_chars = 0  # fed to ``streaming`` so far
        self.synthesis: asyncio.Task[None] | None = None
        self._tasks = OwnedTasks()

    @property
    def busy(self) -> bool:
        """A synthesis is running on this connection."""
        return bool(self._tasks)

    async def run(self) -> None:
        try:
            while True:
                try:
                    event = await self._read()
                    if event is None:
                        return
                    await self._handle(event)
                except WyomingError as exc:
                    self.service.stats.protocol_errors += 1
                    await self.write(Error(text=exc.text, code=exc.code).event())
                    if exc.fatal:
                        return
                except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
                    raise
                except Exception as exc:
                    error = InternalError.incident(logger, "wyoming event", exc)
                    await self.write(Error(text=error.message, code=str(error.code)).event())
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            pass
        finally:
            if self.streaming is not None:
                self.streaming.cancel()
            await self._tasks.cancel_all()
            self.writer.close()
            with contextlib.suppress(Exception):
                await self.writer.wait_closed()

    async def _readline(self) -> bytes:
        """The next header line; a connection with nothing running that sends no complete
        line for ``IDLE_TIMEOUT_S`` is closed (it held a connection slot forever)."""
        while True:
            try:
                async with asyncio.timeout(IDLE_TIMEOUT_S):
                    return await self.reader.readline()
            except TimeoutError:
                if self.busy:
                    continue  # a synthesis is running: the client is waiting for its audio
                raise WyomingError(f"no event for {IDLE_TIMEOUT_S:g} s", "timeout",
                                fatal=True) from None
            except ValueError:  # longer than the reader's limit: the framing is lost
                raise WyomingError(f"event header longer than {MAX_HEADER_BYTES} bytes",
                                "header_too_long", fatal=True) from None

    async def _readexactly(self, n: int) -> bytes:
        """An event's announced data or payload: all of it within ``EVENT_TIMEOUT_S``."""
        try:
            async with asyncio.timeout(EVENT_TIMEOUT_S):
                return await self.reader.readexactly(n)
        except TimeoutError:
            raise WyomingError(f"{n} bytes announced did not arrive within "
                            f"{EVENT_TIMEOUT_S:g} s", "timeout", fatal=True) from None

    async def _read(self) -> Event | None:
        line = b"\n"
        while not line.strip():  # (blank lines between events are allowed)
            line = await self._readline()
            if not line:
                return None
        header = parse_header(line)
        limit = self.service.config.max_message_bytes
        data = dict(header.get("data") or {})
        data_length = header.get("data_length") or 0
        payload_length = header.get("payload_length") or 0
        if data_length > limit or payload_length > limit:
            raise WyomingError(f"data or payload larger than {limit} bytes", "too_large",
                            fatal=True)
        if data_length:
            extra = await self._readexactly(data_length)
            try:
                more = json.loads(extra)
            except ValueError:
                raise WyomingError("event data is not valid JSON", "invalid_json") from None
            if not isinstance(more, dict):
                raise WyomingError("event data must be a JSON object", "invalid_event")
            data.update(more)
        payload = await self._readexactly(payload_length) if payload_length else None
        return Event(type=header["type"], data=data, payload=payload)

    async def write(self, event: Event) -> None:
        async with asyncio.timeout(_WRITE_TIMEOUT_S):
            await async_write_event(event, self.writer)

    # -- events

    async def _handle(self, event: Event) -> None:
        if Describe.is_type(event.type):
            await self.write(self.listener.info().event())
        elif Ping.is_type(event.type):
            await self.write(Pong(text=event.data.get("text")).event())
        elif SynthesizeStart.is_type(event.type):
            self._check_idle()
            ctx = self._open(_voice_name(event))
            self.streaming = ctx
            self.streamed_chars = 0
            self._run(ctx, streaming=True)
        elif SynthesizeChunk.is_type(event.type):
            if self.streaming is None:
                raise WyomingError("synthesize-chunk without synthesize-start", "not_streaming")
            text = _text(event)
            most = self.service.config.limits.max_text_chars_per_context
            if self.streamed_chars + len(text) > most:  # as the other protocols' contexts
                raise WyomingError(f"a streamed synthesis takes at most {most} characters",
                                "text_too_long")
            self._feed(self.streaming, text)
            self.streamed_chars += len(text)
        elif SynthesizeStop.is_type(event.type):
            if self.streaming is None:
                raise WyomingError("synthesize-stop without synthesize-start", "not_streaming")
            self.streaming.end()
            self.streaming = None
        elif Synthesize.is_type(event.type):
            if self.streaming is not None:
                return  # the copy of the streamed text that Home Assistant also sends
            self._check_idle()
            text = _text(event)
            if not text.strip():
                raise WyomingError("synthesize needs a non-empty 'text'", "invalid_text")
            ctx = self._open(_voice_name(event))
            self._feed(ctx, text)
            ctx.end()
            self._run(ctx, streaming=False)
        else:
            raise WyomingError(f"unknown event type {event.type[:64]!r}", "unknown_event")

    def _check_idle(self) -> None:
        if self.streaming is not None or (self.synthesis is not None
                                          and not self.synthesis.done()):
            raise WyomingError("a synthesis is already running on this connection", "busy")

    def _open(self, voice_name: Any) -> SpeechContext:
        service = self.service
        if service.state != State.READY:
            raise WyomingError(f"not ready: {service.state_reason}", "unavailable")
        voice: str | None = None
        if voice_name is not None:
            if not isinstance(voice_name, str):
                raise WyomingError("voice must be a string", "unknown_voice")
            try:
                voice = resolve_voice(voice_name, service)
            except ProtocolError as exc:
                raise WyomingError(exc.message, "unknown_voice") from None
        params = SynthParams(voice=voice)
        try:
            service.check_admission()
            service.validate_params(params)
        except RttsError as exc:
            raise WyomingError(exc.message, str(exc.code)) from None
        return service.open_context(params)

    def _feed(self, ctx: SpeechContext, text: str) -> None:
        limit = self.service.config.limits.max_text_chars_per_message
        if len(text) > limit:
            raise WyomingError(f"text longer than {limit} characters", "text_too_long")
        ctx.feed(text)

    def _run(self, ctx: SpeechContext, streaming: bool) -> None:
        self.synthesis = self._tasks.spawn(self._synthesize(ctx, streaming), "rtts-wyoming-synth")

    async def _synthesize(self, ctx: SpeechContext, streaming: bool) -> None:
        rate = ctx.sample_rate
        started = False
        events = ctx.events()
        try:
            async for event in events:
                if isinstance(event, Audio):
                    if not started:
                        started = True
                        await self.write(AudioStart(rate=rate, width=2, channels=1).event())
                    await self.write(AudioChunk(rate=rate, width=2, channels=1,
                                                audio=float_to_pcm16(event.samples)).event())
                    self.service.stats.frames_sent += 1
                elif isinstance(event, SegmentFailed):
                    await self.write(Error(text=event.error.message,
                                           code=str(event.error.code)).event())
                elif isinstance(event, Done):
                    if not started:
                        await self.write(AudioStart(rate=rate, width=2, channels=1).event())
                    await self.write(AudioStop().event())
                    if streaming:
                        await self.write(SynthesizeStopped().event())
        except (ConnectionError, TimeoutError):
            ctx.cancel()
        except Exception as exc:
            # A bug ended this synthesis: say so (Wyoming's error event), never go silent.
            ctx.cancel()
            error = InternalError.incident(logger, "wyoming synthesis", exc)
            with contextlib.suppress(ConnectionError, TimeoutError):
                await self.write(Error(text=error.message, code=str(error.code)).event())
        finally:
            ctx.close()
            await events.aclose()
            self.service.activity.set()


def _voice_name(event: Event) -> str | None:
    """``data.voice.name`` (the speaker and language are not used), checked."""
    voice = event.data.get("voice")
    if voice is None:
        return None
    name = voice.get("name") if isinstance(voice, dict) else voice
    if name is not None and not isinstance(name, str):
        raise WyomingError("'voice' must be an object with a string 'name'", "invalid_voice")
    return name


def _text(event: Event) -> str:
    text = event.data.get("text")
    if not isinstance(text, str):
        raise WyomingError(f"{event.type} needs a string 'text'", "invalid_text")
    return text


class WyomingListener:
    """The TCP listener; every connection's task is owned and cancelled by :meth:`stop`."""

    def __init__(self, service: Service, host: str, port: int) -> None:
        self.service = service
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None
        self._tasks = OwnedTasks()
        self.connections: set[_Connection] = set()
        self._counts = ConnectionCounts()  # open connections, by peer address

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.host, self.port,
                                                  limit=MAX_HEADER_BYTES)
        self.port = self._server.sockets[0].getsockname()[1]
        logger.info("Wyoming listening on tcp://%s:%d", self.host, self.port)

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A plain callback: the connection runs in a task of ours (cancelling the task
        # asyncio makes for a coroutine callback logs a spurious error on Python 3.11).
        # The same connection caps as the WebSockets: --max-connections in all,
        # --max-connections-per-client per peer address (no proxies speak Wyoming).
        cfg = self.service.config
        peer = writer.get_extra_info("peername")
        client = str(peer[0]) if isinstance(peer, tuple) and peer else "unknown"
        if self._counts.refusal(client, cfg.max_connections,
                                cfg.max_connections_per_client) is not None:
            self.service.stats.auth_rejected_by["client_connections"] += 1
            self._own(self._refuse(writer))
            return
        self._counts.add(client)
        self._own(self._serve(_Connection(self, reader, writer), client))

    def _own(self, coro: Any) -> None:
        self._tasks.spawn(coro, "rtts-wyoming-connection")

    @staticmethod
    async def _refuse(writer: asyncio.StreamWriter) -> None:
        """An ``error`` event (code ``too_many_connections``), then close."""
        try:
            async with asyncio.timeout(2.0):
                await async_write_event(Error(text="too many connections",
                                              code="too_many_connections").event(), writer)
        except (OSError, TimeoutError):
            pass
        finally:
            writer.close()

    async def _serve(self, conn: _Connection, client: str) -> None:
        self.connections.add(conn)
        try:
            await conn.run()
        finally:
            self.connections.discard(conn)
            self._counts.remove(client)
            self.service.activity.set()

    def busy(self) -> int:
        return sum(1 for c in self.connections if c.busy)

    async def close_listener(self) -> None:
        """Stop accepting (graceful drain: running syntheses go on)."""
        if self._server is not None:
            self._server.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._tasks.cancel_all()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    def info(self) -> Info:
        by = Attribution(name="2Noise/ChatTTS", url="https://github.com/2noise/ChatTTS")
        names = [*OPENAI_VOICES, *(v.name for v in self.service.voices.list())]
        voices = [TtsVoice(name=n, attribution=by, installed=True, version=None,
                           description=f"ChatTTS speaker {n}", languages=list(_LANGUAGES))
                  for n in names]
        return Info(tts=[TtsProgram(
            name="rtts", attribution=by, installed=True, version=__version__,
            description=f"rtts streaming TTS ({self.service.engine_name} engine)",
            voices=voices, supports_synthesize_streaming=True)])
