# One image for every role; compose.yaml picks the role by command (`python -m services.<role>`).
#
# Build arguments (compose.yaml passes them from the variables of the same name, JOYNEXUS_
# prefixed where noted there):
#   BASE_IMAGE       python:3.11-slim (CPU). Any Debian/Ubuntu image works: one without
#                    Python gets it from its packages, e.g. a CUDA runtime image
#                    nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 with TORCH_INDEX_URL .../cu128.
#   TORCH_SPEC       the torch requirement ("torch==2.13.0").
#   TORCH_INDEX_URL  where torch comes from (the PyTorch CPU index by default: PyPI's torch
#                    is the CUDA build, several GB).
#   WHEEL_DIR        a directory in the build context with a torch wheel for an offline build
#                    (deploy/wheels: used when it holds a torch-*.whl, else the index is).
#   CA_DIR           extra CA bundle(s) for pip behind a TLS-intercepting proxy (deploy/ca:
#                    its first *.crt/*.pem, if any, is pip's CA bundle during the build only).
# scripts/compose-images.sh builds this image with no registry reachable (a debootstrapped
# base, the local torch wheel, the host's CA bundle): see the README's compose section.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG WHEEL_DIR=deploy/wheels
ARG CA_DIR=deploy/ca

ENV PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH

# A base without Python (a CUDA runtime image, a bare Debian) takes it from its packages.
RUN if ! command -v python3 >/dev/null; then \
        apt-get update -q \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
            python3 python3-venv ca-certificates \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/venv

COPY ${CA_DIR} /tmp/build-ca/
COPY ${WHEEL_DIR} /tmp/wheels/
# torch first, from the local wheel or the configured index (its dependencies from PyPI).
RUN ca=$(ls /tmp/build-ca/*.crt /tmp/build-ca/*.pem 2>/dev/null | head -n 1 || true); \
    if [ -n "$ca" ]; then export PIP_CERT="$ca"; fi; \
    wheel=$(ls /tmp/wheels/torch-*.whl 2>/dev/null | head -n 1 || true); \
    if [ -n "$wheel" ]; then \
        echo "torch from $wheel"; pip install -q "$wheel"; \
    else \
        echo "torch from $TORCH_INDEX_URL"; \
        pip install -q "$TORCH_SPEC" --index-url "$TORCH_INDEX_URL" \
            --extra-index-url https://pypi.org/simple; \
    fi

WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas schemas
COPY bus bus
COPY vla vla
COPY services services
COPY clients clients
COPY bench bench
# The observability extra: Prometheus pages (--metrics-port) and OTLP span export.
RUN ca=$(ls /tmp/build-ca/*.crt /tmp/build-ca/*.pem 2>/dev/null | head -n 1 || true); \
    if [ -n "$ca" ]; then export PIP_CERT="$ca"; fi; \
    pip install -q ".[observability]" && python -c "import torch, services.trainer"

ENTRYPOINT ["python", "-m"]
