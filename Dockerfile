# Images the Helm chart runs (see docs/clusters.md). Build from the repository root:
#   docker build --target eugo-dask      -t ghcr.io/eugo/eugo-dask:0.1.0      .
#   docker build --target eugo-dask-cuda -t ghcr.io/eugo/eugo-dask:0.1.0-cuda .
# eugo-dask: CUDA runtime, CuPy, Dask + distributed, eugo-dask, Bokeh (dashboard) and
# prometheus-client (/metrics); runs the scheduler, CPU and GPU workers (`mode: worker`).
# eugo-dask-cuda: the same plus dask-cuda and RMM, for `mode: cuda-worker` groups.
# Versions come from docker/constraints.txt; both images run the same Dask.
FROM nvidia/cuda:12.6.3-runtime-ubuntu24.04 AS eugo-dask

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# The archive keeps only the newest build of each package: pinning versions here would break
# the build at the next security update; the base image's tag pins the distribution.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv tini \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

COPY docker/constraints.txt /etc/eugo-dask/constraints.txt
COPY pyproject.toml README.md /src/
COPY eugo_dask /src/eugo_dask
RUN pip install --constraint /etc/eugo-dask/constraints.txt '/src[gpu,dashboard]' && rm -rf /src

# Non-root user 1000 (the chart's runAsUser). Ubuntu 24.04 images already have user `ubuntu`
# with UID 1000 (tests/test_image.py runs this line against such an /etc/passwd).
RUN if getent passwd 1000 >/dev/null; then userdel --remove "$(id -nu 1000)"; fi \
 && groupadd --gid 1000 dask \
 && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/dask --shell /bin/bash dask
USER 1000:1000
WORKDIR /tmp
# the chart mounts a writable /tmp (read-only root filesystem)
ENV HOME=/tmp XDG_CACHE_HOME=/tmp/cache

# tini is PID 1: it reaps zombies and forwards signals to its child only, the nanny of
# `dask worker`, which then closes its worker (eugo's worker teardown runs). With -g the worker
# process got the SIGTERM too and died outright. The chart sets `args`, never `command`.
ENTRYPOINT ["tini", "--"]
CMD ["dask", "scheduler", "--preload", "eugo_dask.plugin"]

FROM eugo-dask AS eugo-dask-cuda
USER 0
RUN pip install --constraint /etc/eugo-dask/constraints.txt dask-cuda rmm-cu12
USER 1000:1000
