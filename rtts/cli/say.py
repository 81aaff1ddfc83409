"""``rtts say``: text in, an audio file out, in one command.

It is a client of the native WebSocket (``/v1/stream``): against ``--url`` a running server,
else a server started in this process on a free loopback port with the engine flags given
(the same as ``rtts serve``'s), so the audio is exactly what a client of that server gets.
The text goes out in pieces of at most one message's limit, as contexts of at most one
context's limit; the audio comes back as PCM16 and is encoded here with the server's own
encoders (:mod:`rtts.audio.codecs`), so any format the server has can be written, and one
file is one continuous stream. A long text gets a progress line on stderr (how much of the
text has been spoken, and the audio so far).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import logging
import struct
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import orjson

__all__ = ["SayError", "add_say_parser", "format_for", "run_say", "split_text", "ws_url"]

# The native session's limits (rtts.api.native.session.SessionLimits), kept below them.
MESSAGE_CHARS = 16_000
CONTEXT_CHARS = 90_000
PROGRESS_AFTER_CHARS = 400  # a shorter text gets no progress line
SUFFIX_FORMATS = {".wav": "wav", ".mp3": "mp3", ".ogg": "opus", ".opus": "opus",
                  ".flac": "flac", ".aac": "aac", ".webm": "webm", ".pcm": "pcm16",
                  ".raw": "pcm16", ".ulaw": "mulaw", ".mulaw": "mulaw", ".alaw": "alaw"}
# serve's flags that choose and shape the engine: `rtts say` takes these when in-process
ENGINE_FLAGS = ("engine", "voice_model", "piper_workers", "source", "model_dir", "device",
                "threads", "dtype", "kernels", "max_new_token", "fake_rtf", "voices_dir")


class SayError(Exception):
    """What stops ``rtts say``: one line on stderr, exit status 1."""


def add_say_parser(sub: Any, serve: argparse.ArgumentParser) -> None:
    """``rtts say`` on the subcommand set ``sub``; the engine flags are ``serve``'s own."""
    s = sub.add_parser(
        "say", help="synthesize text into an audio file (in-process or against --url)",
        description="Synthesize TEXT (or stdin) into an audio file: against a running server "
                    "with --url, else with an engine started in this process (the engine "
                    "flags are serve's).")
    s.add_argument("text", nargs="?", default=None, metavar="TEXT",
                   help="what to say (default: read stdin; `-` reads stdin too)")
    s.add_argument("-o", "--output", default=None, metavar="FILE",
                   help="audio file to write, `-` for stdout (required unless stdout is "
                        "not a terminal)")
    s.add_argument("--format", default=None,
                   help="wav, mp3, opus, flac, aac, webm, pcm16, mulaw, alaw (default: from "
                        "the file name, else wav)")
    s.add_argument("--voice", default=None,
                   help="a named voice, seed:N, piper:NAME (default: the server's)")
    s.add_argument("--sample-rate", type=int, default=None,
                   help="rate of the file (default: the server's)")
    s.add_argument("--url", default=None,
                   help="a running rtts server (http://HOST:PORT or ws://HOST:PORT/v1/stream); "
                        "default: start an engine in this process")
    s.add_argument("--api-key", default=None, help="key for a server started with --api-key")
    s.add_argument("--quiet", action="store_true", help="no progress line")
    group = s.add_argument_group("engine (in-process only; as for `rtts serve`)")
    for action in serve._actions:
        if action.dest in ENGINE_FLAGS:  # a copy: its variable is RTTS_SAY_*, serve's stays
            own = copy.copy(action)
            own.__dict__.pop("rtts_env", None)
            group._add_action(own)


def format_for(output: str | None, fmt: str | None) -> str:
    """The audio format: ``--format``, else the file's suffix, else wav."""
    from rtts.audio.codecs import codec_for

    name = fmt or SUFFIX_FORMATS.get(Path(output or "").suffix.lower(), "wav")
    codec = codec_for(name)
    if codec is None:
        raise SayError(f"unknown format {name!r}: use one of "
                       f"{', '.join(sorted(set(SUFFIX_FORMATS.values())))}")
    return codec.name


def ws_url(url: str) -> str:
    """``http://h:p`` (or ``ws://h:p``, with or without a path) → the native socket's URL."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None or not parts.netloc:
        raise SayError(f"--url {url}: give http://HOST:PORT")
    path = parts.path.rstrip("/")
    if not path.endswith("/v1/stream"):
        path += "/v1/stream"
    return urlunsplit((scheme, parts.netloc, path, "", ""))


def split_text(text: str, limit: int) -> Iterator[str]:
    """Pieces of at most ``limit`` characters, cut after a newline or space where possible."""
    while len(text) > limit:
        cut = max(text.rfind("\n", 0, limit), text.rfind(" ", 0, limit))
        cut = cut + 1 if cut > limit // 2 else limit
        yield text[:cut]
        text = text[cut:]
    if text:
        yield text


class Progress:
    """One line on stderr, rewritten in place on a terminal, else a line every 5 s."""

    def __init__(self, total_chars: int, enabled: bool) -> None:
        self.total, self.enabled = total_chars, enabled
        self.tty = sys.stderr.isatty()
        self.last = 0.0
        self.shown = False

    def update(self, chars: int, audio_s: float, final: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not final and now - self.last < (0.2 if self.tty else 5.0)):
            return
        self.last = now
        pct = 100 * chars // max(1, self.total)
        line = (f"say: {pct:3d}% of {self.total:,} characters spoken, "
                f"{int(audio_s // 60)}:{audio_s % 60:04.1f} of audio")
        if self.tty:
            print(f"\r{line}", end="\n" if final else "", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)
        self.shown = True


def _open_output(output: str) -> BinaryIO:
    if output == "-":
        return sys.stdout.buffer
    try:
        return open(output, "wb")  # noqa: SIM115 - closed by the caller
    except OSError as exc:
        raise SayError(f"{output}: {exc.strerror or exc}") from None


def _fix_wav_sizes(out: BinaryIO, data_bytes: int) -> None:
    """The streaming WAV header says 0xFFFFFFFF; a finished file can say the truth."""
    with contextlib.suppress(OSError, ValueError):
        if not out.seekable():
            return
        out.seek(4)
        out.write(struct.pack("<I", 36 + data_bytes))
        out.seek(40)
        out.write(struct.pack("<I", data_bytes))


async def _speak(url: str, api_key: str | None, text: str, voice: str | None, fmt: str,
                 sample_rate: int | None, out: BinaryIO, progress: Progress) -> float:
    """Synthesize ``text`` over the native socket at ``url`` into ``out``; the audio's
    seconds."""
    from websockets.exceptions import ConnectionClosed

    try:
        return await _speak_on(url, api_key, text, voice, fmt, sample_rate, out, progress)
    except ConnectionClosed as exc:
        reason = f" {exc.rcvd.reason}" if exc.rcvd and exc.rcvd.reason else ""
        code = exc.rcvd.code if exc.rcvd else 1006
        raise SayError(f"the server closed the connection ({code}{reason})") from None


async def _speak_on(url: str, api_key: str | None, text: str, voice: str | None, fmt: str,
                    sample_rate: int | None, out: BinaryIO, progress: Progress) -> float:
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus, WebSocketException

    from rtts.api.native.protocol import unpack_frame
    from rtts.audio.codecs import open_encoder, streaming_wav_header

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        ws = await connect(url, additional_headers=headers, max_size=2**24, open_timeout=10,
                           ping_interval=None)
    except InvalidStatus as exc:
        code = exc.response.status_code
        hint = " (give --api-key)" if code == 401 else ""
        raise SayError(f"{url}: the server answered HTTP {code}{hint}") from None
    except (OSError, TimeoutError, WebSocketException) as exc:
        raise SayError(f"{url}: cannot connect ({exc or type(exc).__name__})") from None
    async with ws:
        ready = orjson.loads(await ws.recv())
        if ready.get("type") != "ready":
            raise SayError(f"{url}: the server is not ready: {ready.get('message', ready)}")
        native = int(ready["sample_rate"])
        if (ready.get("weights") or {}).get("kind") == "random":
            from rtts.engines.weights import REAL_SPEECH_HINT

            print(f"say: warning: the server has RANDOM weights: this is noise, not speech. "
                  f"{REAL_SPEECH_HINT}", file=sys.stderr)
        encoder = open_encoder(fmt, native, sample_rate or native)
        data_bytes = 0
        if fmt == "wav":
            out.write(streaming_wav_header(encoder.sample_rate))
            encoder = open_encoder("pcm16", native, sample_rate or native)
        audio_s, done_chars = 0.0, 0
        reported = 0.0  # a file "plays" as fast as it is written: say so, or be paced
        for n, part in enumerate(split_text(text, CONTEXT_CHARS)):
            cid = f"say-{n}"
            start: dict[str, Any] = {"type": "start", "context_id": cid, "format": "pcm16",
                                     "sample_rate": native}
            if voice:
                start["voice"] = voice
            await ws.send(orjson.dumps(start).decode())
            for piece in split_text(part, MESSAGE_CHARS):
                await ws.send(orjson.dumps({"type": "text", "context_id": cid,
                                            "text": piece}).decode())
            await ws.send(orjson.dumps({"type": "end", "context_id": cid}).decode())
            context_s = audio_s
            while True:
                if time.monotonic() - reported > 0.1:
                    reported = time.monotonic()
                    played = int((audio_s - context_s) * 1000)
                    await ws.send(orjson.dumps({"type": "playback", "context_id": cid,
                                                "played_ms": played}).decode())
                msg = await ws.recv()
                if isinstance(msg, bytes):
                    _, payload = unpack_frame(msg)
                    pcm = np.frombuffer(payload, "<i2").astype(np.float32) / 32768.0
                    audio_s += len(pcm) / native
                    chunk = encoder.encode(pcm)
                    data_bytes += len(chunk)
                    out.write(chunk)
                    continue
                event = orjson.loads(msg)
                kind = event.get("type")
                if kind == "segment_done":
                    progress.update(done_chars + int(event.get("text_end", 0)), audio_s)
                elif kind == "error":
                    where = f" (segment {event['segment']})" if "segment" in event else ""
                    if "segment" in event and event.get("context_id") == cid:
                        print(f"say: warning: {event.get('code')}: {event.get('message')}"
                              f"{where}", file=sys.stderr)
                        continue
                    raise SayError(f"{event.get('code')}: {event.get('message')}")
                elif kind == "done" and event.get("context_id") == cid:
                    break
            done_chars += len(part)
        tail = encoder.finish()
        data_bytes += len(tail)
        out.write(tail)
        if fmt == "wav":
            _fix_wav_sizes(out, data_bytes)
        progress.update(done_chars, audio_s, final=True)
        return audio_s


async def _in_process(args: argparse.Namespace, serve_args: argparse.Namespace, text: str,
                      fmt: str, out: BinaryIO, progress: Progress) -> float:
    from rtts.api.auth import AuthConfig
    from rtts.cli.main import config_from_args
    from rtts.jobs.model import JobsConfig
    from rtts.server import bound_port, run_server

    for name in ENGINE_FLAGS:
        setattr(serve_args, name, getattr(args, name))
    config = config_from_args(serve_args)
    config = replace(config, host="127.0.0.1", port=0, wyoming_port=None, auth=AuthConfig(),
                     jobs=JobsConfig(), instance_id="say", freeze_gc=False,
                     max_lead_s=None)  # no pacing: a file is not played in real time
    if logging.getLogger().level >= logging.INFO:  # the server's own log is not the point
        logging.getLogger("rtts").setLevel(logging.WARNING)
    if not args.quiet:
        print(f"say: loading the {config.engine.name} engine…", file=sys.stderr, flush=True)
    async with run_server(config) as app:
        if app.state != "ready":
            raise SayError(f"the engine did not start: {app.state_reason}")
        url = f"ws://127.0.0.1:{bound_port(app)}{config.ws_path}"
        return await _speak(url, None, text, args.voice, fmt, args.sample_rate, out, progress)


def run_say(args: argparse.Namespace, serve_args: argparse.Namespace) -> int:
    """``rtts say``; ``serve_args``: ``rtts serve``'s defaults (the in-process server's)."""
    try:
        fmt = format_for(args.output, args.format)
        if args.output is None:
            if sys.stdout.isatty():
                raise SayError("give -o FILE (or -o - to write the audio to stdout)")
            args.output = "-"
        if args.text is None or args.text == "-":
            if sys.stdin.isatty():
                print("say: reading the text from stdin (Ctrl-D ends it)", file=sys.stderr)
            text = sys.stdin.read()
        else:
            text = args.text
        if not text.strip():
            raise SayError("no text to say")
        progress = Progress(len(text), not args.quiet and len(text) >= PROGRESS_AFTER_CHARS)
        out = _open_output(args.output)
        try:
            if args.url is not None:
                coro = _speak(ws_url(args.url), args.api_key, text, args.voice, fmt,
                              args.sample_rate, out, progress)
            else:
                coro = _in_process(args, serve_args, text, fmt, out, progress)
            seconds = asyncio.run(coro)
        finally:
            if out is not sys.stdout.buffer:
                out.close()
    except SayError as exc:
        print(f"rtts say: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if args.output != "-" and not args.quiet:
        print(f"say: wrote {seconds:.1f} s of {fmt} to {args.output}", file=sys.stderr)
    return 0
