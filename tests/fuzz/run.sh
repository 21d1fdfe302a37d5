#!/usr/bin/env bash
# tests/fuzz/run.sh BUILD_DIR SECONDS [FUZZER...]: runs each libFuzzer target (all of them by
# default) for SECONDS on a copy of its seed corpus (tests/fuzz/corpus/NAME), two at a time;
# SECONDS 0 replays every input of the seed corpus once (what `scripts/run test` does).
# A crash, a leak, a sanitizer report or a hang (a single input over 20 s) fails the run; the
# input that did it is kept in BUILD_DIR/fuzz/NAME/ and named in the output.
set -uo pipefail
[[ $# -ge 2 ]] || { echo "usage: tests/fuzz/run.sh BUILD_DIR SECONDS [FUZZER...]" >&2; exit 2; }
build=$(cd "$1" && pwd)
seconds=$2
shift 2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
fuzzers=("$@")
if [[ ${#fuzzers[@]} -eq 0 ]]; then
  for f in "$build"/bin/fuzz_*; do fuzzers+=("$(basename "$f")"); done
fi
[[ ${#fuzzers[@]} -gt 0 && -x $build/bin/${fuzzers[0]} ]] ||
  { echo "fuzz: no fuzzers in $build/bin (build the asan preset's 'fuzzers' target)" >&2; exit 2; }
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export LSAN_OPTIONS=suppressions=$here/../lsan-suppressions.txt:print_suppressions=0
export HWLOC_COMPONENTS=-pci

run_one() {
  local name=$1 work=$build/fuzz/$1
  rm -rf "$work" && mkdir -p "$work/corpus" "$work/artifacts"
  [[ -d $here/corpus/$name ]] && cp "$here/corpus/$name"/* "$work/corpus/" 2>/dev/null
  local budget=(-max_total_time="$seconds")
  [[ $seconds == 0 ]] && budget=(-runs=0)
  "$build/bin/$name" "${budget[@]}" -timeout=20 -rss_limit_mb=4096 \
    -max_len=65536 -print_final_stats=1 -artifact_prefix="$work/artifacts/" "$work/corpus" \
    >"$work/log" 2>&1
  local rc=$?
  local execs
  execs=$(grep -Eo 'stat::number_of_executed_units: *[0-9]+' "$work/log" | grep -Eo '[0-9]+$')
  if [[ $rc -eq 0 && $seconds == 0 ]]; then
    echo "fuzz: $name replayed its $(ls "$work/corpus" | wc -l) seed inputs, no crash"
  elif [[ $rc -eq 0 ]]; then
    echo "fuzz: $name ran ${seconds}s, ${execs:-?} inputs, no crash"
  else
    echo "fuzz: $name FAILED (exit $rc); inputs that failed: $(ls "$work/artifacts" | tr '\n' ' ')"
    grep -E "ERROR|SUMMARY|runtime error|Test unit written|deadly signal" "$work/log" | head -20
    return 1
  fi
}

failed=0
pids=()
names=()
for name in "${fuzzers[@]}"; do
  run_one "$name" &
  pids+=($!)
  names+=("$name")
  if [[ ${#pids[@]} -ge 2 ]]; then
    wait "${pids[0]}" || failed=1
    pids=("${pids[@]:1}")
  fi
done
for p in "${pids[@]}"; do wait "$p" || failed=1; done
exit "$failed"
