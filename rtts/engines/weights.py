"""Where the ChatTTS weights come from: the source order, the Hugging Face cache, the download.

With no model configured (``--source auto``, no ``--model-dir``), ``rtts serve`` takes the
first of these that exists:

1. ``--model-dir DIR`` (``source="model-dir"``);
2. ``$RTTS_HOME/ChatTTS`` (default ``~/.cache/rtts/ChatTTS``): a local copy in ChatTTS's
   ``asset/`` layout (``"local"``);
3. the Hugging Face cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
   ``~/.cache/huggingface/hub``): a snapshot of ``2Noise/ChatTTS`` with every asset file
   (``"hf-cache"``);
4. a download of ``2Noise/ChatTTS`` into that cache through ``huggingface_hub`` (progress
   bars on the terminal, interrupted downloads resume), after a probe of the hub that gives
   up after ``RTTS_HUB_TIMEOUT`` seconds (default 5); skipped when ``HF_HUB_OFFLINE=1``
   (``"download"``);
5. only if all of these fail: the tiny random-weight checkpoint under
   :func:`rtts.config.default_model_dir`, with a loud warning (``"random-default"``).

Every candidate is loaded with ``Chat.load(source="custom")``, which checks each file's
sha256 against a table, so a corrupt or partial copy fails and the next candidate is tried.
The table is ChatTTS's own for a local directory, the checkpoint's own for a random one, and
for a hub snapshot the hub's: the cache names each large (LFS) file's blob by the sha256 of
its content (:func:`snapshot_sha256_map`), so what is checked is what the hub published. This
module only finds candidates; it imports neither torch nor ChatTTS.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rtts.config import default_home, default_model_dir
from rtts.engines.checkpoint import _FILES as SHA256_KEYS
from rtts.engines.checkpoint import is_random_checkpoint
from rtts.errors import RttsError

__all__ = ["ASSET_FILES", "HF_REPO", "REAL_SPEECH_HINT", "Candidate", "HubUnavailable",
           "candidates", "download", "has_assets", "hf_cache_dir", "hf_cached_snapshot",
           "hub_endpoint", "local_weights_dir", "probe_hub", "snapshot_sha256_map"]

logger = logging.getLogger("rtts.weights")

HF_REPO = "2Noise/ChatTTS"
# What Chat.load(source="custom") reads (ChatTTS/res/sha256_map.json names these files).
ASSET_FILES = (
    "asset/Decoder.safetensors", "asset/DVAE.safetensors", "asset/Embed.safetensors",
    "asset/Vocos.safetensors", "asset/gpt/config.json", "asset/gpt/model.safetensors",
    "asset/tokenizer/special_tokens_map.json", "asset/tokenizer/tokenizer_config.json",
    "asset/tokenizer/tokenizer.json",
)
DEFAULT_HUB_TIMEOUT_S = 5.0
# What to do about noise, in the RANDOM warning, the `listening` line, `rtts doctor`, the demo.
REAL_SPEECH_HINT = (
    "For real speech offline now: `make run-piper` (the piper test voice; or `rtts serve "
    "--engine piper --voice-model VOICE.onnx`); for ChatTTS, copy its weights to "
    "~/.cache/rtts/ChatTTS/asset/ or pass --model-dir DIR (docs/real-speech.md)")


class HubUnavailable(RttsError, RuntimeError):
    """The hub could not be reached (or offline mode is on): no download attempted."""

    expected = True  # a state of the machine, not a bug: logged in one line, no traceback


@dataclass(frozen=True)
class Candidate:
    """A directory to try loading, and how it was found."""

    path: Path
    source: str  # model-dir | local | hf-cache | download | random-default
    repo: str | None = None
    revision: str | None = None  # the hub commit of a cached or downloaded snapshot

    @property
    def kind(self) -> str:
        return "random" if is_random_checkpoint(self.path) else "real"


def has_assets(path: Path) -> bool:
    return all((path / rel).is_file() for rel in ASSET_FILES)


def local_weights_dir() -> Path:
    """``$RTTS_HOME/ChatTTS``: where an operator may put a copy of the real weights."""
    return default_home() / "ChatTTS"


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, by the hub's own variables (read now, not at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return Path(home) / "hub"


def hf_cached_snapshot(repo: str = HF_REPO, cache: Path | None = None) -> Candidate | None:
    """The cached snapshot of ``repo`` that ``refs/main`` names, else the newest complete
    one; None when none has every asset file."""
    root = (cache or hf_cache_dir()) / ("models--" + repo.replace("/", "--"))
    snapshots = root / "snapshots"
    if not snapshots.is_dir():
        return None
    ordered: list[Path] = []
    ref = root / "refs" / "main"
    if ref.is_file():
        ordered.append(snapshots / ref.read_text().strip())
    ordered += sorted((p for p in snapshots.iterdir() if p.is_dir()),
                      key=lambda p: p.stat().st_mtime, reverse=True)
    for snap in ordered:
        if snap.is_dir() and has_assets(snap):
            return Candidate(snap, "hf-cache", repo, snap.name)
    return None


def snapshot_sha256_map(snapshot: Path) -> dict[str, str]:
    """The sha256 table (ChatTTS's ``sha256_map.json`` keys) that a hub snapshot's files must
    match. A file whose cache blob is named by a sha256 (the hub's LFS files: the weights)
    must hash to that name; a small file stored in git (the JSONs, blob named by its git
    object id) is checked against that id here and its sha256 taken as is. Raises
    :class:`ValueError` for a small file that differs from its git id."""
    table = {}
    for key, rel in SHA256_KEYS.items():
        file = snapshot / rel
        blob = file.resolve()
        if blob.parent.name == "blobs" and re.fullmatch(r"[0-9a-f]{64}", blob.name):
            table[key] = blob.name  # ChatTTS's check hashes the content against it
            continue
        data = file.read_bytes()
        if blob.parent.name == "blobs" and re.fullmatch(r"[0-9a-f]{40}", blob.name):
            git_id = hashlib.sha1(b"blob %d\0" % len(data) + data,  # noqa: S324 - git's id
                                  usedforsecurity=False).hexdigest()
            if git_id != blob.name:
                raise ValueError(f"{rel} in {snapshot} differs from what the hub published")
        table[key] = hashlib.sha256(data).hexdigest()
    return table


def hub_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def hub_timeout() -> float:
    try:
        return float(os.environ.get("RTTS_HUB_TIMEOUT", DEFAULT_HUB_TIMEOUT_S))
    except ValueError:
        return DEFAULT_HUB_TIMEOUT_S


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def probe_hub(repo: str = HF_REPO, timeout: float | None = None) -> None:
    """One HTTP request to the hub's API for ``repo``, bounded by ``timeout`` (connect and
    read); :class:`HubUnavailable` with the reason when it does not answer."""
    if _offline():
        raise HubUnavailable("HF_HUB_OFFLINE is set")
    url = f"{hub_endpoint()}/api/models/{repo}"
    limit = hub_timeout() if timeout is None else timeout
    try:
        with urllib.request.urlopen(url, timeout=limit) as resp:
            resp.read(1)
    except urllib.error.HTTPError as exc:
        if exc.code >= 500 or exc.code in (401, 403, 404, 429):
            raise HubUnavailable(f"{url} answered {exc.code}") from None
    except (OSError, ValueError) as exc:  # URLError, timeouts, refused, DNS
        reason = getattr(exc, "reason", exc)
        raise HubUnavailable(f"{url} unreachable within {limit:g}s: {reason}") from None


def download(repo: str = HF_REPO, cache: Path | None = None) -> Candidate:
    """Download ``repo``'s weights into the hub cache (progress bars, resumable) after a
    short probe; :class:`HubUnavailable` when the hub cannot be reached."""
    probe_hub(repo)
    from huggingface_hub import snapshot_download

    logger.info("downloading %s from %s into %s (about 1.1 GB; resumes if interrupted)",
                repo, hub_endpoint(), cache or hf_cache_dir())
    kwargs: dict[str, Any] = {"etag_timeout": max(hub_timeout(), 10.0)}
    path = Path(snapshot_download(
        repo, cache_dir=str(cache or hf_cache_dir()), endpoint=hub_endpoint(),
        allow_patterns=["asset/*.safetensors", "asset/*.json"], **kwargs))
    if not has_assets(path):
        missing = [rel for rel in ASSET_FILES if not (path / rel).is_file()]
        raise RuntimeError(f"download of {repo} lacks {', '.join(missing)}")
    return Candidate(path, "download", repo, path.name)


def candidates(source: str, model_dir: Path | None) -> Iterator[Candidate]:
    """The directories to try, in order, for ``source`` (auto | custom | huggingface |
    random). Lazy: the hub is probed only when the earlier candidates are used up (or
    failed to load), and the random checkpoint is written only when reached."""
    from rtts.engines.checkpoint import ensure_default_checkpoint

    if source == "random":
        yield Candidate(ensure_default_checkpoint(default_model_dir()), "random-default")
        return
    if source == "custom" or (source == "auto" and model_dir is not None):
        if model_dir is None:
            raise ValueError("--source custom needs --model-dir")
        yield Candidate(model_dir, "model-dir")
        return
    if source not in ("auto", "huggingface"):
        raise ValueError(f"unknown model source {source!r}")
    if source == "auto":
        local = local_weights_dir()
        if has_assets(local):
            yield Candidate(local, "local")
        else:
            logger.info("no weights in %s", local)
    cached = hf_cached_snapshot()
    if cached is not None:
        yield cached
    else:
        logger.info("no %s snapshot in the Hugging Face cache %s", HF_REPO, hf_cache_dir())
    try:
        yield download()
    except HubUnavailable as exc:
        if source == "huggingface":
            raise HubUnavailable(f"--source huggingface: no {HF_REPO} snapshot in "
                                 f"{hf_cache_dir()} and no download: {exc}. Copy the weights to "
                                 f"{local_weights_dir()}/asset/ and use --source auto, or "
                                 "serve the piper test voice: make run-piper") from None
        logger.warning("not downloading %s: %s", HF_REPO, exc)
    except Exception as exc:  # a failed download is one more reason to fall back
        if source == "huggingface":
            raise
        logger.warning("download of %s failed: %s: %s", HF_REPO, type(exc).__name__, exc)
    if source == "auto":
        path = default_model_dir()
        logger.warning("no real ChatTTS weights found (see above): using the embedded "
                       "default, a tiny RANDOM-WEIGHT checkpoint at %s (it speaks noise). %s",
                       path, REAL_SPEECH_HINT)
        yield Candidate(ensure_default_checkpoint(path), "random-default")
