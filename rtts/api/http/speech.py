"""The one HTTP speech handler: ``/v1/tts``, OpenAI's ``/v1/audio/speech`` and the
ElevenLabs HTTP streams all answer through :func:`speak`.

A front-end parses its own request shape into a :class:`SpeechRequest` (its errors in its
own words); :func:`speak` does the rest the same way for all of them: authorize (origin,
key, per-key quota), check the server is ready, validate the params against the engine,
open the context with the server's defaults, feed the text, open the encoder, and wait
for the first audio, so a failure can still be answered with a status. The returned
:class:`SpeechBody` is the response body: :meth:`SpeechBody.response` for plain audio, or
:meth:`SpeechBody.events` for a front-end that wraps the audio (SSE, JSON lines). Whatever
happens, the key's concurrency slot is released exactly once, when the body ends or the
client goes away.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse

from rtts.api.auth import Authenticator
from rtts.api.http.common import (
    ApiError,
    DeadlineStreamingResponse,
    authorize,
    check_ready,
    overloaded,
)
from rtts.audio.codecs import Encoder, open_encoder
from rtts.core.context import Audio, Done, Event, SegmentFailed, SpeechContext
from rtts.core.params import SynthParams
from rtts.core.service import Service
from rtts.errors import ErrorCode, ProtocolError, RttsError
from rtts.text.ssml import Piece

__all__ = ["SpeechBody", "SpeechRequest", "segment_error", "speak"]


@dataclass(frozen=True, slots=True)
class SpeechRequest:
    """What a front-end asks to be spoken, in the core's terms."""

    text: str
    params: SynthParams
    codec: str  # an rtts.audio.codecs name
    sample_rate: int  # of the output
    bit_rate: int | None = None
    normalize: bool = True
    # an encoder of the front-end's own (input rate -> Encoder), for an output no codec
    # name covers (Cartesia's pcm_f32le); ``codec`` then only names it
    encoder: Callable[[int], Encoder] | None = None
    # the text read from SSML by the front-end (``text`` is then what they say, joined)
    pieces: tuple[Piece, ...] | None = None


def segment_error(exc: RttsError) -> ApiError:
    if exc.code == ErrorCode.OVERLOADED:
        return overloaded(exc.message, 429)
    return ApiError(500, exc.message, type="server_error", code=str(exc.code))


async def speak(service: Service, auth: Authenticator, request: Request,
                parse: Callable[[str | None], Awaitable[SpeechRequest]], *,
                key: str | None = None, header: bool = True) -> SpeechBody:
    """Authorize ``request``, ``parse(owner)`` it, and start speaking it (see the module
    doc); ``owner`` is the key's owner id, whose named voices the request may use (None:
    the shared ones). Raises :class:`ApiError` (or whatever ``parse`` raises) before any
    audio exists."""
    kid = authorize(auth, service, request, key=key, header=header)
    try:
        owner = auth.owner(kid)
        job = await parse(owner)
        check_ready(service)
        try:
            service.validate_params(job.params, owner)
        except ProtocolError as exc:
            raise ApiError(400, exc.message, code=str(exc.code)) from None
        ctx = service.open_context(job.params, owner=owner, normalize=job.normalize)
        service.stats.http_requests += 1
        if job.pieces is None:
            ctx.feed(job.text)
        else:
            ctx.feed_pieces(job.pieces)
        ctx.end()
        encoder = (job.encoder(service.sample_rate) if job.encoder is not None else
                   open_encoder(job.codec, service.sample_rate, job.sample_rate, job.bit_rate))
    except BaseException:
        auth.release(kid)
        raise
    body = SpeechBody(ctx, encoder, lambda: auth.release(kid))
    await body.start()
    return body


class SpeechBody:
    """A context whose audio leaves as one HTTP body, encoded as it is made.

    :meth:`start` waits for the first audio (or the first failure) so that an error can
    still be answered with a status; :meth:`chunks` then yields encoded bytes as segments
    arrive. The context is cancelled if the client goes away.
    """

    def __init__(self, ctx: SpeechContext, encoder: Encoder, release: Callable[[], None]
                 ) -> None:
        self.ctx = ctx
        self.encoder = encoder
        self._events = ctx.events()
        self._first: list[Event] = []
        self._release = release
        self.done: Done | None = None
        self.error: RttsError | None = None

    async def start(self) -> None:
        """Read events up to the first audio; raise :class:`ApiError` if none comes."""
        try:
            async for event in self._events:
                self._first.append(event)
                if isinstance(event, Audio):
                    return
                if isinstance(event, SegmentFailed):
                    raise segment_error(event.error)
                if isinstance(event, Done):
                    return
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        """End the body: cancel what is left of the context and release the key (once)."""
        self.ctx.cancel()
        with contextlib.suppress(Exception):
            await self._events.aclose()
        self._release()
        self._release = _nothing

    async def events(self) -> AsyncIterator[Event]:
        """Every event of the context, from the first (those :meth:`start` read included)."""
        for event in self._first:
            yield event
        self._first.clear()
        async for event in self._events:
            yield event

    async def chunks(self) -> AsyncIterator[bytes]:
        """Encoded audio as it is made; the encoder's tail at the end."""
        try:
            async for event in self.events():
                if isinstance(event, Audio):
                    data = self.encoder.encode(event.samples)
                    if data:
                        yield data
                elif isinstance(event, SegmentFailed):
                    self.error = event.error  # the status is sent: end the body early
                    break
                elif isinstance(event, Done):
                    self.done = event
            tail = self.encoder.finish()
            if tail:
                yield tail
        finally:
            await self.aclose()

    def response(self, content: AsyncIterator[bytes] | None = None, *, media_type: str,
                 headers: dict[str, str] | None = None) -> StreamingResponse:
        """The streamed response: ``content`` (default: :meth:`chunks`), closed with the
        body whether it ends, fails or the client leaves."""
        return DeadlineStreamingResponse(
            self.chunks() if content is None else content, media_type=media_type,
            headers={"Cache-Control": "no-store", **(headers or {})},
            background=BackgroundTask(self.aclose),
            write_timeout_s=self.ctx.service.config.http_write_timeout_s)


def _nothing() -> None:
    return None
