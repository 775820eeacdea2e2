# vt on an NVIDIA GPU (CUDA 12, CuPy). Build: docker build -t vt .
# Run:   docker run --gpus all -v /path/to/model:/models -p 8000:8000 vt [more vt serve flags]

FROM nvidia/cuda:12.6.3-runtime-ubuntu24.04 AS base
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-pip python3-venv \
 && rm -rf /var/lib/apt/lists/*

# Build stage: a virtual environment (Ubuntu 24.04's system Python is externally managed).
FROM base AS build
RUN python3 -m venv /opt/vt
ENV PATH=/opt/vt/bin:$PATH
WORKDIR /src
# Dependencies first, against a placeholder package (it holds the version pyproject reads), so
# code changes do not reinstall them.
COPY pyproject.toml README.md ./
RUN mkdir vt && echo '__version__ = "0"' > vt/__init__.py && pip install '.[cuda12,kv-events]'
COPY vt ./vt
RUN pip install --no-deps --force-reinstall . && rm -rf build *.egg-info

# Runtime stage: the environment only, no sources, run as an unprivileged user.
FROM base
COPY --from=build /opt/vt /opt/vt
ENV PATH=/opt/vt/bin:$PATH
RUN useradd --create-home --uid 10001 --user-group vt && mkdir -p /models && chown vt:vt /models
USER vt
WORKDIR /home/vt
VOLUME /models
EXPOSE 8000
# Loading a large checkpoint takes a while: give it a generous start period before failures count.
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python3", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status == 200 else 1)"]
ENTRYPOINT ["vt", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["--model", "/models"]
