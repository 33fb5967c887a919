#!/usr/bin/env bash
# The GPU check, run once on a machine with a CUDA device (the device tool), from the repo root:
#   scripts/gpu-check.sh [OUTDIR]        (default: $OUT, else ./gpu-check-out)
# Installs the wheels carried in .whl/ (scripts/fetch-gpu-wheels.sh), then: pytest -m gpu, a full
# `eugo-dask calibrate`, the prediction-accuracy, seed-table and mixed-pipeline benchmarks.
# Everything it measures lands in OUTDIR (8 files). Each step has its own time limit and a failing
# step does not stop the others; the exit status says whether any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu-check-out}}
mkdir -p "$out"
status=0
step() {  # step NAME SECONDS COMMAND... : output to $out/NAME
  local name=$1 limit=$2
  shift 2
  echo "== $name" >&2
  timeout "$limit" "$@" > "$out/$name" 2>&1 || { echo "   $name failed ($?)" >&2; status=1; }
}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/eugo-site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/eugo-site:$PWD" PYTHONUNBUFFERED=1
step nvidia-smi.txt 30 nvidia-smi
step pytest-gpu.txt 240 python3 -m pytest -m gpu tests/test_gpu.py -p no:cacheprovider -q -rs
step calibrate.txt 180 python3 -m eugo_dask.cli calibrate -o "$out/h200-calibrated.yaml"
profile="$out/h200-calibrated.yaml"
[ -s "$profile" ] || profile=h200
step accuracy.txt 120 python3 benchmarks/prediction_accuracy.py --profile "$profile"
step seed_table.txt 300 python3 benchmarks/seed_table.py --profile "$profile" --plot "$out/seed_table.png"
step mixed_pipelines.txt 180 python3 benchmarks/mixed_pipelines.py --profile "$profile"
ls -l "$out" >&2
exit $status
