#!/usr/bin/env bash
# The GPU benchmark, prepared to run in one go on a CUDA machine that has python3 with a
# CUDA torch but no network (e.g. the project's lent H200).
#
#   scripts/gpu-bench.sh prepare     # here, with pip's network: wheels into .whl/
#   scripts/gpu-bench.sh run OUTDIR  # there: installs .whl/, makes the full random
#                                    # checkpoint, runs the benches (< 12 min)
#
# `prepare` downloads what ChatTTS and rtts need beyond torch/transformers/numpy as
# CPython 3.12 manylinux wheels (the GPU image's python), building ChatTTS's sdist into
# a wheel. `run` installs them into /tmp/site (no deps resolution, no network) and writes
# JSON results into OUTDIR.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
PYV=${GPU_PYTHON_VERSION:-3.12}
WHEELS=(chattts==0.2.5 vocos==0.1.0 encodec==0.1.1 vector-quantize-pytorch einx einops
        pybase16384 websockets orjson soundfile soxr psutil frozendict
        starlette uvicorn av num2words docopt cn2an proces)
case "$mode" in
  prepare)
    mkdir -p .whl
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
    for w in "${WHEELS[@]}"; do
      # a wheel for CPython $PYV, else a pure-python one, else build one from the sdist
      # (chattts and encodec publish only sdists; both are pure Python)
      python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" \
          --implementation cp "${plat[@]}" -d .whl "$w" 2>/dev/null ||
        python3 -m pip download -q --no-deps --only-binary=:all: -d .whl "$w" 2>/dev/null ||
        python3 -m pip wheel -q --no-deps -w .whl "$w"
    done
    python3 -m pip wheel -q --no-deps -w .whl .   # rtts itself
    ls -la .whl
    ;;
  run)
    out=${2:-${OUT:-/tmp/rtts-gpu}}
    mkdir -p "$out"
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
    python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
    ck=/tmp/ck-full
    [ -d $ck ] || python3 -m rtts model make-random --size full $ck
    r() { timeout "$1" python3 -m rtts --log-level WARNING bench "${@:2}" 2>&1 | tail -40; }
    # 1. GPT step time per batch size and weight precision (kernels are plain per dtype)
    r 120 kernels --model-dir $ck --device cuda --dtypes fp32,bf16 --rows 1,4,8,16 \
        --json "$out/kernels.json"
    # 2. Throughput and first audio vs serialized stock ChatTTS
    r 180 chattts --model-dir $ck --device cuda --streams 8 --tokens 128 --repeat 1 \
        --json "$out/chattts.json"
    # 3. Staggered arrivals: continuous vs static batching
    r 150 staggered --model-dir $ck --device cuda --arrivals 8 --gap 0.5 --slots 16 \
        --tokens 128 --json "$out/staggered.json"
    # 4. What a listener hears: N paced players, rtts vs stock ChatTTS (~2 min)
    r 240 realtime --model-dir $ck --device cuda --streams 1,4,8,16 --dtypes auto,bf16 \
        --stock-max-streams 1 --json "$out/realtime.json"
    ;;
  *)
    echo "usage: $0 prepare | run [OUTDIR]" >&2; exit 2 ;;
esac
