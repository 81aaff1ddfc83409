#!/usr/bin/env python3
"""Pick the torch build for this machine: prints pip's arguments for it, or nothing.

Used by scripts/install.sh (``make install``); standard library only, runs in seconds,
downloads nothing. stdout is one line: the arguments to ``pip install`` torch with (empty:
the right torch is already installed); stderr says what was chosen and why.

    python scripts/select_torch.py              # print pip's arguments (or nothing)
    python scripts/select_torch.py --install    # and run pip with them, into this Python
                                                # (as make install does, in .venv)

Which build:
* ``RTTS_TORCH=auto`` (default): an NVIDIA GPU that ``nvidia-smi -L`` lists -> a CUDA build
  from PyTorch's index for the driver's CUDA version (``cu130``, ``cu128`` or ``cu126``);
  no GPU on Linux or Windows -> the CPU build from ``.../whl/cpu`` (PyPI's Linux wheel would
  pull several GB of CUDA libraries); macOS -> PyPI's wheel (it is the CPU/MPS build).
* ``RTTS_TORCH=cpu`` or ``cuda`` forces one; ``RTTS_TORCH=skip`` installs no torch here
  (bring your own); ``RTTS_TORCH_INDEX=URL`` uses that index as is.
* ``RTTS_TORCH_INDEX_BASE`` (default https://download.pytorch.org/whl) is where the
  ``cpu``/``cuXXX`` indexes live (a mirror).

The chosen index is probed first (one request, ``RTTS_INDEX_TIMEOUT`` seconds, default 5).
When it does not answer, the script says so and falls back to pip's own configuration
(``pip config list``: a local wheel directory or a mirror; with neither that is PyPI's
default build) instead of letting pip retry for minutes. The version comes from
constraints.txt (``torch==X``). An installed torch of that version and build is kept
(``RTTS_TORCH_REINSTALL=1`` overrides).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BASE = "https://download.pytorch.org/whl"
# CUDA builds PyTorch publishes, newest first, with the driver CUDA version each needs.
CUDA_BUILDS = (("cu130", (13, 0)), ("cu128", (12, 8)), ("cu126", (12, 6)))


def say(msg: str) -> None:
    print(f"select_torch: {msg}", file=sys.stderr)


def pinned_version(constraints: Path) -> str:
    for line in constraints.read_text().splitlines():
        m = re.match(r"\s*torch\s*==\s*([^\s;#]+)", line)
        if m:
            return m.group(1)
    raise SystemExit(f"select_torch: no torch==X pin in {constraints}")


def gpu() -> tuple[str, tuple[int, int] | None] | None:
    """(first GPU's name, the driver's CUDA version) when ``nvidia-smi`` lists a GPU."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        listed = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        say(f"nvidia-smi did not answer ({exc}): treating this machine as having no GPU")
        return None
    names = [ln for ln in listed.stdout.splitlines() if ln.startswith("GPU ")]
    if listed.returncode != 0 or not names:
        return None
    cuda = None
    try:
        header = subprocess.run([exe], capture_output=True, text=True, timeout=10).stdout
        m = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", header)
        if m:
            cuda = (int(m.group(1)), int(m.group(2)))
    except (OSError, subprocess.TimeoutExpired):
        pass
    return names[0].split(":", 1)[1].split("(UUID")[0].strip(), cuda


def installed() -> tuple[str, str] | None:
    """(version, build) of the torch installed for this interpreter: build is cpu or cuda."""
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    local = version.partition("+")[2]
    if local.startswith("cu"):
        return version, "cuda"
    if local == "cpu":
        return version, "cpu"
    needs = importlib.metadata.requires("torch") or []
    return version, "cuda" if any(r.startswith("nvidia-") for r in needs) else "cpu"


def probe(url: str, timeout: float) -> str | None:
    """None if the index answers for torch within ``timeout`` s, else the reason."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/torch/", timeout=timeout) as r:
            r.read(1)
        return None
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (OSError, ValueError) as exc:
        return str(getattr(exc, "reason", exc)) or type(exc).__name__


def choose() -> tuple[list[str], list[str]]:
    """(pip arguments, explanation lines)."""
    version = pinned_version(ROOT / "constraints.txt")
    want = os.environ.get("RTTS_TORCH", "auto").strip().lower() or "auto"
    base = os.environ.get("RTTS_TORCH_INDEX_BASE", DEFAULT_BASE).rstrip("/")
    try:
        timeout = float(os.environ.get("RTTS_INDEX_TIMEOUT", "5"))
    except ValueError:
        timeout = 5.0
    notes: list[str] = []
    if want == "skip":
        return [], ["RTTS_TORCH=skip: not installing torch (bring your own)"]
    if want not in ("auto", "cpu", "cuda"):
        raise SystemExit(f"select_torch: RTTS_TORCH={want!r}: use auto, cpu, cuda or skip")

    found = gpu() if want in ("auto", "cuda") else None
    if want == "auto":
        if found is not None:
            build = "cuda"
            notes.append(f"NVIDIA GPU found ({found[0]}): a CUDA build of torch")
        elif platform.system() == "Darwin":
            build = "default"
            notes.append("macOS: PyPI's torch (the CPU/MPS build)")
        else:
            build = "cpu"
            notes.append("no NVIDIA GPU (nvidia-smi lists none): the CPU build of torch")
    else:
        build = want
        notes.append(f"RTTS_TORCH={want}")

    index = os.environ.get("RTTS_TORCH_INDEX") or None
    label = None  # PyTorch's indexes name each build with a local version label (+cpu)
    if index is None and build == "cpu":
        index, label = f"{base}/cpu", "cpu"
    elif index is None and build == "cuda":
        cuda = found[1] if found else None
        tag = next((t for t, need in CUDA_BUILDS if cuda is None or cuda >= need), None)
        if tag is None:
            notes.append(f"the driver supports CUDA {cuda[0]}.{cuda[1]} only (older than "
                         f"{CUDA_BUILDS[-1][0]}): the CPU build instead; update the driver "
                         "or set RTTS_TORCH_INDEX")
            build, index, label = "cpu", f"{base}/cpu", "cpu"
        else:
            index, label = f"{base}/{tag}", tag
            if cuda is not None:
                notes.append(f"driver supports CUDA {cuda[0]}.{cuda[1]}: {tag}")

    have = installed()
    if have is not None and have[0].partition("+")[0] == version \
            and build in ("default", have[1]) \
            and os.environ.get("RTTS_TORCH_REINSTALL", "") not in ("1", "true", "yes"):
        notes.append(f"torch {have[0]} ({have[1]}) is already installed: keeping it")
        return [], notes

    if index is not None:
        reason = probe(index, timeout)
        if reason is not None:
            notes.append(f"{index} is unreachable within {timeout:g}s ({reason}): falling "
                         f"back to pip's own configuration for torch=={version} (a local "
                         "wheel directory or mirror if `pip config list` has one; otherwise "
                         "PyPI's default build, which on Linux x86_64 is a CUDA build)")
            index = label = None
    args = ["--index-url", index] if index else []
    # With the label, an installed torch of another build does not satisfy the pin.
    return [*args, f"torch=={version}+{label}" if label else f"torch=={version}"], notes


def main() -> int:
    install = "--install" in sys.argv[1:]
    args, notes = choose()
    for note in notes:
        say(note)
    if not install:
        print(" ".join(args))
        return 0
    if not args:
        return 0
    timeout = os.environ.get("RTTS_PIP_TIMEOUT", "30")
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q",
           "--timeout", timeout, "--retries", "2", "-c", str(ROOT / "constraints.txt"), *args]
    say("pip install " + " ".join(args))
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
