"""The Kubernetes manifests validate strictly and agree with the server: the HPA's
custom metric is exported and served by the prometheus-adapter rule, KEDA's ScaledObject
watches the job streams and group the job store really uses."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from rtts.config import ServerConfig
from rtts.engines.fake import FakeEngine
from rtts.jobs.model import JobsConfig
from rtts.jobs.store import JobStore
from rtts.metrics import render_metrics
from rtts.server import App

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
KEDA_SCHEMA = Path(__file__).resolve().parent / "schemas" / "keda-scaledobject-v1alpha1.json"


def validator() -> list[str]:
    exe = shutil.which("kubernetes-validate") or str(Path(sys.executable).parent
                                                       / "kubernetes-validate")
    return [exe, "--strict"]


def load(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def one(name: str, kind: str) -> dict[str, Any]:
    return next(d for d in load(name) if d["kind"] == kind)


def test_every_manifest_validates_strictly_and_strict_is_real(tmp_path):
    """kubernetes-validate --strict (its bundled schemas, offline) passes every core
    resource; it has no schema for KEDA's CRD (said, not skipped: next test)."""
    files = sorted(K8S.glob("*.yaml"))
    out = subprocess.run([*validator(), *map(str, files)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout + out.stderr
    for f in files:
        for d in load(f.name):
            if d["apiVersion"].startswith("keda.sh/"):
                assert f"Couldn't find schema for kind {d['kind']}" in text
            else:
                name = f"{d['kind'].lower()}/{d['metadata']['name']}"
                assert f"passed for resource {name}" in text, (name, text)
    # the same HPA with one misspelt field fails: strict catches what plain would not
    hpa = one("rtts.yaml", "HorizontalPodAutoscaler")
    hpa["spec"]["metrics"][0]["pods"]["metric"]["nmae"] = "typo"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(hpa))
    out = subprocess.run([*validator(), str(bad)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and "nmae" in out.stdout + out.stderr


def test_keda_scaledobject_against_kedas_documented_schema():
    schema = json.loads(KEDA_SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    so = one("rtts-workers-keda.yaml", "ScaledObject")
    jsonschema.validate(so, schema)
    for broken in ({"spec": {**so["spec"], "minReplicas": 0}},  # HPA's word, not KEDA's
                   {"spec": {**so["spec"], "triggers": [
                       {**so["spec"]["triggers"][0],
                        "metadata": {"address": "r:6379", "lagCount": "5",
                                     "stream": "s"}}]}}):  # lag without a group
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**so, **broken}, schema)


def test_keda_scales_workers_to_zero_on_the_job_store_streams():
    so = one("rtts-workers-keda.yaml", "ScaledObject")
    worker = one("rtts-workers.yaml", "Deployment")
    assert so["spec"]["scaleTargetRef"]["name"] == worker["metadata"]["name"]
    assert so["spec"]["minReplicaCount"] == 0
    env = {e["name"]: e.get("value") for e in
           worker["spec"]["template"]["spec"]["containers"][0]["env"]}
    redis = env["RTTS_JOBS_REDIS"]  # redis://host:port/db
    host_port, db = redis.removeprefix("redis://").split("/")
    store = JobStore(JobsConfig(redis_url=redis))
    for trigger in so["spec"]["triggers"]:
        meta = trigger["metadata"]
        assert trigger["type"] == "redis-streams"
        assert meta["address"] == host_port and meta["databaseIndex"] == db
        assert meta["consumerGroup"] == store.group
        assert "lagCount" in meta  # the one measure that scales to zero
        assert meta["stream"] == store.queue or meta["stream"].startswith(
            store.queue_of(""))


async def test_hpa_targets_the_capacity_gauge_through_the_adapter_rule():
    hpa = one("rtts.yaml", "HorizontalPodAutoscaler")
    pods = hpa["spec"]["metrics"][0]["pods"]
    name = pods["metric"]["name"]
    assert name == "rtts_capacity_utilization"
    assert 0 < float(pods["target"]["averageValue"].removesuffix("m")) / 1000 < 1
    rules = yaml.safe_load(one("prometheus-adapter.yaml", "ConfigMap")["data"]["config.yaml"])
    rule = next(r for r in rules["rules"] if r["name"]["as"] == name)
    assert name in rule["seriesQuery"]
    assert all(t in rule["metricsQuery"] for t in ("<<.Series>>", "<<.LabelMatchers>>",
                                                   "<<.GroupBy>>"))
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    app = App(ServerConfig(), FakeEngine())
    exported = {line.split("{")[0].split(" ")[0]
                for line in render_metrics(app).splitlines() if line and line[0] != "#"}
    assert name in exported
    for other in rules["rules"]:  # every series a rule serves exists
        query = other["seriesQuery"]
        names = (query.split('__name__=~"')[1].split('"')[0].split("|")
                 if "__name__" in query else [query.split("{")[0]])
        assert names and set(names) <= exported, names
