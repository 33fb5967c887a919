#!/usr/bin/env bash
# Dask's own array test suite, and distributed's tests that drive dask.array through a cluster,
# as eugo's contract: run each plain, then with eugo forced on (emulated device, h200 profile,
# min-speedup 0), Dask's again at the default min-speedup over the linalg, reductions and
# routines modules, and print every test whose outcome or warnings differ. Differences are
# allowed only where listed, with a reason, in conformance/allowed-differences.txt (Dask's) and
# conformance/allowed-differences-distributed.txt; anything else fails (exit 1).
#
# Dask's suite: the installed Dask's dask/array/tests. distributed's: its wheel has no tests, so
# they are vendored under conformance/distributed/ (the revision and why: its README.md):
# shuffle/tests/test_rechunk.py whole, and of tests/test_client.py the tests whose function
# source names dask.array (--eugo-select test_client.py:dask.array). With eugo on, every cluster
# they start is heterogeneous: eugo's scheduler plugin preloaded, the first worker to register
# advertising the GPU resource, the others none (eugo_dask/conformance.py).
#
#   scripts/conformance.sh                 # both suites (about 6 + 9 min on 2 cores)
#   scripts/conformance.sh --subset        # CI's representative subset of Dask's, and distributed's
#   scripts/conformance.sh --dask          # Dask's suite only (with --subset: its subset)
#   scripts/conformance.sh --distributed   # distributed's tests only
#   scripts/conformance.sh --expressions   # Dask's suite in array-expression mode (with --subset:
#                                          # its subset), plain against eugo at min-speedup 0
#   CONFORMANCE_OUT=dir scripts/conformance.sh   # keep the JSON reports and logs in dir
#
# --expressions sets DASK_ARRAY__QUERY_PLANNING=True for every run: Dask reads
# array.query-planning once, when dask.array is first imported, so it must be in the environment
# before pytest starts. Its suite adds dask/array/_array_expr/tests; its differences are allowed
# only where listed in conformance/allowed-differences-expressions.txt.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${CONFORMANCE_OUT:-$(mktemp -d)}
mkdir -p "$out"
subset=0 dask=1 distributed=1 expressions=0
for arg in "$@"; do
  case $arg in
    --subset) subset=1 ;;
    --dask) distributed=0 ;;
    --distributed) dask=0 ;;
    --expressions) expressions=1 distributed=0 ;;
    *) echo "usage: $0 [--subset] [--dask | --distributed | --expressions]" >&2; exit 2 ;;
  esac
done
if [ $expressions = 1 ] && [ $dask = 0 ]; then
  echo "$0: --expressions runs Dask's suite; it does not go with --distributed" >&2; exit 2
fi
modules=(--pyargs dask.array.tests)
default_modules=(--pyargs dask.array.tests.test_linalg dask.array.tests.test_reductions
                 dask.array.tests.test_routines)
if [ $subset = 1 ]; then
  modules=(--pyargs dask.array.tests.test_array_core dask.array.tests.test_linalg
           dask.array.tests.test_reductions dask.array.tests.test_creation
           dask.array.tests.test_optimization dask.array.tests.test_routines
           dask.array.tests.test_fft dask.array.tests.test_slicing dask.array.tests.test_overlap)
fi
if [ $expressions = 1 ]; then
  export DASK_ARRAY__QUERY_PLANNING=True
  modules+=(dask.array._array_expr.tests)
fi
workers=$(python -c 'import os; print(min(os.cpu_count() or 1, 4))')
printf '[pytest]\n' > "$out/pytest.ini"   # neutral: none of this project's pytest settings
# the suite being run: its pytest options, its allowed differences, the root of its node ids
suite=() allowed= test_root=
pytest_run() {  # pytest_run PYTEST_ARGS...: a neutral directory and config; the suite's options
  (cd "$out" && python -m pytest -c "$out/pytest.ini" -p eugo_dask.conformance -p no:cacheprovider \
     -q --timeout=300 "${suite[@]}" "$@")
}
run() {  # run NAME EUGO MIN_SPEEDUP PYTEST_ARGS...
  local name=$1 mode=$2 speedup=$3
  shift 3
  echo "== $name" >&2
  # outcomes are compared below, not judged here
  pytest_run -n "$workers" --eugo="$mode" --eugo-min-speedup="$speedup" \
    --eugo-report="$out/$name.json" "$@" > "$out/$name.log" 2>&1 || true
  tail -n 1 "$out/$name.log" >&2
}
compare() {  # compare TITLE PLAIN EUGO [ARGS...]: differences found in parallel runs are run
             # again, one process, to tell order-dependent tests from real differences
  local title=$1 plain=$2 eugo=$3 name speedup
  shift 3
  name=$(basename "$eugo" .json)
  speedup=$(python -c 'import json, sys; print(json.load(open(sys.argv[1]))["min_speedup"])' "$eugo")
  echo "## $title"
  python -m eugo_dask.conformance "$plain" "$eugo" --allowed "$allowed" "$@" \
    --test-root "$test_root/" --differing-out "$out/$name.differing" > /dev/null || true
  if [ -s "$out/$name.differing" ]; then
    pytest_run -p no:xdist --eugo=off --eugo-report="$out/$name.plain-rerun.json" \
      "@$out/$name.differing" > "$out/$name.plain-rerun.log" 2>&1 || true
    pytest_run -p no:xdist --eugo=on --eugo-min-speedup="$speedup" \
      --eugo-report="$out/$name.rerun.json" "@$out/$name.differing" > "$out/$name.rerun.log" 2>&1 || true
    python -m eugo_dask.conformance "$plain" "$eugo" --allowed "$allowed" "$@" \
      --confirm "$out/$name.plain-rerun.json" "$out/$name.rerun.json"
  else
    python -m eugo_dask.conformance "$plain" "$eugo" --allowed "$allowed" "$@"
  fi
}
status=0
if [ $dask = 1 ]; then
  test_root=$(python -c 'import os, dask.array.tests as t; print(os.path.dirname(t.__file__))')
  suite=(--rootdir "$test_root" -o xfail_strict=true)   # Dask's pyproject sets xfail_strict
  if [ $expressions = 1 ]; then
    allowed="$root/conformance/allowed-differences-expressions.txt"
    run plain off 0 "${modules[@]}"
    run eugo on 0 "${modules[@]}"
    compare "array expressions, min-speedup 0 over ${modules[*]:1}" "$out/plain.json" \
      "$out/eugo.json" || status=1
  else
    allowed="$root/conformance/allowed-differences.txt"
    run plain off 0 "${modules[@]}"
    run eugo on 0 "${modules[@]}"
    run eugo-default on 2 "${default_modules[@]}"
    compare "min-speedup 0 over ${modules[*]:1}" "$out/plain.json" "$out/eugo.json" || status=1
    compare "default min-speedup (2) over linalg, reductions, routines" "$out/plain.json" \
      "$out/eugo-default.json" --only-second || status=1
  fi
fi
if [ $distributed = 1 ]; then
  test_root="$root/conformance/distributed"
  # --runslow: distributed's CI runs its slow tests (its pixi.toml's test-ci task)
  suite=(--rootdir "$test_root" --eugo-distributed="$test_root" --eugo-select test_client.py:dask.array
         --runslow)
  allowed="$root/conformance/allowed-differences-distributed.txt"
  tests=("$test_root/distributed/shuffle/tests/test_rechunk.py"
         "$test_root/distributed/tests/test_client.py")
  run distributed-plain off 0 "${tests[@]}"
  run distributed-eugo on 0 "${tests[@]}"
  compare "distributed's test_rechunk.py and test_client.py's dask.array tests, heterogeneous clusters, min-speedup 0" \
    "$out/distributed-plain.json" "$out/distributed-eugo.json" || status=1
fi
exit $status
