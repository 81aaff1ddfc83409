"""The container image, built and run for real, and the compose fleet (deploy/compose.yaml).

The test starts its own ``dockerd`` (Debian's docker.io: own data root, exec root and socket
under a temporary directory, all removed afterwards), makes the base images locally with
``mmdebstrap`` (no registry is reachable here), prepares a wheelhouse on the host (pip
inside a build cannot reach an index) and builds the repository's Dockerfile with
``--build-arg BASE=… --build-arg WHEELS=…``. Then:

* the image: HEALTHCHECK turns healthy, a native ``/v1/stream`` session and the real
  ``openai`` client speak through it, it runs as the ``rtts`` user, it holds no pip, compiler,
  sources or wheels, and ``docker stop`` (SIGTERM) drains it: exit code 0, the drain log line;
* the compose fleet (docker-compose): two instances behind nginx, Redis, one job worker; a
  session lands on each instance through nginx, a job is finished by the worker, and one
  instance stopped leaves a session on the other untouched.

Marked ``container`` and excluded from the default run (pyproject.toml addopts); .ci/run runs
it as its own step (``pytest -m container tests/test_container.py``) after installing
docker.io, docker-compose and mmdebstrap. Skipped, saying why, where no engine can start.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from websockets.asyncio.client import connect

from procs import free_port
from rtts.api.native.protocol import unpack_frame

pytestmark = pytest.mark.container

ROOT = Path(__file__).resolve().parent.parent
IMAGE = "rtts:container-test"
BASE = "rtts-base:local"  # python3 + python3-venv: the Dockerfile's BASE
SERVICES = "rtts-services:local"  # redis-server + nginx, Debian's, for the compose fleet
WHEELS = ".wheels-test"  # in the build context (.dockerignore lets .wheels* through)
KEY = "container-test-key-0123456789"
SECRET = "container-test-token-secret-0123456789abcdef"
PROJECT = "rttsfleet"  # the compose project
SUITE = "bookworm"  # python 3.11, the cp311 wheels the host's pip resolves
# mmdebstrap: a minimal Debian, no docs, man pages or translations
LEAN = [f"--dpkgopt=path-exclude=/usr/share/{d}/*" for d in ("doc", "man", "info", "locale")]


def sh(*cmd: str, env: dict[str, str] | None = None, timeout: float = 600,
       check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {res.returncode}:\n"
                             f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return res


class Docker:
    """A private dockerd and a client bound to it."""

    def __init__(self, exe: str, sock: Path) -> None:
        self.exe = exe
        self.env = {**os.environ, "DOCKER_HOST": f"unix://{sock}"}

    def __call__(self, *args: str, timeout: float = 600,
                 check: bool = True) -> subprocess.CompletedProcess[str]:
        return sh(self.exe, *args, env=self.env, timeout=timeout, check=check)

    def inspect(self, fmt: str, name: str) -> str:
        return self("inspect", "-f", fmt, name).stdout.strip()


def _unmount_below(path: Path) -> None:
    with open("/proc/mounts") as f:
        mounts = [line.split()[1] for line in f]
    for m in sorted((m for m in mounts if m.startswith(str(path))), reverse=True):
        subprocess.run(["umount", "-l", m], capture_output=True)


@pytest.fixture(scope="module")
def docker() -> Iterator[Docker]:
    dockerd = shutil.which("dockerd")
    client = "/usr/bin/docker" if os.path.exists("/usr/bin/docker") else shutil.which("docker")
    if dockerd is None or client is None or shutil.which("mmdebstrap") is None:
        pytest.skip("no container engine: needs dockerd, docker and mmdebstrap "
                    "(apt-get install docker.io mmdebstrap docker-compose)")
    if os.geteuid() != 0:
        pytest.skip("starting dockerd needs root")
    tmp = Path(tempfile.mkdtemp(prefix="rtts-ctr-", dir="/tmp"))  # short: socket paths
    had_bridge = Path("/sys/class/net/docker0").exists()
    # dockerd adds its chains and NAT rules to the host's iptables (and sets FORWARD to
    # DROP) and leaves them when it stops: put back what was there
    rules = subprocess.run(["iptables-save"], capture_output=True, text=True).stdout
    log = open(tmp / "dockerd.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [dockerd, "--data-root", str(tmp / "root"), "--exec-root", str(tmp / "exec"),
         "--pidfile", str(tmp / "dockerd.pid"), "--host", f"unix://{tmp / 'sock'}"],
        stdout=log, stderr=subprocess.STDOUT)
    d = Docker(client, tmp / "sock")
    try:
        deadline = time.monotonic() + 60
        while d("info", check=False, timeout=10).returncode != 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.skip("dockerd did not start: "
                            + (tmp / "dockerd.log").read_text()[-1500:])
            time.sleep(0.5)
        yield d
    finally:
        if proc.poll() is None:
            ids = d("ps", "-aq", check=False, timeout=30).stdout.split()
            if ids:
                d("rm", "-f", "-v", *ids, check=False, timeout=120)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        log.close()
        if not had_bridge:  # dockerd leaves its default bridge behind
            subprocess.run(["ip", "link", "delete", "docker0"], capture_output=True)
        if rules and "DOCKER" not in rules:
            subprocess.run(["iptables-restore"], input=rules, text=True, capture_output=True)
        _unmount_below(tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def _debian_image(d: Docker, tar: Path, packages: str, tag: str) -> None:
    sh("mmdebstrap", "--quiet", "--variant=minbase", f"--include={packages}", *LEAN,
       SUITE, str(tar), timeout=600)
    d("import", str(tar), tag)
    tar.unlink()


def _wheelhouse(dest: Path) -> None:
    """Every wheel ``.[chattts,redis]`` needs, for CPython 3.11 on Linux x86_64: the host's
    pip resolves them (its configured indexes, and the CPU torch wheel from wherever
    ``pip config`` points, e.g. a local wheel directory), building the sdists (ChatTTS)
    into wheels. async-timeout is redis's need on Python < 3.11.3 (bookworm has 3.11.2),
    which a newer host's pip does not see."""
    shutil.rmtree(dest, ignore_errors=True)
    sh(sys.executable, "-m", "pip", "wheel", "-q", "-w", str(dest), "-c",
       str(ROOT / "constraints.txt"), f"{ROOT}[chattts,redis]", "setuptools>=68",
       "async-timeout>=4.0.3", timeout=900)
    for own in dest.glob("rtts-*.whl"):  # the image installs rtts from its own sources
        own.unlink()
    torch = list(dest.glob("torch-*.whl"))
    assert torch and all("+cpu" in t.name for t in torch), [t.name for t in torch]
    assert not list(dest.glob("nvidia_*")), "a CUDA torch's libraries in the wheelhouse"


@pytest.fixture(scope="module")
def image(docker: Docker) -> Iterator[str]:
    tmp = Path(tempfile.mkdtemp(prefix="rtts-base-", dir="/tmp"))
    started = time.monotonic()
    try:
        with ThreadPoolExecutor(3) as pool:
            jobs = [
                pool.submit(_debian_image, docker, tmp / "base.tar",
                            "python3,python3-venv,ca-certificates,passwd", BASE),
                pool.submit(_debian_image, docker, tmp / "services.tar",
                            "redis-server,redis-tools,nginx", SERVICES),
                pool.submit(_wheelhouse, ROOT / WHEELS)]
            for job in jobs:
                job.result()
        prepared = time.monotonic()
        docker("build", "--build-arg", f"BASE={BASE}", "--build-arg", f"WHEELS={WHEELS}",
               "-t", IMAGE, str(ROOT), timeout=1200)
        size = int(docker.inspect("{{.Size}}", IMAGE))
        base = int(docker.inspect("{{.Size}}", BASE))
        print(f"\nimage {IMAGE}: {size / 1e6:.0f} MB ({base / 1e6:.0f} MB of it the base); "
              f"bases and wheels {prepared - started:.0f} s, "
              f"build {time.monotonic() - prepared:.0f} s")
        yield IMAGE
    finally:
        shutil.rmtree(ROOT / WHEELS, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


def wait_healthy(d: Docker, name: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while (status := d.inspect("{{.State.Health.Status}}", name)) != "healthy":
        assert status in ("starting", ""), (status, d("logs", name).stderr[-3000:])
        assert time.monotonic() < deadline, d("logs", name).stderr[-3000:]
        time.sleep(1)


def http(url: str, data: bytes | None = None, method: str | None = None,
         ctype: str = "application/json") -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=data, method=method, headers={
        "Authorization": f"Bearer {KEY}", "Content-Type": ctype})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


class Session:
    """A native ``/v1/stream`` session: ``ready`` says which instance holds it."""

    def __init__(self, ws, instance: str) -> None:  # type: ignore[no-untyped-def]
        self.ws, self.instance = ws, instance

    @classmethod
    async def open(cls, url: str) -> Session:
        ws = await connect(url, max_size=None, open_timeout=20,
                           additional_headers={"Authorization": f"Bearer {KEY}"})
        async with asyncio.timeout(20):
            ready = json.loads(await ws.recv())
        assert ready["type"] == "ready", ready
        return cls(ws, ready["instance"])

    async def speak(self, text: str, cid: str) -> bytes:
        audio = bytearray()
        for msg in ({"type": "start", "context_id": cid, "voice": "seed:3"},
                    {"type": "text", "context_id": cid, "text": text},
                    {"type": "end", "context_id": cid}):
            await self.ws.send(json.dumps(msg))
        async with asyncio.timeout(120):
            while True:
                msg = await self.ws.recv()
                if isinstance(msg, bytes):
                    audio += unpack_frame(msg)[1]
                    continue
                event = json.loads(msg)
                assert event["type"] != "error", event
                if event["type"] == "done" and event["context_id"] == cid:
                    return bytes(audio)


async def test_image_serves_as_non_root_and_drains_on_sigterm(docker: Docker,
                                                              image: str) -> None:
    import openai

    port = free_port()
    docker("run", "-d", "--name", "rtts-one", "-p", f"127.0.0.1:{port}:8765",
           "-e", f"RTTS_API_KEYS={KEY}", image)
    await asyncio.to_thread(wait_healthy, docker, "rtts-one")

    session = await Session.open(f"ws://127.0.0.1:{port}/v1/stream")
    two = "Hello from the container. It speaks two sentences."  # see the OpenAI call below
    assert len(await session.speak(two, "c1")) > 4800
    await session.ws.close()

    # Random weights end a segment wherever their sampled EOS falls, which depends on the
    # CPU's arithmetic: on one CI machine "Hello again." alone ended after 2 steps (0.03 s).
    # Two sentences are two segments, each with its own chance, and the check is their sum.
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY)
    wav = await client.audio.speech.create(
        model="tts-1", voice="alloy", response_format="wav",
        input="Hello again. This second request comes through the OpenAI client.")
    assert wav.content[:4] == b"RIFF" and len(wav.content) > 4800
    await client.close()

    # the server process (PID 1) runs as the image's system user
    assert docker("exec", "rtts-one", "id", "-un").stdout.strip() == "rtts"
    assert docker("exec", "rtts-one", "sh", "-c",
                  "grep ^Uid: /proc/1/status").stdout.split()[1] != "0"
    # lean: no pip, no compiler, no wheels, no sources in the image
    leftovers = docker("exec", "rtts-one", "sh", "-c",
                       "command -v pip pip3 gcc cc make; ls -d /wheels /src /root/.cache "
                       "2>/dev/null; true").stdout.split()
    assert leftovers == []

    stopped = time.monotonic()
    docker("stop", "-t", "30", "rtts-one", timeout=60)
    assert time.monotonic() - stopped < 25  # drained, not killed at -t
    assert docker.inspect("{{.State.ExitCode}}", "rtts-one") == "0"
    logs = docker("logs", "rtts-one")
    assert "signal received: draining" in logs.stdout + logs.stderr
    docker("rm", "rtts-one")


def service(d: Docker, name: str) -> str:
    """The container of a compose service (docker-compose and the plugin name them apart)."""
    (cid,) = d("ps", "-q", "-f", f"label=com.docker.compose.project={PROJECT}",
               "-f", f"label=com.docker.compose.service={name}").stdout.split()
    return cid


def metric(d: Docker, container: str, name: str) -> float:
    """A metric from inside a container (the worker publishes no port)."""
    text = d("exec", container, "python3", "-c",
             "import urllib.request; print(urllib.request.urlopen("
             "'http://127.0.0.1:8765/metrics').read().decode())").stdout
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


@pytest.fixture
def fleet(docker: Docker, image: str) -> Iterator[tuple[int, list[str]]]:
    compose = shutil.which("docker-compose")
    if compose is not None:
        cmd = [compose]
    elif docker("compose", "version", check=False).returncode == 0:
        cmd = [docker.exe, "compose"]
    else:
        pytest.skip("no compose: apt-get install docker-compose")
    port = free_port()
    env = {**docker.env, "RTTS_IMAGE": image, "REDIS_IMAGE": SERVICES,
           "NGINX_IMAGE": SERVICES, "RTTS_PORT": str(port), "RTTS_API_KEYS": KEY,
           "RTTS_TOKEN_SECRET": SECRET}
    cmd += ["-f", str(ROOT / "deploy" / "compose.yaml"), "-p", PROJECT]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return sh(*cmd, *args, env=env, timeout=600)

    try:
        run("up", "-d", "--no-build")  # nginx starts once both instances are healthy
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(OSError):
                if http(f"http://127.0.0.1:{port}/readyz")[0] == 200:
                    break
            assert time.monotonic() < deadline, run("logs", "--tail", "50").stdout
            time.sleep(1)
        yield port, cmd
    finally:
        sh(*cmd, "down", "-v", "--remove-orphans", "-t", "30", env=env, timeout=300,
           check=False)


async def test_compose_fleet_sessions_job_and_one_instance_stopped(
        docker: Docker, fleet: tuple[int, list[str]]) -> None:
    port, _ = fleet
    base = f"http://127.0.0.1:{port}"
    url = f"ws://127.0.0.1:{port}/v1/stream"

    # 1. least_conn: two held sessions, one on each instance, both speak
    sessions = [await Session.open(url) for _ in range(2)]
    by = {s.instance: s for s in sessions}
    assert sorted(by) == ["rtts-a", "rtts-b"]
    for name, s in by.items():
        assert len(await s.speak(f"Hello from {name}. It speaks two sentences.", "hi")) > 4800

    # 2. a job, submitted through nginx, finished by the worker (the instances are not workers)
    text = "# One\nIt was a dark and stormy night.\n# Two\nThe rain fell on the roofs.\n"
    status, body = await asyncio.to_thread(
        http, f"{base}/v1/jobs", json.dumps({"text": text, "format": "wav", "voice": "seed:2",
                                             "chapters": [0, text.index("# Two")]}).encode())
    assert status == 202, body
    job = json.loads(body)["id"]
    deadline = time.monotonic() + 180
    while (state := json.loads((await asyncio.to_thread(
            http, f"{base}/v1/jobs/{job}"))[1]))["state"] != "done":
        assert state["state"] in ("queued", "running"), state
        assert time.monotonic() < deadline, state
        await asyncio.sleep(1)
    status, audio = await asyncio.to_thread(http, f"{base}/v1/jobs/{job}/audio")
    assert status == 200 and audio[:4] == b"RIFF" and len(audio) > 4800
    stored = await asyncio.to_thread(metric, docker, service(docker, "worker"),
                                     'rtts_job_segments_total{outcome="stored"}')
    assert state["segments_total"] >= 2 and len(state["chapters"]) == 2
    assert stored == state["segments_total"]  # every segment, stored by the worker

    # 3. stop rtts-a (SIGTERM: it drains and exits 0); the session on rtts-b goes on
    a = service(docker, "rtts-a")
    await by["rtts-a"].ws.close()
    await asyncio.to_thread(docker, "stop", "-t", "30", a)
    assert docker.inspect("{{.State.ExitCode}}", a) == "0"
    after = "Still here after rtts-a stopped. Two sentences again."
    assert len(await by["rtts-b"].speak(after, "after")) > 4800
    newcomer = await Session.open(url)  # nginx skips the stopped instance
    assert newcomer.instance == "rtts-b"
    assert len(await newcomer.speak("A new session. It speaks two sentences.", "new")) > 4800
    for s in (by["rtts-b"], newcomer):
        await s.ws.close()
