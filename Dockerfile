# One image for every service; compose.yaml picks the command. The base image brings a CUDA
# build of PyTorch (the project pins the CPU build for laptops/CI), so torch is not reinstalled.
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

# Non-root at run time; model weights come from a read-only volume at /models.
RUN useradd --create-home --uid 10001 cde
USER cde
