# MaskServe image: every role of the stack (`maskserve api | dispatcher | cpu-worker | worker`) runs
# from it; docker-compose.yml starts one container per role, each with its own data volume.
FROM python:3.11-slim

# CPU wheels by default (the tiny default model, the CPU workers). The GPU worker's image is built
# with TORCH_INDEX_URL set to a CUDA wheel index (docker-compose.yml, profile `gpu`).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MASKSERVE_DATA_DIR=/data \
    MASKSERVE_PROFILES_DIR=/app/profiles

RUN useradd --create-home --uid 1000 maskserve && mkdir /data && chown maskserve /data
WORKDIR /app

# torch first, pinned as the Makefile pins it (its own layer: the rest changes far more often);
# an unpinned torch would pull whatever build is newest.
RUN pip install --index-url "$TORCH_INDEX_URL" "torch==2.13.0"

COPY pyproject.toml README.md ./
COPY backend backend
COPY studio studio
COPY templates_store templates_store
COPY profiles profiles
RUN pip install .

USER maskserve
VOLUME /data
EXPOSE 8000
CMD ["maskserve", "api"]
