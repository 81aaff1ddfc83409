"""Real external processes for scale-out tests: redis-server, nginx, ``rtts serve``.

Each is started on a free loopback port under a temporary directory, waited for until
it answers, and stopped (and reaped) when its context manager exits.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

__all__ = ["free_port", "start_nginx", "start_redis", "start_rtts", "wait_http"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port}")


def wait_http(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as r:
            if r.status == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url} never answered 200")


def _stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 15) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def start_redis(workdir: Path) -> Iterator[str]:
    port = free_port()
    out = (workdir / "redis.log").open("wb")
    proc = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", str(port),
         "--bind", "127.0.0.1", "--dir", str(workdir), "--save", "", "--appendonly", "no"],
        stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_port(port)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        _stop(proc)
        out.close()


@contextlib.contextmanager
def start_rtts(args: list[str], port: int, log: Path,
               env: dict[str, str] | None = None,
               nofile: int | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """``python -m rtts serve --port PORT ARGS``; yields once ``/readyz`` is 200. With
    ``nofile``, the server runs under that open-file limit (soft and hard)."""
    out = log.open("wb")

    def limit() -> None:
        import resource

        assert nofile is not None
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    proc = subprocess.Popen(
        [sys.executable, "-m", "rtts", "serve", "--host", "127.0.0.1", "--port", str(port),
         *args], stdout=out, stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})}, preexec_fn=limit if nofile else None)
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz")
        yield proc
    finally:
        _stop(proc)
        out.close()


NGINX_CONF = """
worker_processes 1;
daemon off;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 1024; }}
http {{
  access_log {d}/access.log;
  client_body_temp_path {d}/body; proxy_temp_path {d}/proxy;
  fastcgi_temp_path {d}/fastcgi; uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;
  map $http_upgrade $connection_upgrade {{ default upgrade; '' close; }}
  upstream rtts {{
    least_conn;
{servers}
  }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://rtts;
      proxy_http_version 1.1;
      proxy_set_header Upgrade $http_upgrade;
      proxy_set_header Connection $connection_upgrade;
      proxy_set_header Host $host;
      proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
      proxy_read_timeout 3600s;
      proxy_send_timeout 3600s;
      proxy_buffering off;
      # a draining instance answers 503 (and finally closes its listener): try the next one
      proxy_next_upstream error timeout http_503;
      proxy_connect_timeout 2s;
    }}
  }}
}}
"""


@contextlib.contextmanager
def start_nginx(workdir: Path, upstream_ports: list[int]) -> Iterator[int]:
    """nginx on a free port, WebSocket upgrade, ``least_conn`` over the upstreams."""
    port = free_port()
    servers = "\n".join(f"    server 127.0.0.1:{p} max_fails=0;" for p in upstream_ports)
    conf = workdir / "nginx.conf"
    conf.write_text(NGINX_CONF.format(d=workdir, port=port, servers=servers))
    exe = shutil.which("nginx") or "/usr/sbin/nginx"
    subprocess.run([exe, "-t", "-q", "-c", str(conf), "-p", str(workdir)], check=True)
    proc = subprocess.Popen([exe, "-c", str(conf), "-p", str(workdir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port)
        yield port
    finally:
        _stop(proc, signal.SIGQUIT)
