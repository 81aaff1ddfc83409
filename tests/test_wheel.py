"""``pip install rtts`` works: the wheel, installed into a fresh virtual environment, serves
the demo page and the JS client and streams audio, with the source tree out of sight.

The wheel is built twice, from the checkout and from the sdist, and both must hold the same
files. The fresh venv has no pip and no system site-packages; this venv's pip installs the
wheel there with its declared runtime dependencies (the local pip configuration supplies
them). ``rtts serve`` runs from an empty temporary directory. Deselect with ``-m "not wheel"``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from procs import _stop, free_port, wait_http

pytestmark = [pytest.mark.wheel, pytest.mark.long]

ROOT = Path(__file__).resolve().parent.parent
WEB_SHIPPED = {"index.html", "demo.css", "demo.js", "jitter-buffer.js", "pcm-player.js",
               "pcm-player.worklet.js", "protocol.js", "resampler.js", "rtts-client.js"}


def run(args: list[str | Path], timeout: float = 120, **kw: object) -> str:
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True,
                          timeout=timeout, **kw)  # type: ignore[call-overload]
    assert proc.returncode == 0, f"{args}\n{proc.stdout}\n{proc.stderr}"
    return str(proc.stdout)


def pip_wheel(source: Path, out: Path) -> Path:
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", out, source])
    (wheel,) = out.glob("rtts-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    from_tree = pip_wheel(ROOT, tmp / "tree")
    sdist_dir = tmp / "sdist"
    sdist_dir.mkdir()
    run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
         "build_meta.build_sdist(sys.argv[1])", sdist_dir], cwd=ROOT)
    (sdist,) = sdist_dir.glob("rtts-*.tar.gz")
    from_sdist = pip_wheel(sdist, tmp / "from-sdist")
    names = [sorted(zipfile.ZipFile(w).namelist()) for w in (from_tree, from_sdist)]
    assert names[0] == names[1]
    return from_sdist


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv (no pip, no system site-packages) with the wheel and its dependencies."""
    path = tmp_path_factory.mktemp("venv") / "v"
    run([sys.executable, "-m", "venv", "--without-pip", path])
    run([sys.executable, "-m", "pip", "--python", path / "bin" / "python", "install", "-q",
         "--disable-pip-version-check", wheel], timeout=300)
    return path


def clean_env(venv: Path, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", HOME=str(home),
               RTTS_HOME=str(home / "rtts"), XDG_CACHE_HOME=str(home / "cache"))
    return env


def test_wheel_ships_the_package_and_only_the_page_assets(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "rtts").rglob("*.py")}
    assert sources <= names, sources - names
    assert "rtts/py.typed" in names
    web = {n.removeprefix("rtts/web/") for n in names if n.startswith("rtts/web/")}
    assert WEB_SHIPPED <= web
    assert {"types/rtts-client.d.ts", "types/protocol.d.ts"} <= web
    for n in web:  # no tests, npm files, node_modules or dotfiles
        assert not n.startswith(("test/", "node_modules/")) and "package" not in n, n
        assert not any(part.startswith(".") for part in n.split("/")), n
    entry = zipfile.ZipFile(wheel).read("rtts-0.1.0.dist-info/entry_points.txt").decode()
    assert "rtts = rtts.cli.main:main" in entry


@pytest.fixture(scope="module")
def installed_server(venv: Path, tmp_path_factory: pytest.TempPathFactory
                     ) -> Iterator[tuple[str, Path]]:
    """``rtts serve --engine fake`` from the venv's console script, in an empty directory."""
    home = tmp_path_factory.mktemp("home")
    workdir = tmp_path_factory.mktemp("elsewhere")
    env = clean_env(venv, home)
    where = run([venv / "bin" / "python", "-c", "import rtts, rtts.config as c; "
                 "print(rtts.__file__); print(c.ServerConfig().web_dir)"], cwd=workdir, env=env)
    module, web_dir = where.split()
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    assert Path(module).is_relative_to(site) and not Path(module).is_relative_to(ROOT)
    assert Path(web_dir) == Path(module).parent / "web"
    port = free_port()
    log = home / "serve.log"
    proc = subprocess.Popen([venv / "bin" / "rtts", "serve", "--engine", "fake", "--host",
                             "127.0.0.1", "--port", str(port)], cwd=workdir, env=env,
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", timeout=60)
        yield f"127.0.0.1:{port}", Path(web_dir)
    finally:
        _stop(proc)
        assert proc.returncode == 0, log.read_text()


def get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.headers["Content-Type"], r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


@pytest.mark.parametrize("path,ctype", [
    ("/", "text/html; charset=utf-8"),
    ("/rtts-client.js", "text/javascript; charset=utf-8"),
    ("/pcm-player.worklet.js", "text/javascript; charset=utf-8"),
    ("/demo.css", "text/css; charset=utf-8"),
])
def test_installed_server_serves_the_page(installed_server: tuple[str, Path], path: str,
                                          ctype: str) -> None:
    host, _ = installed_server
    status, got_type, body = get(f"http://{host}{path}")
    assert (status, got_type) == (200, ctype)
    assert body == (ROOT / "web" / (path.lstrip("/") or "index.html")).read_bytes()


def test_installed_server_does_not_serve_what_is_not_shipped(
        installed_server: tuple[str, Path]) -> None:
    host, _ = installed_server
    for path in ("/test/client.test.js", "/package.json", "/package-lock.json"):
        assert get(f"http://{host}{path}")[0] == 404, path


def test_installed_server_streams_an_utterance(installed_server: tuple[str, Path]) -> None:
    from websockets.sync.client import connect

    host, _ = installed_server
    with connect(f"ws://{host}/v1/stream", compression=None, open_timeout=10) as ws:
        ready = json.loads(ws.recv(timeout=10))
        assert ready["type"] == "ready" and ready["engine"] == "fake"
        ws.send(json.dumps({"type": "start", "context_id": "w", "sample_rate": 16000}))
        ws.send(json.dumps({"type": "text", "context_id": "w", "text": "From the wheel."}))
        ws.send(json.dumps({"type": "end", "context_id": "w"}))
        events: list[dict[str, object]] = []
        pcm = 0
        while not events or events[-1]["type"] not in ("done", "error"):
            msg = ws.recv(timeout=20)
            if isinstance(msg, bytes):
                assert msg[0] == 1 and len(msg) > 12
                pcm += (len(msg) - 12) // 2
            else:
                events.append(json.loads(msg))
    types = [e["type"] for e in events]
    assert types[0] == "segment_started" and types[-1] == "done", types
    assert events[0]["sample_rate"] == 16000
    done = [e for e in events if e["type"] == "segment_done"]
    assert pcm > 0 and pcm == sum(int(e["samples"]) for e in done)  # type: ignore[call-overload]


def test_web_dir_flag_overrides_the_packaged_assets(
        venv: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    home = tmp_path_factory.mktemp("home-webdir")
    own = tmp_path_factory.mktemp("own-web")
    (own / "index.html").write_text("<!doctype html><title>mine</title>")
    port = free_port()
    proc = subprocess.Popen([venv / "bin" / "rtts", "serve", "--engine", "fake", "--host",
                             "127.0.0.1", "--port", str(port), "--web-dir", own],
                            cwd=home, env=clean_env(venv, home), stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", timeout=60)
        assert get(f"http://127.0.0.1:{port}/")[2] == b"<!doctype html><title>mine</title>"
        assert get(f"http://127.0.0.1:{port}/rtts-client.js")[0] == 404
    finally:
        _stop(proc)


@pytest.mark.chattts
def test_installed_wheel_makes_checkpoints_and_serves_the_embedded_default(
        wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The ChatTTS side from the wheel: ``rtts doctor``, ``rtts model make-random`` and the
    embedded default checkpoint that ``rtts serve`` writes on first run. torch and ChatTTS
    are too big to install again here, so this venv reads this environment's third-party
    packages through a .pth line after its own site-packages; that directory holds no rtts
    (the checkout is installed editable, through a finder that a .pth line does not run)."""
    pytest.importorskip("ChatTTS")
    import sysconfig

    path = tmp_path_factory.mktemp("venv-chattts") / "v"
    run([sys.executable, "-m", "venv", "--without-pip", path])
    run([sys.executable, "-m", "pip", "--python", path / "bin" / "python", "install", "-q",
         "--no-deps", "--disable-pip-version-check", wheel])
    site = path / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    (site / "site-packages" / "zz_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    home = tmp_path_factory.mktemp("home-chattts")
    workdir = tmp_path_factory.mktemp("elsewhere-chattts")
    env = clean_env(path, home)
    rtts = path / "bin" / "rtts"
    module = run([path / "bin" / "python", "-c", "import rtts; print(rtts.__file__)"],
                 cwd=workdir, env=env).strip()
    assert Path(module).is_relative_to(site) and not Path(module).is_relative_to(ROOT)

    doctor = run([rtts, "doctor"], cwd=workdir, env=env)
    assert "ok  import ChatTTS" in doctor and "all good" in doctor
    run([rtts, "model", "make-random", "--size", "tiny", workdir / "ck"], cwd=workdir, env=env)
    assert (workdir / "ck" / "sha256_map.json").is_file()

    port = free_port()
    log = home / "serve.log"
    proc = subprocess.Popen([rtts, "serve", "--host", "127.0.0.1", "--port", str(port)],
                            cwd=workdir, env=env, stdout=log.open("wb"),
                            stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", timeout=120)
        status, ctype, body = get(f"http://127.0.0.1:{port}/v1/tts?text=Hi%20there.")
        assert (status, ctype) == (200, "audio/wav") and len(body) > 1000
        assert get(f"http://127.0.0.1:{port}/rtts-client.js")[0] == 200
    finally:
        _stop(proc)
    assert (home / "rtts" / "random-tiny" / "sha256_map.json").is_file(), log.read_text()
    assert "embedded default" in log.read_text()


def test_dockerfile_copies_what_the_wheel_is_built_from(tmp_path: Path) -> None:
    """The image is built from the files the Dockerfile copies: that must give the same
    wheel (setup.py maps web/ into it)."""
    import shutil

    ctx = tmp_path / "ctx"
    ctx.mkdir()
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        # the build stage's copies of the checkout (not the wheel folder, not --from=build)
        if line.startswith("COPY ") and "$" not in line and "--from" not in line:
            *srcs, dest = line.split()[1:]
            for src in srcs:
                target = ctx / dest / Path(src).name if dest.endswith("/") else ctx / dest
                if (ROOT / src).is_dir():
                    shutil.copytree(ROOT / src, target, ignore=shutil.ignore_patterns(
                        "__pycache__", "node_modules"))
                else:
                    shutil.copy(ROOT / src, target)
    names = set(zipfile.ZipFile(pip_wheel(ctx, tmp_path / "out")).namelist())
    assert {f"rtts/web/{n}" for n in WEB_SHIPPED} <= names
