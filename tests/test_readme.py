"""The README and the manual (``docs/**/*.md``) tell the truth: every ``rtts`` command in
their shell blocks parses with the real command line, the TOML example is a valid config, the
files and make targets they name exist, the cheap commands run as written, and the manual
builds with mkdocs in strict mode (no broken link or anchor)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rtts.cli.main import build_parser, check_serve_args

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
TEXTS = {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in DOCS}
README = "\n".join(TEXTS.values())  # everything the test reads, README first


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, re.S)


def test_the_manual_exists():
    assert "README.md" in TEXTS and len(TEXTS) > 10, sorted(TEXTS)
    assert len(TEXTS["README.md"].splitlines()) < 200, "the README stays short: use docs/"


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
    assert any(argv[:1] == ["say"] for argv in rtts_invocations())


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


def test_every_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = [p for p in TEXTS if p.startswith("docs/")]
    missing = [p for p in pages if p.removeprefix("docs/") not in nav]
    assert not missing, f"add these to mkdocs.yml's nav: {missing}"


def test_the_manual_builds_strictly(tmp_path):
    """A broken link, anchor or nav entry fails (mkdocs.yml has ``strict: true``)."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert build.returncode == 0, build.stdout + build.stderr
    assert (tmp_path / "index.html").is_file()
    assert (tmp_path / "protocols" / "openai.html").is_file()  # browsable from the disk


@pytest.mark.skipif(not shutil.which("make"), reason="no make")
def test_make_installs_only_when_its_inputs_change(tmp_path):
    """`make run`/`make test` do not reinstall: `.venv/.installed` is newer than the inputs."""
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed").touch()

    def dry(*extra: str) -> str:
        return run("make", "-n", f"VENV={venv}", *extra, "install").stdout

    assert "install.sh" not in dry()
    assert "install.sh" in dry("-W", "pyproject.toml")
    assert "install.sh" in dry("-W", "constraints.txt")
    (venv / ".installed").unlink()
    assert "install.sh" in dry()
