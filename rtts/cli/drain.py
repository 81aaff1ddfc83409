"""``rtts drain``: start a server's graceful drain and wait until its sessions are done.

Made for a Kubernetes ``preStop`` hook (stdlib only, nothing to install in the image)::

    rtts drain --url http://127.0.0.1:8765 --wait 25

``POST /v1/admin/drain`` with the admin key (``--admin-key``, else ``RTTS_ADMIN_KEY``;
the first of a comma-separated list), then ``GET /v1/admin/drain`` every half second
until it reports 0 sessions or ``--wait`` seconds have passed. Exit 0 when drained, 1 on
a timeout (the sessions left then get SIGTERM's grace), 2 when the server refused or
could not be reached.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any

__all__ = ["add_drain_parser", "run_drain"]


def add_drain_parser(sub: Any) -> None:
    d = sub.add_parser("drain", help="drain a running server (for a preStop hook)",
                       description="Start a running server's graceful drain (POST "
                                   "/v1/admin/drain) and wait until no session is left.")
    d.add_argument("--url", default="http://127.0.0.1:8765", help="the server's base URL")
    d.add_argument("--admin-key", default=None,
                   help="the server's --admin-key (default: $RTTS_ADMIN_KEY)")
    d.add_argument("--wait", type=float, default=25.0,
                   help="seconds to wait for the sessions to finish")


def _call(url: str, key: str, method: str) -> dict[str, Any]:
    req = urllib.request.Request(f"{url.rstrip('/')}/v1/admin/drain", method=method,
                                 headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        body = json.loads(resp.read())
    return body if isinstance(body, dict) else {}


def run_drain(args: argparse.Namespace) -> int:
    key = args.admin_key or os.environ.get("RTTS_ADMIN_KEY", "").split(",")[0].strip()
    if not key:
        print("rtts drain: error: no admin key (--admin-key or RTTS_ADMIN_KEY)", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.wait
    try:
        status = _call(args.url, key, "POST")
        while status.get("sessions", 0) > 0 and time.monotonic() < deadline:
            time.sleep(0.5)
            status = _call(args.url, key, "GET")
    except urllib.error.HTTPError as exc:
        print(f"rtts drain: error: {exc.code} {exc.read().decode(errors='replace')[:200]}",
              file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"rtts drain: error: {args.url}: {exc}", file=sys.stderr)
        return 2
    left = int(status.get("sessions", 0))
    print(f"rtts drain: {left} sessions left")
    return 0 if left == 0 else 1
