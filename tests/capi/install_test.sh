#!/usr/bin/env bash
# tests/capi/install_test.sh BUILD_DIR: installs the build's C ABI into a temporary prefix
# (cmake --install), then uses it as a user would, from outside the source tree: a CMake project
# with find_package(r2ccl) builds and runs tests/capi/comm_test.c, and the compiler with
# pkg-config's flags alone builds and runs tests/capi/kv_test.c.
set -euo pipefail
[[ $# -eq 1 ]] || { echo "usage: tests/capi/install_test.sh BUILD_DIR" >&2; exit 2; }
build=$(cd "$1" && pwd)
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
work=$(mktemp -d /tmp/r2ccl-install.XXXXXX)
trap 'rm -rf "$work"' EXIT
prefix=$work/prefix
cmake --install "$build" --prefix "$prefix" >"$work/install.log"
for f in include/r2ccl.h lib/libr2ccl.so lib/cmake/r2ccl/r2cclConfig.cmake lib/pkgconfig/r2ccl.pc; do
  [[ -e $prefix/$f ]] || { echo "install_test: $f was not installed" >&2; cat "$work/install.log" >&2; exit 1; }
done
# Nothing but the C ABI is exported.
others=$(nm -D --defined-only "$prefix/lib/libr2ccl.so" | awk '{print $3}' | grep -v '^r2ccl' || true)
[[ -z $others ]] || { echo "install_test: libr2ccl.so exports more than r2ccl*: $others" >&2; exit 1; }
export R2CCL_NICS=127.0.30.1,127.0.30.2 R2CCL_SOCKET_IFNAME=lo R2CCL_TIMEOUT=20s
cmake -S "$here/consumer" -B "$work/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" >"$work/configure.log" ||
  { cat "$work/configure.log" >&2; exit 1; }
cmake --build "$work/consumer" >"$work/build.log" || { cat "$work/build.log" >&2; exit 1; }
LD_LIBRARY_PATH=$prefix/lib "$work/consumer/consumer_comm_test"
export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
# shellcheck disable=SC2046
cc -std=c11 -Wall -Werror -o "$work/kv_test" "$here/kv_test.c" $(pkg-config --cflags --libs r2ccl)
LD_LIBRARY_PATH=$prefix/lib "$work/kv_test"
echo "install_test: installed, found by find_package and pkg-config, and used from C"
