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
# The library directory is the build's CMAKE_INSTALL_LIBDIR (lib, lib64, lib/<multiarch>).
lib=$(find "$prefix" -name libr2ccl.so -printf '%h\n' | head -n 1)
[[ -n $lib ]] || { echo "install_test: libr2ccl.so was not installed" >&2; cat "$work/install.log" >&2; exit 1; }
for f in "$prefix/include/r2ccl.h" "$lib/cmake/r2ccl/r2cclConfig.cmake" "$lib/pkgconfig/r2ccl.pc"; do
  [[ -e $f ]] || { echo "install_test: $f was not installed" >&2; cat "$work/install.log" >&2; exit 1; }
done
# The SONAME names major and minor version (an ABI per minor version while the major is 0), and
# the link to it is installed.
major=$(sed -n 's/^#define R2CCL_MAJOR \([0-9]*\)$/\1/p' "$prefix/include/r2ccl.h")
minor=$(sed -n 's/^#define R2CCL_MINOR \([0-9]*\)$/\1/p' "$prefix/include/r2ccl.h")
soname=$(readelf -d "$lib/libr2ccl.so" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[[ $soname == "libr2ccl.so.$major.$minor" ]] ||
  { echo "install_test: SONAME is '$soname', expected libr2ccl.so.$major.$minor" >&2; exit 1; }
[[ -e $lib/$soname ]] || { echo "install_test: $soname was not installed" >&2; exit 1; }
# Nothing but the C ABI is exported, every function under the version node R2CCL_<major>.<minor>.
exported=$(nm -D --defined-only "$lib/libr2ccl.so" | awk -v node="R2CCL_$major.$minor" '$3 != node {print $3}')
others=$(grep -v "^r2ccl[A-Z][A-Za-z]*@@R2CCL_$major\.$minor\$" <<<"$exported" || true)
[[ -z $others ]] || { echo "install_test: libr2ccl.so exports more than r2ccl* at R2CCL_$major.$minor: $others" >&2; exit 1; }
grep -q '^r2cclAllReduce@@' <<<"$exported" || { echo "install_test: r2cclAllReduce is not exported" >&2; exit 1; }
export R2CCL_NICS=127.0.30.1,127.0.30.2 R2CCL_SOCKET_IFNAME=lo R2CCL_TIMEOUT=20s
cmake -S "$here/consumer" -B "$work/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" >"$work/configure.log" ||
  { cat "$work/configure.log" >&2; exit 1; }
cmake --build "$work/consumer" >"$work/build.log" || { cat "$work/build.log" >&2; exit 1; }
LD_LIBRARY_PATH=$lib "$work/consumer/consumer_comm_test"
export PKG_CONFIG_PATH=$lib/pkgconfig
# shellcheck disable=SC2046
cc -std=c11 -Wall -Werror -o "$work/kv_test" "$here/kv_test.c" $(pkg-config --cflags --libs r2ccl)
LD_LIBRARY_PATH=$lib "$work/kv_test"
echo "install_test: installed, found by find_package and pkg-config, and used from C"
