#!/usr/bin/env bash
# Dask's own array test suite as eugo's contract: run the installed Dask's dask/array/tests
# plain, then with eugo forced on (emulated device, h200 profile, min-speedup 0), then again at
# the default min-speedup over the linalg, reductions and routines modules, and print every test
# whose outcome or warnings differ. Differences are allowed only where listed, with a reason, in
# conformance/allowed-differences.txt; anything else fails (exit 1).
#
#   scripts/conformance.sh            # the whole suite (about 6 min on 2 cores)
#   scripts/conformance.sh --subset   # CI's representative subset
#   CONFORMANCE_OUT=dir scripts/conformance.sh   # keep the JSON reports in dir
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${CONFORMANCE_OUT:-$(mktemp -d)}
mkdir -p "$out"
allowed="$root/conformance/allowed-differences.txt"
modules=(--pyargs dask.array.tests)
default_modules=(--pyargs dask.array.tests.test_linalg dask.array.tests.test_reductions
                 dask.array.tests.test_routines)
if [ "${1:-}" = "--subset" ]; then
  modules=(--pyargs dask.array.tests.test_array_core dask.array.tests.test_linalg
           dask.array.tests.test_reductions dask.array.tests.test_creation
           dask.array.tests.test_optimization dask.array.tests.test_routines
           dask.array.tests.test_fft dask.array.tests.test_slicing dask.array.tests.test_overlap)
fi
workers=$(python -c 'import os; print(min(os.cpu_count() or 1, 4))')
tests=$(python -c 'import os, dask.array.tests as t; print(os.path.dirname(t.__file__))')
printf '[pytest]\n' > "$out/pytest.ini"   # neutral: none of this project's pytest settings
run() {  # run NAME EUGO MIN_SPEEDUP PYTEST_ARGS...
  local name=$1 mode=$2 speedup=$3
  shift 3
  echo "== $name" >&2
  # a neutral directory and config: Dask's tests, Dask's markers, nothing of ours but the plugin
  (cd "$out" && python -m pytest -c "$out/pytest.ini" --rootdir "$tests" -p eugo_dask.conformance \
     -p no:cacheprovider -q -n "$workers" -o xfail_strict=true --timeout=300 \
     --eugo="$mode" --eugo-min-speedup="$speedup" --eugo-report="$out/$name.json" \
     "$@" > "$out/$name.log" 2>&1) || true   # outcomes are compared below, not judged here
  tail -n 1 "$out/$name.log" >&2
}
run plain off 0 "${modules[@]}"
run eugo on 0 "${modules[@]}"
run eugo-default on 2 "${default_modules[@]}"
compare() {  # compare TITLE PLAIN EUGO [ARGS...]: differences found in parallel runs are run
             # again, one process, to tell order-dependent tests from real differences
  local title=$1 plain=$2 eugo=$3 name
  shift 3
  name=$(basename "$eugo" .json)
  echo "## $title"
  python -m eugo_dask.conformance "$plain" "$eugo" --allowed "$allowed" "$@" \
    --test-root "$tests/" --differing-out "$out/$name.differing" > /dev/null || true
  if [ -s "$out/$name.differing" ]; then
    local speedup=0
    [ "$name" = eugo-default ] && speedup=2
    (cd "$out" && python -m pytest -c "$out/pytest.ini" --rootdir "$tests" -p eugo_dask.conformance \
       -p no:cacheprovider -p no:xdist -q -o xfail_strict=true --timeout=300 --eugo=off \
       --eugo-report="$out/$name.plain-rerun.json" "@$out/$name.differing" > /dev/null 2>&1) || true
    (cd "$out" && python -m pytest -c "$out/pytest.ini" --rootdir "$tests" -p eugo_dask.conformance \
       -p no:cacheprovider -p no:xdist -q -o xfail_strict=true --timeout=300 --eugo=on \
       --eugo-min-speedup=$speedup --eugo-report="$out/$name.rerun.json" \
       "@$out/$name.differing" > /dev/null 2>&1) || true
    python -m eugo_dask.conformance "$plain" "$eugo" --allowed "$allowed" "$@" \
      --confirm "$out/$name.plain-rerun.json" "$out/$name.rerun.json"
  else
    python -m eugo_dask.conformance "$plain" "$eugo" --allowed "$allowed" "$@"
  fi
}
status=0
compare "min-speedup 0 over ${modules[*]:1}" "$out/plain.json" "$out/eugo.json" || status=1
compare "default min-speedup (2) over linalg, reductions, routines" "$out/plain.json" \
  "$out/eugo-default.json" --only-second || status=1
exit $status
