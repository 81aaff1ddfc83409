"""The README tells the truth: every ``rtts`` command in its shell blocks parses with the
real command line, its TOML example is a valid config, the files and make targets it names
exist, and the cheap commands run as written."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from rtts.cli.main import build_parser, check_serve_args

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, re.S)


def shell_commands() -> list[str]:
    """Every command line of the bash blocks, continuation lines joined, comments cut."""
    out = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def rtts_invocations() -> list[list[str]]:
    found = []
    for line in shell_commands():
        for part in re.split(r"&&|\|\||;", line):
            words = shlex.split(part, comments=True)
            if words and words[-1] == "&":  # started in the background
                words = words[:-1]
            if words and words[0] in ("rtts", ".venv/bin/rtts"):
                found.append(words[1:])
    return found


def test_the_readme_has_rtts_commands():
    assert len(rtts_invocations()) >= 10


@pytest.mark.parametrize("argv", rtts_invocations(), ids=lambda a: " ".join(a)[:60])
def test_every_rtts_command_parses(argv, monkeypatch):
    for key in [k for k in os.environ if k.startswith("RTTS_")]:
        monkeypatch.delenv(key)
    argv = [w.replace("$KEY", "key") for w in argv]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # pragma: no cover - the failure message is the point
        pytest.fail(f"`rtts {' '.join(argv)}` does not parse (exit {exc.code})")
    if args.command == "serve":
        check_serve_args(args)


def test_toml_example_is_a_valid_config(tmp_path, monkeypatch):
    for key in [k for k in os.environ if k.startswith("RTTS_")]:
        monkeypatch.delenv(key)
    (example,) = [b for b in blocks("toml") if "[serve]" in b]
    conf = tmp_path / "rtts.toml"
    conf.write_text(example)
    args = build_parser().parse_args(["--config", str(conf), "serve"])
    assert args.host == "0.0.0.0" and args.max_queue == 64 and len(args.api_key) == 2


def test_make_targets_named_exist():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, re.M))
    named = set(re.findall(r"`make ([a-z][\w-]*)", README))
    assert named and named <= targets, named - targets


def test_repository_paths_named_exist():
    top = "tests|scripts|rtts|deploy|web|bench-results"
    named = set(re.findall(rf"`((?:{top})/[\w./-]+\.(?:py|sh|yaml|js|json))`", README))
    named |= set(re.findall(r"^((?:rtts|scripts)/[\w./]+\.py)\s", README, re.M))
    assert len(named) > 10
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, missing


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_cheap_commands_run_as_written():
    assert run(sys.executable, "-m", "rtts", "--version").returncode == 0
    doctor = run(sys.executable, "-m", "rtts", "doctor")
    assert "weights:" in doctor.stdout, doctor.stdout + doctor.stderr
    select = run(sys.executable, "scripts/select_torch.py")
    assert select.returncode == 0 and "select_torch:" in select.stderr
