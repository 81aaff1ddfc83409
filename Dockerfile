# CPU image (default):
#   docker build -t rtts .
#   docker run -p 8765:8765 rtts                                  # embedded tiny random checkpoint
#   docker run -p 8765:8765 -v /models/chattts:/models rtts \
#       serve --host 0.0.0.0 --source custom --model-dir /models  # real weights, local copy
#
# CUDA variant: build FROM an image with CUDA-enabled torch and skip the CPU pin, e.g.
#   docker build --build-arg BASE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime \
#                --build-arg TORCH_CONSTRAINT= -t rtts:cuda .
#   docker run --gpus all -p 8765:8765 rtts:cuda serve --host 0.0.0.0 --device cuda
# With CUDA torch, torchaudio's CUDA libraries load normally and `rtts doctor --fix`
# leaves them alone.
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}

ARG TORCH_CONSTRAINT="torch==2.13.0"
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 RTTS_HOME=/var/lib/rtts

WORKDIR /app
COPY pyproject.toml setup.py MANIFEST.in README.md constraints.txt ./
COPY rtts ./rtts
COPY web ./web

RUN if [ -n "$TORCH_CONSTRAINT" ]; then echo "$TORCH_CONSTRAINT" > /tmp/c.txt; \
      pip install --no-cache-dir -c /tmp/c.txt --extra-index-url https://download.pytorch.org/whl/cpu ".[chattts,redis]"; \
    else pip install --no-cache-dir ".[chattts,redis]"; fi \
 && rtts doctor --fix \
 && rtts model make-random --size tiny /var/lib/rtts/random-tiny \
 && useradd --system --home /var/lib/rtts rtts && chown -R rtts /var/lib/rtts

USER rtts
EXPOSE 8765
HEALTHCHECK --interval=10s --timeout=3s CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8765/readyz').status != 200)"
ENTRYPOINT ["rtts"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8765"]
