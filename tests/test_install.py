"""The installer's torch selection (scripts/select_torch.py), run as make install runs it:
no GPU, a GPU (a fake ``nvidia-smi`` on PATH), an index that answers (a local HTTP server)
and one that never does (a local socket that never replies). Nothing is downloaded; each
case finishes in a few seconds."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "select_torch.py"
PIN = next(line.split("==")[1].strip() for line in (ROOT / "constraints.txt").read_text()
           .splitlines() if line.startswith("torch=="))

NVIDIA_SMI = """#!/bin/sh
if [ "$1" = "-L" ]; then
  echo "GPU 0: NVIDIA H200 (UUID: GPU-00000000-1111-2222-3333-444444444444)"
  exit 0
fi
echo "| NVIDIA-SMI 580.65.06    Driver Version: 580.65.06    CUDA Version: {cuda}     |"
"""
NO_DEVICE_SMI = """#!/bin/sh
echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver." >&2
exit 9
"""


@pytest.fixture(scope="module")
def index() -> Iterator[tuple[str, list[str]]]:
    """A PEP 503 'index' on loopback: answers /whl/<build>/torch/ with an empty page."""
    seen: list[str] = []

    class Simple(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            seen.append(self.path)
            body = b"<html><body></body></html>"
            self.send_response(200 if self.path.endswith("/torch/") else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Simple)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/whl", seen
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def silent() -> Iterator[str]:
    """An index host that accepts the connection and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/whl"
    sock.close()


def select(tmp_path: Path, smi: str | None, **env: str) -> tuple[list[str], str, float]:
    """Run the script with PATH starting at a directory holding ``smi`` as nvidia-smi (or
    nothing: then no nvidia-smi shadows the system's, which this machine lacks)."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    if smi is not None:
        exe = bindir / "nvidia-smi"
        exe.write_text(smi)
        exe.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith("RTTS_TORCH")}
    base["PATH"] = f"{bindir}{os.pathsep}{base.get('PATH', '')}"
    base.setdefault("RTTS_TORCH_REINSTALL", "1")  # this venv's torch must not short-cut
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          env={**base, **env}, timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) == 1
    return proc.stdout.split(), proc.stderr, took


def test_no_gpu_takes_the_cpu_index(tmp_path, index):
    url, seen = index
    args, why, took = select(tmp_path, NO_DEVICE_SMI, RTTS_TORCH_INDEX_BASE=url)
    assert args == ["--index-url", f"{url}/cpu", f"torch=={PIN}+cpu"]
    assert "no NVIDIA GPU" in why and took < 10
    assert "/whl/cpu/torch/" in seen  # probed, nothing more


def test_gpu_takes_the_cuda_index_for_the_driver(tmp_path, index):
    url, _ = index
    args, why, _ = select(tmp_path, NVIDIA_SMI.format(cuda="12.8"), RTTS_TORCH_INDEX_BASE=url)
    # the label makes pip replace an installed CPU build of the same version
    assert args == ["--index-url", f"{url}/cu128", f"torch=={PIN}+cu128"]
    assert "NVIDIA GPU found (NVIDIA H200)" in why
    args, _, _ = select(tmp_path, NVIDIA_SMI.format(cuda="13.0"), RTTS_TORCH_INDEX_BASE=url)
    assert args[1] == f"{url}/cu130"


def test_gpu_with_an_old_driver_gets_the_cpu_build(tmp_path, index):
    url, _ = index
    args, why, _ = select(tmp_path, NVIDIA_SMI.format(cuda="11.4"), RTTS_TORCH_INDEX_BASE=url)
    assert args[1] == f"{url}/cpu" and "update the driver" in why


def test_unreachable_index_falls_back_quickly_with_a_message(tmp_path, silent):
    args, why, took = select(tmp_path, None, RTTS_TORCH_INDEX_BASE=silent,
                             RTTS_INDEX_TIMEOUT="1")
    assert args == [f"torch=={PIN}"]  # pip's own configuration (here: the local wheel dir)
    assert "unreachable within 1s" in why and "falling back" in why
    assert took < 6, took


def test_forced_builds_and_explicit_index(tmp_path, index):
    url, _ = index
    args, _, _ = select(tmp_path, None, RTTS_TORCH="cuda", RTTS_TORCH_INDEX_BASE=url)
    assert args[1] == f"{url}/cu130"  # no driver to ask: the newest build
    args, _, _ = select(tmp_path, NVIDIA_SMI.format(cuda="12.8"), RTTS_TORCH="cpu",
                        RTTS_TORCH_INDEX_BASE=url)
    assert args[1] == f"{url}/cpu"
    args, _, _ = select(tmp_path, None, RTTS_TORCH_INDEX=f"{url}/rocm6.4")
    assert args == ["--index-url", f"{url}/rocm6.4", f"torch=={PIN}"]
    args, why, _ = select(tmp_path, None, RTTS_TORCH="skip")
    assert args == [] and "skip" in why


def test_installed_torch_of_the_pinned_build_is_kept(tmp_path, silent):
    """This venv has the pinned CPU torch (make install): nothing to do, no probe."""
    torch_version = pytest.importorskip("importlib.metadata").version("torch")
    if not torch_version.startswith(PIN) or "+cu" in torch_version:
        pytest.skip(f"this venv has torch {torch_version}")
    args, why, took = select(tmp_path, NO_DEVICE_SMI, RTTS_TORCH_REINSTALL="0",
                             RTTS_TORCH_INDEX_BASE=silent)
    assert args == [] and "already installed" in why and took < 5


def test_bad_choice_is_one_clear_line(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          env={**os.environ, "RTTS_TORCH": "rocm"}, timeout=30)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "RTTS_TORCH='rocm'" in proc.stderr


def test_install_script_uses_the_selection():
    script = (ROOT / "scripts" / "install.sh").read_text()
    torch_step = script.index("scripts/select_torch.py --install")
    assert torch_step < script.index("-e '.[chattts")  # torch first, then the rest


def test_install_mode_with_torch_present_runs_no_pip(tmp_path):
    """--install when the pinned build is there: exits 0 at once without calling pip."""
    if "+cu" in pytest.importorskip("importlib.metadata").version("torch"):
        pytest.skip("this venv has a CUDA torch")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTTS_TORCH")}
    env["PATH"] = f"{bindir}{os.pathsep}{env['PATH']}"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(SCRIPT), "--install"], capture_output=True,
                          text=True, env=env, timeout=60)
    assert proc.returncode == 0 and "already installed" in proc.stderr
    assert "pip install" not in proc.stderr and time.monotonic() - t0 < 5
