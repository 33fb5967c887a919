#!/usr/bin/env bash
# Download, on this (CPU) machine, the wheels scripts/gpu-check.sh installs on the GPU machine
# (Python 3.12, x86-64; it has NumPy, CuPy, pytest, pytest-timeout, click, PyYAML, toolz,
# cloudpickle, fsspec, msgpack, psutil, jinja2, sortedcontainers, packaging, urllib3,
# prometheus-client and matplotlib already): Dask, distributed and what they need beyond those.
# They go to .whl/ (git-ignored), about 4 MB; pass `.whl` in the device tool's `carry`.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
download() {
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$@"
}
download dask==2026.8.0 distributed==2026.8.0 partd locket tblib tornado zict
ls -1 .whl
