# vt on an NVIDIA GPU (CUDA 12, CuPy). Build: docker build -t vt .
# Run:   docker run --gpus all -v /path/to/checkpoint:/models -p 8000:8000 vt [MODEL] [more vt serve flags]
# The entrypoint is `vt serve`, as in vLLM's image: the model comes as the first argument or --model;
# with neither, the checkpoint mounted at /models is served (VT_MODEL_VOLUME below).

# Any Debian or Ubuntu image with apt-get may stand in for the CUDA base (CI builds on a Debian rootfs
# and serves on the CPU); the CUDA runtime image is what a GPU needs.
ARG BASE_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu24.04
FROM ${BASE_IMAGE} AS base
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-pip python3-venv \
 && rm -rf /var/lib/apt/lists/*

# Dependencies stage: a virtual environment (Ubuntu 24.04's system Python is externally managed),
# installed against a placeholder package (it holds the version pyproject reads) and then emptied of
# it, so that code changes neither reinstall the dependencies nor change their layer.
FROM base AS deps
RUN python3 -m venv /opt/vt
ENV PATH=/opt/vt/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
RUN mkdir vt && echo '__version__ = "0"' > vt/__init__.py && pip install '.[cuda12,kv-events]' \
 && pip uninstall -y vt-serve && rm -rf build vt *.egg-info

# The package as a wheel.
FROM deps AS wheel
COPY vt ./vt
RUN pip wheel --no-deps --wheel-dir /wheels .

# Runtime stage: the environment and the wheel, no sources, run as an unprivileged user. A code
# change rebuilds (and pushes) a layer of a few MB; the dependencies' layer stays as it was.
FROM base
# VT_MODEL_VOLUME: where `vt serve` looks when no model is named (a checkpoint there is served; an
# empty folder falls back to the demo model, with a warning).
ENV PATH=/opt/vt/bin:$PATH \
    VT_MODEL_VOLUME=/models
RUN useradd --create-home --uid 10001 --user-group vt && mkdir -p /models && chown vt:vt /models
COPY --from=deps /opt/vt /opt/vt
COPY --from=wheel /wheels /tmp/wheels
RUN pip install --no-deps /tmp/wheels/*.whl && rm -rf /tmp/wheels
USER vt
WORKDIR /home/vt
VOLUME /models
EXPOSE 8000
# Loading a large checkpoint takes a while: give it a generous start period before failures count.
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python3", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status == 200 else 1)"]
# No CMD: whatever follows the image name in `docker run` is appended to `vt serve` as it stands.
ENTRYPOINT ["vt", "serve", "--host", "0.0.0.0", "--port", "8000"]
