"""Long-text jobs over HTTP: ``POST /v1/jobs``, ``GET /v1/jobs/{id}``,
``GET /v1/jobs/{id}/audio``, ``DELETE /v1/jobs/{id}``.

The upload is read as it arrives (``text/plain`` body, options in the query; or a JSON
body) and cut into segments on the way (:class:`rtts.jobs.model.JobSplitter`), which go
to Redis in batches; the job is queued once the upload is complete. Workers
(:mod:`rtts.jobs.worker`) do the synthesis. The audio download concatenates the stored
segments in order, reading each file in pieces, and follows a running job until its end
(or the chapter's end). Every endpoint goes through :func:`~rtts.api.http.common.authorize`
(key, origin and per-key quota); a job is visible only to the key that made it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rtts.api.auth import Authenticator
from rtts.api.http.common import (
    ApiError,
    DeadlineStreamingResponse,
    JsonCommas,
    authorize,
    check_ready,
    read_body,
    read_timeout_error,
    speech_options,
)
from rtts.audio.codecs import codec_for, output_rate
from rtts.core.params import SpeechOptions
from rtts.core.service import Service
from rtts.core.voices import NAME_RE
from rtts.jobs.model import (
    JOB_FORMATS,
    JobSplitter,
    JobState,
    chapter_segments,
    eta_seconds,
    parse_chapters,
    wav_header,
)
from rtts.jobs.store import JobRecord, JobStore

__all__ = ["JOBS_OPENAPI", "JobEndpoints"]

logger = logging.getLogger("rtts.api.jobs")

_READ_BYTES: Final = 256 * 1024
_JOB_ID_RE: Final = re.compile(r"^[0-9a-f]{32}$")  # uuid4().hex
_POLL_S: Final = 0.25
# values a JSON job body may hold besides its chapter marks: its options, and fields that
# are not the server's (ignored), with room to spare
_JSON_OPTION_VALUES: Final = 1024


Handler = Callable[[Request], Awaitable[Response]]


def _queue_errors(handler: Handler) -> Handler:
    """Redis unreachable: a 503 with ``Retry-After``, not a 500."""
    from redis.exceptions import RedisError

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except (RedisError, ConnectionError) as exc:
            logger.warning("job queue unavailable: %s", exc)
            raise ApiError(503, "the job queue is unavailable; retry later",
                           type="server_error", code="queue_unavailable",
                           headers={"Retry-After": "5"}) from None

    return wrapped


class JobEndpoints:
    def __init__(self, service: Service, auth: Authenticator, store: JobStore) -> None:
        self.service = service
        self.auth = auth
        self.store = store

    def routes(self) -> list[Route]:
        return [
            Route("/v1/jobs", _queue_errors(self.submit), methods=["POST"]),
            Route("/v1/jobs/{job}", _queue_errors(self.status), methods=["GET"]),
            Route("/v1/jobs/{job}", _queue_errors(self.cancel), methods=["DELETE"]),
            Route("/v1/jobs/{job}/audio", _queue_errors(self.audio), methods=["GET"]),
        ]

    # -- POST /v1/jobs -----------------------------------------------------------------

    def _options(self, options: dict[str, Any], owner: str | None = None
                 ) -> tuple[SpeechOptions, str, list[Any]]:
        fmt = str(options.get("format") or "mp3")
        codec = codec_for(fmt)
        if codec is None or codec.name not in JOB_FORMATS:
            raise ApiError(400, f"format must be one of {', '.join(JOB_FORMATS)} (segments "
                                "are stored apart and concatenated)", param="format",
                           code="invalid_format")
        given = {k: v for k, v in options.items() if v is not None and v != ""}
        voice = given.get("voice")
        if isinstance(voice, str) and NAME_RE.match(voice) \
                and self.service.voices.get(voice, owner) is None:
            raise ApiError(404, f"no voice named {voice!r} (see GET /v1/voices)",
                           param="voice", code="unknown_voice")
        msg = speech_options(self.service, given)
        chapters = options.get("chapters") or []
        most = self.store.config.max_chapters
        # counted before anything is parsed or expanded (a million marks took 12.7 s)
        if (isinstance(chapters, str) and chapters.count(",") >= most) or (
                isinstance(chapters, list) and len(chapters) > most):
            raise ApiError(400, f"at most {most} chapter marks", param="chapters",
                           code="too_many_chapters")
        if isinstance(chapters, str):
            try:
                chapters = [int(x) for x in chapters.split(",") if x.strip()]
            except ValueError:
                raise ApiError(400, "chapters must be comma-separated character offsets",
                               param="chapters") from None
        if not isinstance(chapters, list):
            raise ApiError(400, "chapters must be a list", param="chapters")
        return msg, codec.name, chapters

    def _value_bound(self) -> Callable[[bytes], None]:
        """A JSON body's check as it arrives (:func:`read_body`'s ``scan``): refused once it
        holds more values than a job's chapter marks and options can be, before it is whole
        and before it is parsed. (Parsing a million chapter marks held the GIL, and so the
        event loop, for ~40 ms, and made ~36 MB of integers, for each such body.)"""
        most = self.store.config.max_chapters
        commas = JsonCommas()

        def scan(piece: bytes) -> None:
            if commas.feed(piece) > most + _JSON_OPTION_VALUES:
                raise ApiError(400, f"at most {most} chapter marks (the JSON body holds more "
                                    "values than a job's chapters and options)",
                               param="chapters", code="too_many_chapters")
        return scan

    async def submit(self, request: Request) -> Response:
        kid = authorize(self.auth, self.service, request)
        try:
            check_ready(self.service)
            limit = self.store.config.max_upload_bytes
            declared = request.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise ApiError(413, f"text larger than {limit} bytes", code="body_too_large")
            ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
            body: bytes | None = None
            if ctype == "application/json":
                raw = await read_body(request, limit + 64 * 1024,
                                      self.service.config.http_read_timeout_s,
                                      scan=self._value_bound())
                try:  # up to 16 MiB: parsed off the event loop
                    obj = (orjson.loads(raw) if len(raw) < 64 * 1024
                           else await asyncio.to_thread(orjson.loads, raw))
                except orjson.JSONDecodeError as exc:
                    raise ApiError(400, f"invalid JSON: {exc}", code="invalid_json") from None
                if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                    raise ApiError(400, "a JSON body needs \"text\" (a string)", param="text")
                options: dict[str, Any] = obj
                body = obj["text"].encode()
                if len(body) > limit:
                    raise ApiError(413, f"text larger than {limit} bytes",
                                   code="body_too_large")
            else:
                options = dict(request.query_params)
            owner = self.auth.owner(kid)
            msg, fmt, raw_chapters = self._options(options, owner)
            try:
                chapters = parse_chapters(raw_chapters, self.store.config.max_chapters)
            except ValueError as exc:
                raise ApiError(400, str(exc), param="chapters") from None
            queued_chars = await self._check_holdings(kid)
            job = uuid.uuid4().hex
            rate = output_rate(codec_for(fmt), msg.sample_rate)  # type: ignore[arg-type]
            # the voice resolves once, now: every segment speaks the voice the name had at
            # submit, whatever happens to the name later (the worker resolves nothing)
            resolved = self.service.voices.apply(msg.params, owner)
            params = {k: getattr(resolved, k) for k in resolved.__dataclass_fields__}
            await self.store.begin(job, kid, fmt, rate, params)
            try:
                record = await self._upload(job, request, body, chapters, kid, queued_chars)
            except BaseException:
                with contextlib.suppress(Exception):
                    await self.store.discard(job, kid)
                raise
        finally:
            self.auth.release(kid)
        return JSONResponse(self._view(record), status_code=202,
                            headers={"Location": f"/v1/jobs/{job}", "Cache-Control": "no-store"})

    async def _check_holdings(self, kid: str) -> int:
        """429 when the key holds as many unfinished jobs, as much queued text or as much
        stored audio as it may; else the characters it has queued."""
        cfg = self.store.config
        unfinished, chars, audio = await self.store.holdings(kid)
        most = cfg.max_jobs_per_key if self.auth.enabled else cfg.max_jobs_without_keys
        if unfinished >= most:
            raise ApiError(429, f"at most {most} unfinished jobs "
                           f"{'per key' if self.auth.enabled else 'on this server'}",
                           type="requests", code="job_quota", headers={"Retry-After": "60"})
        if chars >= cfg.max_queued_chars_per_key:
            raise ApiError(429, f"at most {cfg.max_queued_chars_per_key} characters of "
                           "unfinished jobs per key", type="requests", code="job_quota",
                           headers={"Retry-After": "60"})
        if audio >= cfg.max_audio_bytes_per_key:
            raise ApiError(429, f"the key's jobs hold {audio} bytes of audio (at most "
                           f"{cfg.max_audio_bytes_per_key}); delete finished jobs first",
                           type="requests", code="job_quota", headers={"Retry-After": "60"})
        return chars

    async def _upload(self, job: str, request: Request, body: bytes | None,
                      chapters: list[Any], owner: str = "", queued_chars: int = 0
                      ) -> JobRecord:
        cfg = self.store.config
        room = cfg.max_queued_chars_per_key - queued_chars
        splitter = JobSplitter(chapters, cfg.segment_chars, cfg.min_segment_chars)
        batch: list[str] = []
        received = 0

        async def add(texts: list[str], final: bool = False) -> None:
            if splitter.chars > room:
                raise ApiError(413, f"the key's unfinished jobs would pass "
                               f"{cfg.max_queued_chars_per_key} characters",
                               code="body_too_large")
            batch.extend(texts)
            if batch and (final or len(batch) >= 500):
                await self.store.add_segments(job, batch)
                batch.clear()

        try:
            if body is not None:
                await add([c.text for c in splitter.feed_bytes(body, final=True)])
            else:
                async for piece in _by_deadline(request.stream(),
                                                self.service.config.http_read_timeout_s):
                    received += len(piece)
                    if received > cfg.max_upload_bytes:
                        raise ApiError(413, f"text larger than {cfg.max_upload_bytes} bytes",
                                       code="body_too_large")
                    await add([c.text for c in splitter.feed_bytes(piece)])
                await add([c.text for c in splitter.feed_bytes(b"", final=True)])
        except UnicodeDecodeError:
            raise ApiError(400, "the text is not valid UTF-8", param="text",
                           code="invalid_text") from None
        await add([c.text for c in splitter.finish()], final=True)
        if splitter.segments == 0:
            raise ApiError(400, "the text is empty (nothing to say)", param="text",
                           code="empty_text")
        await self.store.commit(job, splitter.segments, splitter.chars,
                                splitter.chapter_table(), owner)
        record = await self.store.get(job)
        assert record is not None
        logger.info("job %s: %d characters, %d segments, %d chapters", job, splitter.chars,
                    splitter.segments, len(splitter.chapters))
        return record

    # -- GET / DELETE ------------------------------------------------------------------

    async def _own(self, request: Request, kid: str) -> JobRecord:
        job = request.path_params["job"]
        if not _JOB_ID_RE.match(job):  # ("<id>:segs" named another Redis key of the job)
            raise ApiError(404, "no such job", code="not_found")
        record = await self.store.get(job)
        if record is None or record.owner != kid or record.state == "uploading":
            raise ApiError(404, "no such job", code="not_found")
        return record

    def _view(self, r: JobRecord) -> dict[str, Any]:
        codec = codec_for(r.format)
        chapters = []
        for c in r.chapters:
            segs = chapter_segments(r.chapters, r.total, c.index)
            chapters.append({"index": c.index, "title": c.title, "start": c.start,
                             "segments": [segs.start, segs.stop],
                             "audio_url": f"/v1/jobs/{r.id}/audio?chapter={c.index}"})
        return {
            "id": r.id, "state": r.state, "format": r.format,
            "media_type": codec.media_type if codec else "", "sample_rate": r.sample_rate,
            "characters": r.chars, "segments_total": r.total, "segments_done": r.done,
            "audio_seconds": round(r.samples / r.sample_rate, 3) if r.sample_rate else 0.0,
            "eta_seconds": None if r.final and r.state != JobState.DONE else eta_seconds(
                r.total, r.done, r.started, r.finished or time.time()),
            "created_at": r.created, "started_at": r.started, "finished_at": r.finished,
            "error": r.error or None, "chapters": chapters,
            "audio_url": f"/v1/jobs/{r.id}/audio"}

    async def status(self, request: Request) -> Response:
        kid = authorize(self.auth, self.service, request)
        try:
            record = await self._own(request, kid)
        finally:
            self.auth.release(kid)
        return JSONResponse(self._view(record), headers={"Cache-Control": "no-store"})

    async def cancel(self, request: Request) -> Response:
        """Cancel a job that has not finished (200, its status); forget a finished one and
        delete its audio (204)."""
        kid = authorize(self.auth, self.service, request)
        try:
            record = await self._own(request, kid)
            if not await self.store.cancel(record.id):
                await self.store.delete(record.id, record.owner)
                return Response(status_code=204, headers={"Cache-Control": "no-store"})
            record = await self._own(request, kid)
        finally:
            self.auth.release(kid)
        return JSONResponse(self._view(record), headers={"Cache-Control": "no-store"})

    # -- GET /v1/jobs/{id}/audio -------------------------------------------------------

    async def audio(self, request: Request) -> Response:
        kid = authorize(self.auth, self.service, request)
        try:
            record = await self._own(request, kid)
            if record.state in (JobState.CANCELLED, JobState.FAILED):
                raise ApiError(409, f"the job is {record.state}"
                               + (f": {record.error}" if record.error else ""),
                               code=f"job_{record.state}")
            raw = request.query_params.get("chapter")
            if raw is None:
                segs = range(record.total)
            elif raw.isdigit() and int(raw) < len(record.chapters):
                segs = chapter_segments(record.chapters, record.total, int(raw))
            else:
                raise ApiError(400, f"chapter must be 0-{len(record.chapters) - 1}",
                               param="chapter")
            headers = {"Cache-Control": "no-store", "X-Sample-Rate": str(record.sample_rate)}
            head = b""
            if record.state == JobState.DONE:
                size = await self._size(record, segs)
                if record.format == "wav":
                    head = wav_header(record.sample_rate, size)
                headers["Content-Length"] = str(size + len(head))
            elif record.format == "wav":
                head = wav_header(record.sample_rate, None)  # still growing
            codec = codec_for(record.format)
            assert codec is not None
        except BaseException:
            self.auth.release(kid)
            raise
        return DeadlineStreamingResponse(
            self._body(record, segs, head, kid), media_type=codec.media_type,
            headers=headers, write_timeout_s=self.service.config.http_write_timeout_s)

    async def _size(self, record: JobRecord, segs: range) -> int:
        if record.format in ("wav", "pcm16"):
            return 2 * await self.store.samples_of(record.id, segs)

        def total() -> int:
            return sum(self.store.segment_path(record.id, s, record.format).stat().st_size
                       for s in segs)
        return await asyncio.to_thread(total)

    async def _body(self, record: JobRecord, segs: range, head: bytes, kid: str
                    ) -> AsyncIterator[bytes]:
        """The stored segments in order; waits for each one while the job runs."""
        try:
            if head:
                yield head
            for seg in segs:
                while not await self.store.is_stored(record.id, seg):
                    state = await self.store.state(record.id)
                    if state in (JobState.DONE, JobState.FAILED, JobState.CANCELLED, ""):
                        if not await self.store.is_stored(record.id, seg):
                            return  # it ended without this segment: end the body here
                        break
                    await asyncio.sleep(_POLL_S)
                path = self.store.segment_path(record.id, seg, record.format)
                try:
                    f = await asyncio.to_thread(path.open, "rb")
                except FileNotFoundError:
                    return  # cancelled meanwhile (its files are deleted)
                with f:
                    while data := await asyncio.to_thread(f.read, _READ_BYTES):
                        yield data
        finally:
            self.auth.release(kid)


async def _by_deadline(pieces: AsyncIterator[bytes], seconds: float) -> AsyncIterator[bytes]:
    """``pieces``, each within ``seconds`` of the last (a 408 otherwise): a body announced
    by its Content-Length that never comes, or stalls, no longer holds the key forever."""
    iterator = pieces.__aiter__()
    while True:
        try:
            async with asyncio.timeout(seconds):
                piece = await iterator.__anext__()
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise read_timeout_error(seconds) from None
        yield piece


_ERR: Final = {"description": "error", "content": {"application/json": {
    "schema": {"$ref": "#/components/schemas/Error"}}}}
_JOB_ID: Final = {"name": "job", "in": "path", "required": True, "schema": {"type": "string"}}
_OPTIONS: Final = {
    "voice": {"type": "string"}, "seed": {"type": "integer", "minimum": 0},
    "temperature": {"type": "number"}, "top_P": {"type": "number"},
    "top_K": {"type": "integer"}, "speed": {"type": "integer"},
    "sample_rate": {"type": "integer"}, "format": {"type": "string", "default": "mp3"},
    "chapters": {"type": "array", "items": {"type": "integer", "minimum": 0}}}
JOBS_OPENAPI: Final[dict[str, Any]] = {
    "/v1/jobs": {"post": {
        "summary": "submit a long-text job (text/plain body with options in the query, or JSON)",
        "parameters": [{"name": k, "in": "query", "schema": {"type": "string"}}
                       for k in _OPTIONS],
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": {"type": "object", "required": ["text"],
                                            "properties": {"text": {"type": "string"},
                                                           **_OPTIONS}}},
            "text/plain": {"schema": {"type": "string"}}}},
        "responses": {"202": {"description": "queued"}, "400": _ERR, "404": _ERR,
                      "413": _ERR, "503": _ERR}}},
    "/v1/jobs/{job}": {
        "parameters": [_JOB_ID],
        "get": {"summary": "job state and progress",
                "responses": {"200": {"description": "job"}, "404": _ERR}},
        "delete": {"summary": "cancel a job, or forget a finished one",
                   "responses": {"200": {"description": "cancelled"}, "404": _ERR}}},
    "/v1/jobs/{job}/audio": {"get": {
        "summary": "the job's audio, whole or one chapter; follows a running job",
        "parameters": [_JOB_ID, {"name": "chapter", "in": "query",
                                 "schema": {"type": "integer", "minimum": 0}}],
        "responses": {"200": {"description": "audio"}, "404": _ERR, "409": _ERR}}},
}
