# The image the Helm chart runs by default: CUDA runtime, CuPy, Dask + distributed, eugo-dask,
# Bokeh (dashboard) and prometheus-client (/metrics). Build from the repository root:
#   docker build -t ghcr.io/eugo/eugo-dask:0.1.0 .
# For `gpuWorkers.mode: cuda-worker`, add dask-cuda (pip install dask-cuda).
FROM nvidia/cuda:12.6.3-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv tini \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

COPY pyproject.toml README.md /src/
COPY eugo_dask /src/eugo_dask
RUN pip install '/src[gpu,dashboard]' && rm -rf /src

# non-root, matching the chart's runAsUser; the chart mounts a writable /tmp (read-only root)
RUN useradd --uid 1000 --create-home --home-dir /home/dask dask
USER 1000:1000
WORKDIR /tmp
ENV HOME=/tmp XDG_CACHE_HOME=/tmp/cache

ENTRYPOINT ["tini", "--"]
CMD ["dask", "scheduler", "--preload", "eugo_dask.plugin"]
