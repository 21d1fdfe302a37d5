#!/usr/bin/env bash
# Builds what runs on the GPU machines (device tool) into build-gpu/: the GPU tests,
# r2ccl-gpu-perf, libr2ccl.so (for the Python package) and the NCCL network plugin, the default build type
# (ccache then shares the objects of build/), Hopper code (sm_90), debug information stripped;
# then copies the shared libraries the binaries need that the GPU machines' image lacks
# into build-gpu/carry-lib (glibc, libstdc++ and libgcc stay: the image's are newer; so does
# NCCL, which the image has).
# usage: bench/gpu/build.sh [TARGET...]   (default: every GPU test)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=$root/build-gpu
targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(gpu_reduce_test r2ccl-gpu-perf r2ccl nccl-net-r2ccl)
cmake -S "$root" -B "$build" -G Ninja -DR2CCL_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 >/dev/null
cmake --build "$build" --target "${targets[@]}"
files=()
for t in "${targets[@]}"; do
  case $t in
    r2ccl) files+=("$build/lib/libr2ccl.so.0.2") ;;
    nccl-net-r2ccl) files+=("$build/lib/libnccl-net-r2ccl.so") ;;  # NCCL_NET_PLUGIN
    plugin_R2CCL) files+=("$build/lib/libplugin_R2CCL.so") ;;      # NIXL's backend R2CCL
    *) files+=("$build/bin/$t") ;;
  esac
done
for f in "${files[@]}"; do
  objcopy --strip-debug "$(readlink -f "$f")"
done
rm -rf "$build/carry-lib"
mkdir -p "$build/carry-lib"
for f in "${files[@]}"; do
  ldd "$f" | awk '$3 ~ /^\// {print $3}'
done | sort -u | while read -r lib; do
  case $(basename "$lib") in
    libc.so.* | libm.so.* | libstdc++.so.* | libgcc_s.so.* | ld-linux* | libpthread.so.* | \
      libdl.so.* | librt.so.* | libnccl.so.*) ;;  # NCCL: the GPU machines have their own
    *) cp -L "$lib" "$build/carry-lib/" ;;
  esac
done
du -sh "$build/bin" "$build/lib" "$build/carry-lib"
