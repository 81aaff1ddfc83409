"""``rtts doctor``: check that ChatTTS can import here, and repair the known torchaudio problem.

PyPI's torchaudio wheels that match recent torch releases ship extension libraries
linked against CUDA (``libtorch_cuda.so``). Beside a CPU build of torch they fail to
load and ``import torchaudio`` raises ``OSError``. ChatTTS and vocos only use
torchaudio's pure-Python parts (``MelSpectrogram``, ``_hz_to_mel``), and torchaudio
imports as pure Python when those libraries are absent. ``--fix`` renames them to
``*.so.cuda-disabled`` -- only when torch itself has no CUDA.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

__all__ = ["cuda_linked_torchaudio_libs", "report_weights", "run_doctor"]


def _torchaudio_lib_dir() -> Path | None:
    spec = importlib.util.find_spec("torchaudio")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


def cuda_linked_torchaudio_libs() -> list[Path]:
    """torchaudio extension libraries that need CUDA while torch has none."""
    import torch

    if torch.version.cuda is not None:
        return []
    lib_dir = _torchaudio_lib_dir()
    if lib_dir is None or not lib_dir.is_dir():
        return []
    # The NEEDED entries of the dynamic section are plain strings in the file.
    return [so for so in sorted(lib_dir.glob("*.so")) if b"libtorch_cuda" in so.read_bytes()]


def report_weights() -> None:
    """Where ``rtts serve`` (no model configured) would find weights, in its order. Only
    looks at directories: no network, nothing loaded."""
    import os

    from rtts.config import default_model_dir
    from rtts.engines.checkpoint import is_random_checkpoint
    from rtts.engines.weights import (
        HF_REPO,
        has_assets,
        hf_cache_dir,
        hf_cached_snapshot,
        hub_endpoint,
        local_weights_dir,
    )

    local = local_weights_dir()
    if has_assets(local):
        kind = "random" if is_random_checkpoint(local) else "real"
        print(f"ok  weights: {local} ({kind}; `rtts serve` loads these)")
        return
    print(f"--  weights: nothing in {local}")
    cached = hf_cached_snapshot()
    if cached is not None:
        print(f"ok  weights: {HF_REPO}@{cached.revision} in the Hugging Face cache "
              f"{cached.path} (`rtts serve` loads these)")
        return
    print(f"--  weights: no {HF_REPO} snapshot in the Hugging Face cache {hf_cache_dir()}")
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        print("--  weights: HF_HUB_OFFLINE is set: no download")
    else:
        print(f"--  weights: `rtts serve` will try to download {HF_REPO} from "
              f"{hub_endpoint()} (~1.1 GB), else use the random checkpoint")
    print(f"--  weights: random fallback: {default_model_dir()} (speaks noise)")


def run_doctor(fix: bool = False) -> int:
    problems = 0
    for name in ("torch", "ChatTTS", "websockets", "numpy", "orjson", "soundfile", "psutil",
                 "soxr"):
        ok = importlib.util.find_spec(name) is not None
        print(f"{'ok ' if ok else 'MISSING'} {name}")
        problems += not ok
    if importlib.util.find_spec("torch") is None:
        return 1
    bad = cuda_linked_torchaudio_libs()
    for so in bad:
        if fix:
            so.rename(so.with_name(so.name + ".cuda-disabled"))
            print(f"fixed  moved aside CUDA-linked {so}")
        else:
            print(f"PROBLEM CUDA-linked {so} (run `rtts doctor --fix`)")
            problems += 1
    try:
        import torchaudio  # noqa: F401

        print("ok  import torchaudio")
    except OSError as exc:
        print(f"PROBLEM import torchaudio: {exc}")
        problems += 1
    if importlib.util.find_spec("ChatTTS") is not None:
        try:
            import ChatTTS  # noqa: F401

            print("ok  import ChatTTS")
        except Exception as exc:  # report any import failure, that is the point here
            print(f"PROBLEM import ChatTTS: {type(exc).__name__}: {exc}")
            problems += 1
    report_weights()
    print("all good" if not problems else f"{problems} problem(s)")
    return 0 if not problems else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run_doctor("--fix" in sys.argv))
