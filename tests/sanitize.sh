#!/usr/bin/env bash
# The runtime's, the collectives' and the KV engine's tests built with AddressSanitizer + UndefinedBehaviorSanitizer
# (leak checking on) in a side build tree, then run. Called by ctest (sanitizer.asan-ubsan).
#
#   tests/sanitize.sh SOURCE_DIR BUILD_DIR
#
# hwloc's PCI plugin (libpciaccess) leaks about 1 KB per topology load inside that library; it is
# turned off for these runs (HWLOC_COMPONENTS=-pci) so that any leak reported is r2ccl's; what
# OpenSSL keeps per thread is suppressed (tests/lsan-suppressions.txt) for the same reason.
set -euo pipefail
src=$1
build=$2
targets=(coll_api_test coll_collectives_test kvxfer_test fabric_test endpoint_test provider_test bootstrap_test channel_test channel_failover_test health_test config_test)
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
if [[ ! -f $build/build.ninja ]]; then
  cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DR2CCL_CUDA=OFF "${launcher[@]}" \
    -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined" \
    -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
fi
cmake --build "$build" --target "${targets[@]}" -- -j"$(nproc)" >/dev/null
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 HWLOC_COMPONENTS=-pci
export LSAN_OPTIONS=suppressions=$src/tests/lsan-suppressions.txt:print_suppressions=0
failed=0
for t in "${targets[@]}"; do
  if out=$(timeout 600 "$build/bin/$t" 2>&1); then
    echo "sanitize: $t clean ($(grep -Eo '[0-9]+ tests? from [0-9]+ test suites? ran' <<<"$out" | head -1))"
  else
    echo "sanitize: $t FAILED"
    grep -E "ERROR|SUMMARY|runtime error|FAILED|Failure" <<<"$out" | head -40
    failed=1
  fi
done
exit "$failed"
