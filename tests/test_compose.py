"""deploy/compose.yaml and deploy/nginx.conf agree with the server and with the proxy the
scale-out test runs (the fleet itself is brought up by tests/test_container.py)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from unittest import mock

import yaml

from procs import NGINX_CONF
from rtts.cli.main import build_parser, config_from_args

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def directives(conf: str) -> set[str]:
    """The ``location /`` block's directives, one per line, whitespace collapsed."""
    block = conf[conf.index("location / {"):]
    block = block[:block.index("}")]
    return {" ".join(line.split()) for line in block.splitlines()[1:]
            if line.strip() and not line.strip().startswith("#")}


def test_nginx_conf_proxies_like_the_scale_out_test():
    ours = directives((DEPLOY / "nginx.conf").read_text())
    tested = directives(NGINX_CONF.replace("{{", "{").replace("}}", "}"))
    assert tested <= ours, tested - ours


def test_nginx_upstreams_are_the_compose_instances():
    conf = (DEPLOY / "nginx.conf").read_text()
    upstreams = set(re.findall(r"server (\S+):8765", conf))
    services = compose()["services"]
    instances = {n for n, s in services.items() if "command" not in s and "build" in s}
    assert upstreams == instances == {"rtts-a", "rtts-b"}
    assert "worker" in services and "worker" not in upstreams


def test_every_rtts_service_parses_with_its_environment():
    for name, svc in compose()["services"].items():
        if "build" not in svc:
            continue
        env = {k: str(v) for k, v in svc["environment"].items()}
        env = {k: "x" * 40 if v.startswith("${") else v for k, v in env.items()}
        with mock.patch.dict(os.environ, env):
            args = build_parser().parse_args(svc.get("command", ["serve"]))
            cfg = config_from_args(args)
        assert cfg.instance_id == name
        assert cfg.cache.redis_url == "redis://redis:6379/0"
        assert cfg.jobs.redis_url == "redis://redis:6379/1"
        assert cfg.jobs.worker == (name == "worker")
        assert str(cfg.jobs.dir) == "/var/lib/rtts/jobs"  # the shared volume
        assert svc["volumes"] == ["jobs:/var/lib/rtts/jobs"]
        assert cfg.auth.api_keys and cfg.auth.token_secret
