#!/usr/bin/env bash
# tests/capi/subproject_test.sh SOURCE_DIR: builds r2ccl as a subproject of another CMake project
# (add_subdirectory) with -DR2CCL_METRICS=OFF, as a project that wants the runtime alone would:
# the configure must not look for the monitor's, the benchmarks' or the tests' dependencies, no
# test or tool is built, and the C ABI test links and runs against that libr2ccl.so.
set -euo pipefail
[[ $# -eq 1 ]] || { echo "usage: tests/capi/subproject_test.sh SOURCE_DIR" >&2; exit 2; }
src=$(cd "$1" && pwd)
work=$(mktemp -d /tmp/r2ccl-subproject.XXXXXX)
trap 'rm -rf "$work"' EXIT
launcher=()
if command -v ccache >/dev/null; then
  # The same sources and flags as the main build: ccache serves what it already compiled.
  export CCACHE_NOHASHDIR=1
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
fi
cmake -S "$src/tests/capi/subproject" -B "$work/b" -G Ninja -DR2CCL_SOURCE="$src" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DR2CCL_METRICS=OFF -DR2CCL_CUDA=OFF "${launcher[@]}" \
  >"$work/configure.log" 2>&1 || { cat "$work/configure.log" >&2; exit 1; }
manifest=$work/b/r2ccl-dependencies.tsv
for dep in prometheus-cpp civetweb CLI11 nlohmann_json GTest; do
  if grep -q "^$dep	" "$manifest"; then
    echo "subproject_test: configuring the runtime alone looked for $dep:" >&2
    cat "$manifest" >&2
    exit 1
  fi
done
cmake --build "$work/b" >"$work/build.log" 2>&1 || { tail -50 "$work/build.log" >&2; exit 1; }
for target in r2ccl-perf r2ccl-monitor config_test; do
  if [[ -e $work/b/r2ccl/bin/$target ]]; then
    echo "subproject_test: $target was built inside another project" >&2
    exit 1
  fi
done
export R2CCL_NICS=127.0.37.1,127.0.37.2 R2CCL_SOCKET_IFNAME=lo R2CCL_TIMEOUT=20s
"$work/b/consumer_comm_test"
echo "subproject_test: r2ccl built inside another project without the tools' dependencies, and used"
