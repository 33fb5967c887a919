#!/usr/bin/env bash
# The GPU check, run once on a machine with a CUDA device (the device tool), from the repo root:
#   scripts/gpu-check.sh [OUTDIR]        (default: $OUT, else ./gpu-check-out)
#
# Fits one 600 s command with room to spare: every step has its own time limit, the steps
# together stop at GPU_CHECK_BUDGET seconds (default 420; a step that would pass it is skipped
# and says so), and each step's output lands in OUTDIR as soon as it finishes, so a kill leaves
# what was measured. On a bare Python 3.12 + NumPy + CuPy + pytest machine it first installs the
# wheels carried in .whl/ (scripts/fetch-gpu-wheels.sh). Without a CUDA device every GPU step
# says why it is skipped and the script goes on (a dry run; the distributed step then runs on the
# emulated device).
#
# OUTDIR gets at most 6 files (the device tool brings back 8):
#   gpu-check.log   every step's output, appended as it runs
#   results.jsonl   one JSON record per step (status, seconds, figures)
#   summary.txt     one line per step: name, status, seconds, limit
#   calibrated.yaml the quick calibration's profile (what the seed table prices with; its
#                   link.copies_by_size: each copy path's rate by size, the best chosen)
#   seed_table.png  the seed's six workloads, plotted
#   dual-cupy.json  run-time dispatch on the device (scripts/dual_check.py)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu-check-out}}
mkdir -p "$out"
log="$out/gpu-check.log"
results="$out/results.jsonl"
summary="$out/summary.txt"
budget=${GPU_CHECK_BUDGET:-420}
: > "$log"; : > "$results"; : > "$summary"
export PYTHONUNBUFFERED=1
started=$SECONDS
status=0

record() {  # record NAME STATUS SECONDS LIMIT [NOTE]
  printf '%-14s %-8s %6ss  (limit %ss) %s\n' "$1" "$2" "$3" "$4" "${5:-}" | tee -a "$summary" >&2
}

step() {  # step NAME LIMIT COMMAND... : output appended to the log, a summary line, a JSON record
  local name=$1 limit=$2 rc t0 left
  shift 2
  left=$((budget - (SECONDS - started)))
  if (( left < 10 )); then
    record "$name" skipped 0 "$limit" "over the check's budget of ${budget}s"
    printf '{"check": "%s", "status": "skipped", "reason": "over budget"}\n' "$name" >> "$results"
    return
  fi
  (( limit > left )) && limit=$left
  echo "== $name (limit ${limit}s, $((SECONDS - started))s elapsed)" | tee -a "$log" >&2
  t0=$SECONDS
  timeout --signal=TERM --kill-after=5 "$limit" "$@" >> "$log" 2>&1
  rc=$?
  local took=$((SECONDS - t0)) state=ok
  if (( rc == 124 || rc == 137 )); then state=timeout; status=1
  elif (( rc != 0 )); then state="failed($rc)"; status=1; fi
  record "$name" "$state" "$took" "$limit"
  # the Python checks write their own record; the others get one here
  if ! grep -q "\"check\": \"$name\"" "$results" 2>/dev/null; then
    printf '{"check": "%s", "status": "%s", "seconds": %s}\n' "$name" "$state" "$took" >> "$results"
  fi
}

step install 60 bash -c '
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/eugo-site .whl/*.whl && ls .whl
  else
    echo "no .whl/ here: using what is installed (scripts/fetch-gpu-wheels.sh fetches the wheels)"
  fi'
export PYTHONPATH="/tmp/eugo-site:$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
checks="python3 scripts/device_check.py"

step env 20 bash -c 'nvidia-smi || echo "nvidia-smi: not here"; python3 scripts/device_check.py env --json "$1"' \
  _ "$results"
step copies 45 $checks copies --json "$results"
step engine 70 $checks engine --json "$results"
step timing 25 $checks timing --json "$results"
step waits 20 $checks waits --json "$results"
step pytest-gpu 150 python3 -m pytest -m gpu tests/test_gpu.py -p no:cacheprovider -q -rs
step memory 50 $checks memory --seconds 18 --json "$results"
step threads 20 $checks threads --json "$results"
step throughput 70 $checks throughput --json "$results"
step distributed 50 $checks distributed --json "$results"
# the quick calibration measures every copy path at 1-256 MiB each way and keeps the best per
# size (link.copies_by_size); paths then copies 1 MiB-1 GiB with that profile in force: the
# path chosen and the path taken at each size, against raw pinned DMA
step calibrate 70 python3 -m eugo_dask.cli calibrate --quick -o "$out/calibrated.yaml"
step paths 40 $checks paths --profile "$out/calibrated.yaml" --json "$results"
profile=h200
[ -s "$out/calibrated.yaml" ] && profile="$(realpath "$out/calibrated.yaml")"
step seed-table 80 bash -c 'cd benchmarks && python3 seed_table.py --medium --profile "$1" --plot "$2"' \
  _ "$profile" "$(realpath "$out")/seed_table.png"
# last: run-time dispatch (eugo.dispatch: dual) on the device; writes dual-cupy.json
step dual 60 env OUT="$(realpath "$out")" python3 scripts/dual_check.py cupy

echo "total $((SECONDS - started))s of a ${budget}s budget" | tee -a "$summary" >&2
ls -l "$out" >&2
exit $status
