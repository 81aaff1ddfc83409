# CPU image (default):
#   docker build -t rtts .
#   docker run -p 8765:8765 -e RTTS_API_KEYS=KEY rtts          # embedded tiny random checkpoint
#   docker run -p 8765:8765 -v /models/chattts:/models rtts \
#       serve --host 0.0.0.0 --source custom --model-dir /models  # real weights, local copy
#
# Offline (no package index, no registry: what tests/test_container.py does), from a local
# base image with python3 and python3-venv and a folder of wheels inside the build context:
#   docker build --build-arg BASE=rtts-base:local --build-arg WHEELS=.wheels -t rtts .
# WHEELS names a folder of the build context holding every wheel `.[chattts,redis]` needs
# (the CPU torch included); pip then installs from it alone (--no-index).
#
# CUDA variant: build FROM an image with CUDA-enabled torch and skip the CPU pin, e.g.
#   docker build --build-arg BASE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime \
#                --build-arg TORCH_CONSTRAINT= -t rtts:cuda .
#   docker run --gpus all -p 8765:8765 rtts:cuda serve --host 0.0.0.0 --device cuda
# With CUDA torch, torchaudio's CUDA libraries load normally and `rtts doctor --fix`
# leaves them alone.
#
# Two stages: the first installs rtts into a virtual environment (/opt/rtts) and makes the
# tiny checkpoint; the second is the base image plus that environment, that checkpoint
# and a system user. No compiler, no pip cache, no wheels and no sources are left in it.
ARG BASE=python:3.11-slim-bookworm

FROM ${BASE} AS build
ARG TORCH_CONSTRAINT="torch==2.13.0"
ARG WHEELS=""
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 RTTS_HOME=/var/lib/rtts
WORKDIR /src
COPY pyproject.toml setup.py MANIFEST.in README.md constraints.txt ./
COPY rtts ./rtts
COPY web ./web
# The wheel folder when WHEELS names one; otherwise a harmless copy of constraints.txt.
COPY ${WHEELS:-constraints.txt} /wheels/
RUN python3 -m venv /opt/rtts \
 && if [ -n "$TORCH_CONSTRAINT" ]; then echo "$TORCH_CONSTRAINT" > /tmp/c.txt; else : > /tmp/c.txt; fi \
 && if [ -n "$WHEELS" ]; then \
      set -- --no-index --find-links /wheels; \
    elif [ -n "$TORCH_CONSTRAINT" ]; then \
      set -- --extra-index-url https://download.pytorch.org/whl/cpu; \
    else set --; fi \
 && /opt/rtts/bin/pip install "$@" -c /tmp/c.txt -c constraints.txt \
      "/src[chattts,redis]" \
 && /opt/rtts/bin/pip uninstall -y pip \
 && /opt/rtts/bin/rtts doctor --fix \
 && /opt/rtts/bin/rtts model make-random --size tiny /var/lib/rtts/random-tiny
# test suites and test binaries (torch/test alone is 80 MB); the jobs folder (compose mounts a
# shared volume there, which takes this folder's owner)
RUN find /opt/rtts -path '*/site-packages/*' \( -name tests -o -path '*/torch/test' \) -type d \
      -prune -exec rm -rf {} + \
 && mkdir -p /var/lib/rtts/jobs

FROM ${BASE}
ENV PYTHONUNBUFFERED=1 RTTS_HOME=/var/lib/rtts \
    PATH=/opt/rtts/bin:$PATH
RUN useradd --system --home-dir /var/lib/rtts --no-create-home --shell /usr/sbin/nologin rtts
COPY --from=build /opt/rtts /opt/rtts
COPY --from=build --chown=rtts:rtts /var/lib/rtts /var/lib/rtts
USER rtts
WORKDIR /var/lib/rtts
EXPOSE 8765
# `docker stop` sends SIGTERM: rtts drains (answers 503 to new work, lets contexts in flight
# finish for --shutdown-grace seconds, default 10) and exits 0; give it `-t 30`.
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=5s --timeout=3s --start-period=120s --retries=3 \
  CMD ["python3", "-c", "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8765/readyz', timeout=2).status != 200)"]
ENTRYPOINT ["rtts"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8765"]
