"""The Kubernetes manifests agree with the server they deploy (paths, port, drain, metric)."""

import os
from pathlib import Path
from unittest import mock

import yaml

from rtts.cli.main import build_parser, config_from_args
from rtts.config import ServerConfig
from rtts.engines.fake import FakeEngine
from rtts.metrics import render_metrics
from rtts.server import App

MANIFEST = Path(__file__).resolve().parent.parent / "deploy" / "k8s" / "rtts.yaml"


def docs() -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all(MANIFEST.read_text())}


def test_probes_port_and_drain_match_the_server():
    dep = docs()["Deployment"]["spec"]["template"]["spec"]
    c = dep["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    args = build_parser().parse_args(c["args"])
    cfg = config_from_args(args)
    assert cfg.port == c["ports"][0]["containerPort"] and cfg.host == "0.0.0.0"
    # preStop is `sleep N && rtts drain --wait M` (the admin API's drain, its key from a
    # Secret); SIGTERM arrives after it, and everything must fit in the grace period
    script = c["lifecycle"]["preStop"]["exec"]["command"][-1].split()
    sleep, drain = script[:script.index("&&")], script[script.index("rtts"):]
    assert sleep[0] == "sleep" and drain[:2] == ["rtts", "drain"]
    drain_args = build_parser().parse_args(drain[1:])
    env = {e["name"]: e for e in c["env"]}
    assert "secretKeyRef" in env["RTTS_ADMIN_KEY"]["valueFrom"]  # the server's --admin-key
    with mock.patch.dict(os.environ, {"RTTS_ADMIN_KEY": "a" * 24}):
        assert config_from_args(build_parser().parse_args(c["args"])).auth.admin_keys == (
            "a" * 24,)
    assert drain_args.url.endswith(f":{cfg.port}")
    assert int(sleep[1]) + drain_args.wait + cfg.shutdown_grace_s + cfg.close_timeout_s < dep[
        "terminationGracePeriodSeconds"]


async def test_hpa_metric_is_exported():
    metric = docs()["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["pods"]["metric"]["name"]
    app = App(ServerConfig(), FakeEngine())
    names = {line.split("{")[0].split(" ")[0] for line in render_metrics(app).splitlines()
             if line and not line.startswith("#")}
    assert metric in names


def test_replicas_share_a_token_secret_from_a_kubernetes_secret():
    """Browser tokens must work on every replica: the manifest feeds the variables the
    server reads (RTTS_TOKEN_SECRET, RTTS_PREVIOUS_TOKEN_SECRET for rotation) from a Secret."""
    import os
    from unittest import mock

    env = {e["name"]: e for e in docs()["Deployment"]["spec"]["template"]["spec"]
           ["containers"][0]["env"]}
    for name in ("RTTS_TOKEN_SECRET", "RTTS_PREVIOUS_TOKEN_SECRET"):
        assert "secretKeyRef" in env[name]["valueFrom"]
    with mock.patch.dict(os.environ, {"RTTS_TOKEN_SECRET": "c" * 40,
                                      "RTTS_PREVIOUS_TOKEN_SECRET": "p" * 40}):
        cfg = config_from_args(build_parser().parse_args(["serve"]))
    assert cfg.auth.token_secret == b"c" * 40 and cfg.auth.previous_token_secret == b"p" * 40
