"""``rtts job submit|status|cancel|download``: the job API from the command line.

``rtts job submit book.txt --voice alloy -o book.mp3`` streams the file up (never read
whole), shows a progress bar on stderr while workers synthesize it, then downloads the
audio. Standard library HTTP only (``http.client``), so the client needs nothing extra.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["add_job_parser", "heading_offsets", "progress_line", "run_job_command"]

_HEADING = re.compile(r"^(#{1,6}\s|chapter\s+\w+|第.{1,9}章)", re.IGNORECASE)


def add_job_parser(sub: Any) -> None:
    j = sub.add_parser("job", help="long-text jobs: submit a file, follow, download")
    j.add_argument("--url", default=os.environ.get("RTTS_URL", "http://127.0.0.1:8765"),
                   help="server base URL (default $RTTS_URL)")
    j.add_argument("--api-key", default=os.environ.get("RTTS_API_KEY"),
                   help="API key (default $RTTS_API_KEY)")
    jsub = j.add_subparsers(dest="job_command", required=True)
    s = jsub.add_parser("submit", help="submit a UTF-8 text file; follow it; download")
    _where(s)
    s.add_argument("file", type=Path)
    s.add_argument("--voice", default=None)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--format", default="mp3", help="mp3, wav, aac, pcm16, mulaw, alaw")
    s.add_argument("--sample-rate", type=int, default=None)
    s.add_argument("--chapters", default=None,
                   help="'headings' (lines like '# ...', 'Chapter 3', '第三章') or offsets "
                        "'0,1200,...'")
    s.add_argument("-o", "--output", type=Path, default=None,
                   help="write the audio here when done (default: only submit and follow)")
    s.add_argument("--no-wait", action="store_true", help="print the job id and return")
    st = jsub.add_parser("status", help="a job's state and progress (JSON)")
    st.add_argument("id")
    _where(st)
    c = jsub.add_parser("cancel", help="cancel a job")
    c.add_argument("id")
    _where(c)
    d = jsub.add_parser("download", help="download a job's audio (follows a running job)")
    d.add_argument("id")
    _where(d)
    d.add_argument("-o", "--output", type=Path, required=True)
    d.add_argument("--chapter", type=int, default=None)


def _where(p: argparse.ArgumentParser) -> None:
    """``--url`` and ``--api-key`` after the sub-command too (``rtts job status ID --url U``);
    given there, they override the ones before it."""
    for flag, env in (("--url", "RTTS_URL"), ("--api-key", "RTTS_API_KEY")):
        action = p.add_argument(flag, default=argparse.SUPPRESS,
                                help=f"as `rtts job {flag}` (also ${env})")
        action.rtts_env = env  # type: ignore[attr-defined]


def heading_offsets(path: Path) -> list[int]:
    """Character offsets of chapter heading lines in a UTF-8 file (read line by line)."""
    offsets, pos = [], 0
    with path.open(encoding="utf-8", newline="") as f:
        for line in f:
            if _HEADING.match(line.strip()):
                offsets.append(pos)
            pos += len(line)
    return offsets


def progress_line(status: dict[str, Any], width: int = 30) -> str:
    total = max(1, int(status.get("segments_total") or 0))
    done = int(status.get("segments_done") or 0)
    filled = int(width * done / total)
    eta = status.get("eta_seconds")
    left = f" ~{_clock(eta)} left" if isinstance(eta, int | float) and eta > 0 else ""
    return (f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} segments "
            f"{_clock(status.get('audio_seconds') or 0)} audio {status.get('state')}{left}")


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class _Client:
    def __init__(self, url: str, api_key: str | None) -> None:
        parts = urllib.parse.urlsplit(url)
        self.https = parts.scheme == "https"
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if self.https else 80)
        self.base = parts.path.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def request(self, method: str, path: str, body: BinaryIO | bytes | None = None,
                headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=60)
        conn.request(method, self.base + path, body=body,
                     headers={**self.headers, **(headers or {})})
        return conn.getresponse()

    def json(self, method: str, path: str) -> dict[str, Any]:
        while True:
            resp = self.request(method, path)
            data = resp.read()
            if resp.status == 429:  # per-key quota: wait as told
                time.sleep(float(resp.getheader("Retry-After") or 1))
                continue
            out: dict[str, Any] = json.loads(data) if data else {}
            if resp.status >= 400:
                raise SystemExit(f"error {resp.status}: "
                                 f"{out.get('error', {}).get('message', data.decode())}")
            return out


def _download(client: _Client, job: str, output: Path, chapter: int | None) -> int:
    path = f"/v1/jobs/{job}/audio" + (f"?chapter={chapter}" if chapter is not None else "")
    resp = client.request("GET", path)
    if resp.status != 200:
        raise SystemExit(f"error {resp.status}: {resp.read().decode(errors='replace')}")
    written = 0
    tmp = output.with_name(output.name + ".part")
    with tmp.open("wb") as f:
        while data := resp.read(256 * 1024):
            f.write(data)
            written += len(data)
    tmp.replace(output)
    return written


def run_job_command(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except OSError as exc:
        print(f"rtts job: error: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    client = _Client(args.url, args.api_key)
    if args.job_command == "status":
        print(json.dumps(client.json("GET", f"/v1/jobs/{args.id}"), indent=2))
        return 0
    if args.job_command == "cancel":
        print(json.dumps(client.json("DELETE", f"/v1/jobs/{args.id}"), indent=2))
        return 0
    if args.job_command == "download":
        n = _download(client, args.id, args.output, args.chapter)
        print(f"{n} bytes written to {args.output}", file=sys.stderr)
        return 0
    # submit
    query: dict[str, Any] = {"format": args.format}
    for key, value in (("voice", args.voice), ("seed", args.seed),
                       ("sample_rate", args.sample_rate)):
        if value is not None:
            query[key] = value
    if args.chapters == "headings":
        query["chapters"] = ",".join(map(str, heading_offsets(args.file)))
    elif args.chapters:
        query["chapters"] = args.chapters
    size = args.file.stat().st_size
    with args.file.open("rb") as f:
        resp = client.request("POST", "/v1/jobs?" + urllib.parse.urlencode(query), body=f,
                              headers={"Content-Type": "text/plain; charset=utf-8",
                                       "Content-Length": str(size)})
        data = resp.read()
    status: dict[str, Any] = json.loads(data) if data else {}
    if resp.status != 202:
        message = status.get("error", {}).get("message", data.decode(errors="replace"))
        print(f"error {resp.status}: {message}", file=sys.stderr)
        return 1
    job = status["id"]
    print(job)
    if args.no_wait:
        return 0
    tty = sys.stderr.isatty()
    while status["state"] in ("queued", "running"):
        print(("\r" if tty else "") + progress_line(status), end="" if tty else "\n",
              file=sys.stderr, flush=True)
        time.sleep(1.0 if tty else 2.0)
        status = client.json("GET", f"/v1/jobs/{job}")
    print(("\r" if tty else "") + progress_line(status), file=sys.stderr)
    if status["state"] != "done":
        print(f"job {status['state']}: {status.get('error') or ''}", file=sys.stderr)
        return 1
    if args.output is not None:
        n = _download(client, job, args.output, None)
        print(f"{n} bytes written to {args.output}", file=sys.stderr)
    return 0
