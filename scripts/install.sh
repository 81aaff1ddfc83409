#!/usr/bin/env bash
# Create .venv and install rtts with the ChatTTS engine and test tools. Idempotent.
#   PYTHON=python3.11 scripts/install.sh
#   RTTS_TORCH=cpu|cuda|skip scripts/install.sh     # force a torch build (default: auto)
# torch comes first, from the index scripts/select_torch.py picks for this machine (the
# CPU build without an NVIDIA GPU, a CUDA build with one; see that script). The rest is
# installed with constraints.txt, which pins torch's version, so pip keeps that build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP=(.venv/bin/python -m pip --disable-pip-version-check)
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
"${PIP[@]}" install -q -U pip
.venv/bin/python scripts/select_torch.py --install
"${PIP[@]}" install -q -c constraints.txt -e '.[chattts,redis,test,docs]'
# torchaudio's CUDA-linked extension libraries cannot load beside a CPU torch; ChatTTS only
# needs its pure-Python parts. `rtts doctor --fix` moves them aside (only when torch has no CUDA).
.venv/bin/rtts doctor --fix
