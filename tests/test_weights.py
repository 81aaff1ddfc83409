"""Where the weights come from (rtts.engines.weights): a local directory, the Hugging Face
cache, a hub that cannot be reached (fall back within seconds, with the warning), and what
/v1/info, the ``ready`` event and /metrics then report. Nothing is downloaded: the "hub" is
a local socket that never answers, the cache a directory in the hub's layout holding the
tiny random checkpoint."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import shutil
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from helpers import base_config, client, server
from rtts.config import EngineConfig
from rtts.engines.weights import (
    ASSET_FILES,
    HubUnavailable,
    candidates,
    hf_cached_snapshot,
    probe_hub,
    snapshot_sha256_map,
)

REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def homes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """Empty RTTS_HOME and HF_HOME; the hub reachable only through HF_ENDPOINT."""
    paths = {"rtts": tmp_path / "rtts", "hf": tmp_path / "hf"}
    monkeypatch.setenv("RTTS_HOME", str(paths["rtts"]))
    monkeypatch.setenv("HF_HOME", str(paths["hf"]))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return paths


@pytest.fixture
def silent_hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A 'hub' that accepts connections and never answers (a black hole)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("RTTS_HUB_TIMEOUT", "1")
    yield url
    sock.close()


def fake_weights(dest: Path, source: Path) -> Path:
    shutil.copytree(source, dest)
    return dest


def hf_layout(hf_home: Path, source: Path, revision: str = REVISION) -> Path:
    """models--2Noise--ChatTTS/{blobs,refs/main,snapshots/REV/...} with snapshot files as
    symlinks into blobs/, as huggingface_hub lays them out: weights (LFS) blobs named by
    their sha256, small files by their git object id."""
    root = hf_home / "hub" / "models--2Noise--ChatTTS"
    snap = root / "snapshots" / revision
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        rel = file.relative_to(source)
        data = file.read_bytes()
        name = (hashlib.sha256(data).hexdigest() if file.suffix == ".safetensors" else
                hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest())
        blob = root / "blobs" / name
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file, blob)
        (snap / rel).parent.mkdir(parents=True, exist_ok=True)
        (snap / rel).symlink_to(blob)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(revision)
    return snap


# -- the source order, without loading anything --------------------------------------------


def test_local_directory_comes_first(homes, tiny_checkpoint):
    fake_weights(homes["rtts"] / "ChatTTS", tiny_checkpoint)
    hf_layout(homes["hf"], tiny_checkpoint)
    first = next(candidates("auto", None))
    assert (first.source, first.path) == ("local", homes["rtts"] / "ChatTTS")
    assert first.kind == "random"  # the marker file tells, wherever the files are


def test_model_dir_wins_and_custom_is_only_the_model_dir(homes, tiny_checkpoint, tmp_path):
    fake_weights(homes["rtts"] / "ChatTTS", tiny_checkpoint)
    assert [(c.source, c.path) for c in candidates("auto", tiny_checkpoint)] == [
        ("model-dir", tiny_checkpoint)]
    assert [c.source for c in candidates("custom", tmp_path / "nope")] == ["model-dir"]


def test_hf_cache_snapshot_is_found_by_refs_main(homes, tiny_checkpoint):
    snap = hf_layout(homes["hf"], tiny_checkpoint)
    found = hf_cached_snapshot()
    assert found is not None and found.path == snap and found.revision == REVISION
    first = next(candidates("auto", None))
    assert (first.source, first.revision) == ("hf-cache", REVISION)


def test_incomplete_hf_snapshot_is_skipped(homes, tiny_checkpoint):
    snap = hf_layout(homes["hf"], tiny_checkpoint)
    (snap / ASSET_FILES[0]).unlink()
    assert hf_cached_snapshot() is None


def test_snapshot_table_is_the_hubs_content_addresses(homes, tiny_checkpoint):
    snap = hf_layout(homes["hf"], tiny_checkpoint)
    table = snapshot_sha256_map(snap)
    gpt = snap / "asset" / "gpt" / "model.safetensors"
    assert table["sha256_asset_gpt_model_safetensors"] == gpt.resolve().name \
        == hashlib.sha256(gpt.read_bytes()).hexdigest()
    config = snap / "asset" / "gpt" / "config.json"
    assert table["sha256_asset_gpt_config_json"] == hashlib.sha256(
        config.read_bytes()).hexdigest()
    config.resolve().write_text("{}")  # a small file that is not what the hub published
    with pytest.raises(ValueError, match="differs from what the hub published"):
        snapshot_sha256_map(snap)


def test_unreachable_hub_falls_back_to_random_within_seconds(homes, silent_hub, caplog):
    caplog.set_level(logging.INFO, "rtts")
    t0 = time.monotonic()
    found = list(candidates("auto", None))
    took = time.monotonic() - t0
    assert [c.source for c in found] == ["random-default"]
    assert found[0].kind == "random" and found[0].path == homes["rtts"] / "random-tiny"
    assert took < 8, took  # 1 s probe timeout, plus writing the tiny checkpoint
    text = caplog.text
    assert "not downloading 2Noise/ChatTTS" in text and "unreachable within 1s" in text
    assert "RANDOM-WEIGHT" in text


def test_huggingface_source_does_not_fall_back(homes, silent_hub):
    with pytest.raises(HubUnavailable):
        list(candidates("huggingface", None))


def test_probe_is_bounded_by_the_timeout(silent_hub):
    t0 = time.monotonic()
    with pytest.raises(HubUnavailable, match="unreachable"):
        probe_hub(timeout=0.5)
    assert time.monotonic() - t0 < 3


def test_offline_mode_never_probes(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # would be refused anyway
    with pytest.raises(HubUnavailable, match="HF_HUB_OFFLINE"):
        probe_hub()


def test_probe_of_an_answering_hub_passes(monkeypatch):
    """A local HTTP server standing in for the hub's model API: the probe goes through."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen = []

    class Api(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            seen.append(self.path)
            body = json.dumps({"id": "2Noise/ChatTTS"}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Api)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{httpd.server_address[1]}")
        probe_hub(timeout=2)
        assert seen == ["/api/models/2Noise/ChatTTS"]
    finally:
        httpd.shutdown()
        httpd.server_close()


# -- what the server reports, loading the real ChatTTS code ------------------------------------


async def serve_and_report(cfg_engine: EngineConfig) -> tuple[dict, dict, str]:
    from rtts.engines.chattts import ChatTTSEngine

    cfg = replace(base_config(), engine=cfg_engine)
    async with server(cfg, ChatTTSEngine(cfg.engine)) as (app, url):
        assert app.state == "ready", app.state_reason
        port = int(url.split(":")[2].split("/")[0])

        def get(path: str) -> bytes:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
                return bytes(r.read())

        info = json.loads(await asyncio.to_thread(get, "/v1/info"))
        metrics = (await asyncio.to_thread(get, "/metrics")).decode()
        async with client(url) as c:
            ready = c.got.of("ready")[0]
    return info["weights"], ready["weights"], metrics


def engine_cfg(**kw: object) -> EngineConfig:
    return EngineConfig(threads=2, kernels="linear", stream_tokens=4, **kw)  # type: ignore


@pytest.mark.chattts
async def test_reports_local_directory(homes, tiny_checkpoint):
    fake_weights(homes["rtts"] / "ChatTTS", tiny_checkpoint)
    info, ready, metrics = await serve_and_report(engine_cfg())
    assert info["kind"] == "random" and info["source"] == "local"
    assert info["identity"].startswith("sha256:") and ready == info
    assert (f'rtts_weights_info{{kind="random",source="local",identity="{info["identity"]}"}}'
            " 1") in metrics


@pytest.mark.chattts
async def test_reports_hf_cache_and_skips_a_corrupt_local_copy(homes, tiny_checkpoint, caplog):
    local = fake_weights(homes["rtts"] / "ChatTTS", tiny_checkpoint)
    (local / "asset" / "tokenizer" / "tokenizer_config.json").write_text("{}")  # sha mismatch
    hf_layout(homes["hf"], tiny_checkpoint)
    caplog.set_level(logging.INFO, "rtts")
    info, ready, _ = await serve_and_report(engine_cfg())
    assert info == ready == {"kind": "random", "source": "hf-cache",
                             "identity": f"2Noise/ChatTTS@{REVISION}"}
    assert "sha256" in caplog.text and "trying the next source" in caplog.text


@pytest.mark.chattts
async def test_corrupt_hub_blob_is_refused_then_random_fallback(homes, tiny_checkpoint,
                                                                caplog):
    """A weights blob whose content is not the sha256 it is named by fails ChatTTS's check
    against the hub's table; with nothing else left, the random fallback serves."""
    snap = hf_layout(homes["hf"], tiny_checkpoint)
    blob = (snap / "asset" / "Vocos.safetensors").resolve()
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    caplog.set_level(logging.INFO, "rtts")
    info, _, _ = await serve_and_report(engine_cfg())
    assert info["source"] == "random-default"
    assert "sha256" in caplog.text and str(snap) in caplog.text


@pytest.mark.chattts
async def test_reports_random_fallback_when_the_hub_is_unreachable(homes, silent_hub, caplog):
    caplog.set_level(logging.INFO, "rtts")
    t0 = time.monotonic()
    info, ready, metrics = await serve_and_report(engine_cfg())
    assert info["kind"] == "random" and info["source"] == "random-default" and ready == info
    assert 'kind="random",source="random-default"' in metrics
    assert "RANDOM-WEIGHT" in caplog.text and time.monotonic() - t0 < 60


async def test_fake_engine_reports_no_weights():
    async with server() as (app, url), client(url) as c:
        ready = c.got.of("ready")[0]
        assert ready["weights"]["kind"] == "none" and app.info()["weights"] == ready["weights"]
