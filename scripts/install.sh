#!/usr/bin/env bash
# Create .venv and install rtts with the ChatTTS engine and test tools. Idempotent.
#   PYTHON=python3.11 scripts/install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -U pip
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[chattts,redis,test]'
# torchaudio's CUDA-linked extension libraries cannot load beside a CPU torch; ChatTTS only
# needs its pure-Python parts. `rtts doctor --fix` moves them aside (only when torch has no CUDA).
.venv/bin/rtts doctor --fix
