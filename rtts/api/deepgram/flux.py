"""Deepgram Flux (``/v2/speak``) on the core: turns on one socket, Interrupt and Configure.

The handshake is ``/v1/speak``'s (query options, key, :class:`WsAdmission`). Each turn is one
:class:`~rtts.core.context.SpeechContext`, opened by the first ``Speak`` after the previous
turn's ``Flush``; turns play in order (their audio carries no id), a later one synthesizing
while an earlier one plays. A turn's messages: ``SpeechStarted``, its binary audio,
``SpeechMetadata`` (``audio_duration_ms``, ``billable_character_count``), then ``Flushed``.
``Interrupt`` stops every unfinished turn at once (nothing more of them is sent) and answers
``SpeechInterrupted`` with the audio sent of the playing one; ``Configure {speed}`` applies
from the next turn. ``Close`` lets the turns finish, then closes 1000.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Final

import orjson
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from rtts import __version__
from rtts.api.compat import RawEncoder
from rtts.api.deepgram.protocol import (
    DeepgramError,
    SpeakOptions,
    configure_failure,
    configure_success,
    connected,
    flushed,
    parse_message,
    speech_interrupted,
    speech_metadata,
    speech_started,
    warning,
)
from rtts.api.sockets import close_within, receive_unless_idle, send_within
from rtts.api.tasks import OwnedTasks
from rtts.core.context import Audio, Done, SegmentFailed, SpeechContext
from rtts.core.params import SynthParams
from rtts.core.voicenames import speed_from_factor
from rtts.errors import (
    CLOSE_NORMAL,
    CLOSE_TRY_AGAIN_LATER,
    InternalError,
    ProtocolError,
    RttsError,
)

if TYPE_CHECKING:
    from rtts.api.deepgram.endpoint import DeepgramEndpoints

__all__ = ["FLUX_PATH", "FluxSocket"]

logger = logging.getLogger("rtts.deepgram")

FLUX_PATH: Final = "/v2/speak"


class _Turn:
    def __init__(self, speech: SpeechContext) -> None:
        self.speech_id = str(uuid.uuid4())
        self.speech = speech
        self.chars = 0
        self.ended = False
        self.flush_seq: int | None = None
        self.sent_samples = 0  # at the output rate


class FluxSocket:
    """One ``/v2/speak`` connection: the reader, and the task playing the turns in order."""

    def __init__(self, endpoint: DeepgramEndpoints, ws: ServerConnection, opts: SpeakOptions,
                 params: SynthParams, owner: str | None = None) -> None:
        self.endpoint = endpoint
        self.ws = ws
        self.opts = opts
        self.params = params
        self.owner = owner  # whose named voices the turns may use (None: shared only)
        self.account = owner  # whose usage its turns count as (the key's owner id)
        self.turns: deque[_Turn] = deque()  # unfinished, in order; the last may be open
        self.flushes = 0
        self._wake = asyncio.Event()
        self._player: asyncio.Task[None] | None = None
        self._tasks = OwnedTasks()
        self._closing = False

    @property
    def busy(self) -> bool:
        return bool(self.turns)

    async def run(self) -> None:
        try:
            service = self.endpoint.service
            if service.rejecting:
                service.stats.rejected += 1
                raise DeepgramError(f"server overloaded ({service.governor.reason}); retry "
                                    "later", "TOO_MANY_REQUESTS", close=CLOSE_TRY_AGAIN_LATER,
                                    fatal=True)
            await self.send(connected(str(uuid.uuid4()), self.opts.model, __version__))
            await self._reader()
        except DeepgramError as exc:
            with contextlib.suppress(ConnectionClosed):
                await self.send(exc.event())
            await self.close(exc.close, exc.code)
        except ConnectionClosed:
            pass
        finally:
            self._stop_all()
            await self._tasks.cancel_all()

    async def close(self, code: int, reason: str = "") -> None:
        if self._closing:
            return
        self._closing = True
        await close_within(self.ws, code, reason,
                           self.endpoint.service.config.close_timeout_s)

    async def send(self, message: dict[str, Any] | bytes) -> None:
        data = message if isinstance(message, bytes) else orjson.dumps(message).decode()
        await send_within(self.ws, data, self.endpoint.service.config.slow_client_timeout_s,
                          logger, "deepgram flux socket")
        if isinstance(message, bytes):
            self.endpoint.service.stats.frames_sent += 1

    # -- input

    async def _reader(self) -> None:
        limits = self.endpoint.service.config.limits
        while not self._closing:
            idle = self.endpoint.service.config.idle_timeout_s
            raw = await receive_unless_idle(self.ws, None if self.busy else idle)
            if raw is None:  # nothing sent and nothing playing: free the slot
                await self.close(CLOSE_NORMAL, "idle")
                return
            try:
                msg = parse_message(raw, max_text_chars=limits.max_text_chars_per_message,
                                    flux=True)
            except DeepgramError as exc:
                self.endpoint.service.stats.protocol_errors += 1
                if exc.code == "INVALID_SPEED":
                    await self.send(configure_failure(exc, _speed_of(raw)))
                else:
                    await self.send(exc.event())
                continue
            if msg.type == "Speak":
                self._speak(msg.text)
            elif msg.type == "Flush":
                seq = self.flushes
                self.flushes += 1
                turn = self.turns[-1] if self.turns and not self.turns[-1].ended else None
                if turn is None:
                    await self.send(flushed(seq))
                else:
                    turn.flush_seq = seq
                    turn.ended = True
                    turn.speech.end()
            elif msg.type == "Interrupt":
                await self._interrupt()
            elif msg.type == "Configure":
                await self._configure(msg.speed)
            else:  # Close
                if self.turns and not self.turns[-1].ended:
                    self.turns[-1].ended = True
                    self.turns[-1].speech.end()
                player = self._player
                if player is not None:
                    with contextlib.suppress(asyncio.CancelledError):
                        await player
                await self.close(CLOSE_NORMAL)
                return

    def _speak(self, text: str) -> None:
        if not text:
            return
        service = self.endpoint.service
        turn = self.turns[-1] if self.turns and not self.turns[-1].ended else None
        if turn is None:
            limit = service.config.limits.max_contexts
            if len(self.turns) >= limit:
                raise DeepgramError(f"at most {limit} turns may wait to be spoken",
                                    "TOO_MANY_TURNS", fatal=True)
            try:
                service.check_admission()
            except RttsError as exc:
                raise DeepgramError(exc.message, "TOO_MANY_REQUESTS",
                                    close=CLOSE_TRY_AGAIN_LATER, fatal=True) from None
            turn = _Turn(service.open_context(self.params, owner=self.owner))
            self.turns.append(turn)
            if self._player is None or self._player.done():
                self._player = self._tasks.spawn(self._play(), "rtts-deepgram-flux")
            self._wake.set()
        limit = service.config.limits.max_text_chars_per_context
        if turn.chars + len(text) > limit:
            raise DeepgramError(f"more than {limit} characters in one turn", "TEXT_TOO_LONG",
                                fatal=True)
        turn.chars += len(text)
        turn.speech.feed(text)

    async def _interrupt(self) -> None:
        if not self.turns:
            await self.send(warning("no speech to interrupt", "NO_ACTIVE_SPEECH"))
            return
        active = self.turns[0]
        played_ms = active.sent_samples * 1000 / self.opts.sample_rate
        await self._stop_player()
        self.endpoint.service.stats.cancels += 1
        await self.send(speech_interrupted(active.speech_id, played_ms))

    async def _configure(self, speed: float | None) -> None:
        if speed is not None:
            params = replace(self.params, speed=speed_from_factor(speed))
            try:
                self.endpoint.service.validate_params(params)
            except ProtocolError as exc:
                await self.send(configure_failure(DeepgramError(exc.message, "INVALID_SPEED"),
                                                  speed))
                return
            self.params = params
        await self.send(configure_success(speed))

    def _stop_all(self) -> None:
        for turn in self.turns:
            turn.speech.close()
        self.turns.clear()

    async def _stop_player(self) -> None:
        player, self._player = self._player, None
        self._stop_all()
        if player is not None:
            player.cancel()
            await asyncio.gather(player, return_exceptions=True)

    # -- output

    async def _play(self) -> None:
        try:
            while self.turns:
                await self._play_turn(self.turns[0])
                if self.turns:
                    self.turns.popleft()
        except (ConnectionClosed, asyncio.CancelledError):
            pass
        except Exception as exc:  # a bug ends the turns; a new Speak starts another
            error = InternalError.incident(logger, "deepgram flux turn", exc)
            self._stop_all()
            with contextlib.suppress(ConnectionClosed):
                await self.send(DeepgramError(error.message, "INTERNAL_SERVER_ERROR",
                                              fatal=True).event())
        finally:
            self.endpoint.service.activity.set()

    async def _play_turn(self, turn: _Turn) -> None:
        encoder = RawEncoder(self.opts.encoding, self.endpoint.service.sample_rate,
                             self.opts.sample_rate)
        width = {"s16": 2, "f32": 4}.get(self.opts.encoding, 1)
        events = turn.speech.events()
        started = False
        try:
            async for event in events:
                if isinstance(event, Audio):
                    data = encoder.encode(event.samples)
                    if data:
                        if not started:
                            started = True
                            await self.send(speech_started(turn.speech_id))
                        turn.sent_samples += len(data) // width
                        await self.send(data)
                elif isinstance(event, SegmentFailed):
                    err = event.error
                    await self.send(DeepgramError(err.message, "SYNTHESIS_FAILED",
                                                  fatal=True).event())
                elif isinstance(event, Done):
                    tail = encoder.finish()
                    if tail:
                        turn.sent_samples += len(tail) // width
                        await self.send(tail)
                    if not started:
                        await self.send(speech_started(turn.speech_id))
                    await self.send(speech_metadata(
                        turn.speech_id, turn.sent_samples * 1000 / self.opts.sample_rate,
                        turn.chars))
                    if turn.flush_seq is not None:
                        await self.send(flushed(turn.flush_seq))
                    return
        finally:
            turn.speech.close()
            await events.aclose()


def _speed_of(raw: str | bytes) -> Any:
    with contextlib.suppress(Exception):
        obj = orjson.loads(raw)
        if isinstance(obj, dict):
            return obj.get("speed")
    return None
