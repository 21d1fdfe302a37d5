#!/usr/bin/env bash
# Runs on a GPU machine (device tool), as root, from the repository root: NIXL transfers of GPU
# memory (VRAM) between two "nodes" (network namespaces r2n0 and r2n1 joined by four veth NICs
# shaped to RATE each: bench/gpu/netns.sh) through NIXL's Python agent API with r2ccl's backend
# (R2CCL), the way vLLM's NixlConnector and SGLang drive it: tests/nixl/nixl_peer.py, the
# initiator on GPU 0 in r2n0 reading source blocks of the target's GPU and writing into its sink
# blocks, each transfer with a notification, every block compared byte for byte (on the host,
# after a copy out of the GPU). In one call:
#   host   every buffer in host memory (DRAM), four rails: the same workload, for comparison
#   vram   every buffer in GPU memory (VRAM), four rails
#   down   VRAM, FAULT_NIC of r2n0 taken down while the stream runs (after 25% of its bytes)
# Carry build-gpu/lib/libplugin_R2CCL.so, build-gpu/carry-lib, bundle/net
# (bench/gpu/net-bundle.sh) and bundle/nixl.tar.xz (bench/gpu/nixl-bundle.sh). Writes
# $OUT/summary.md and each peer's output under $OUT/logs/; prints the table. Exit 0 when every
# run moved every block right.
#
# usage: bench/gpu/nixl-on-device.sh [RATE (default 2gbit)]
#   env: TRANSFERS (400), BLOCK (bytes per transfer, 4M), BLOCKS (16), WINDOW (8),
#        FAULT_NIC (eth1), PEER_S (150: each peer's deadline)
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root" || exit 2
rate=${1:-2gbit}
out=${OUT:-/tmp/nixl-out}
fault_nic=${FAULT_NIC:-eth1}
peer_s=${PEER_S:-150}
transfers=${TRANSFERS:-400}
block=${BLOCK:-4194304}
plugin=$root/build-gpu/lib/libplugin_R2CCL.so
bundle=$root/bundle/nixl.tar.xz
netns=$root/bench/gpu/netns.sh
py=${PYTHON:-python3}
mkdir -p "$out/logs"
for f in "$plugin" "$bundle"; do
  [[ -f $f ]] || { echo "nixl-on-device.sh: no $f (bench/gpu/build.sh plugin_R2CCL; bench/gpu/nixl-bundle.sh)"; exit 2; }
done
site=$(mktemp -d)
tar -C "$site" -xJf "$bundle"
cp "$plugin" "$site/site/.nixl_cu13.mesonpy.libs/plugins/"
export PYTHONPATH=$site/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export R2_NET_BUNDLE=$root/bundle/net
export LD_LIBRARY_PATH=$root/build-gpu/carry-lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
{
  date -u
  nvidia-smi -L
  "$py" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__)'
  "$py" -c 'import nixl; print("nixl from", nixl.__file__)'
} > "$out/testbed.txt" 2>&1
cat "$out/testbed.txt"

"$netns" up "$rate" > "$out/logs/netns.txt" 2>&1 || { cat "$out/logs/netns.txt"; exit 2; }
"$netns" check >> "$out/logs/netns.txt" 2>&1 || { echo "testbed check failed"; cat "$out/logs/netns.txt"; exit 2; }
trap '"$netns" teardown >/dev/null 2>&1; rm -rf "$site"' EXIT

status=0
# run TAG MEMORY [FAULT]: the target in r2n1 on GPU 1, the initiator in r2n0 on GPU 0.
run() {
  local tag=$1 memory=$2 fault=${3:-}
  local dir=$out/run-$tag
  rm -rf "$dir"
  mkdir -p "$dir"
  "$netns" restore > /dev/null 2>&1
  local args=(--dir "$dir" --transfers "$transfers" --block "$block" --blocks "${BLOCKS:-16}"
    --window "${WINDOW:-8}" --memory "$memory" --deadline "$peer_s")
  local env=(R2CCL_NICS=eth0,eth1,eth2,eth3 R2CCL_TIMEOUT=30s "PYTHONPATH=$PYTHONPATH"
    "LD_LIBRARY_PATH=$LD_LIBRARY_PATH" PYTHONUNBUFFERED=1)
  timeout $((peer_s + 20)) "$netns" exec r2n1 env CUDA_VISIBLE_DEVICES=1 "${env[@]}" "$py" \
    tests/nixl/nixl_peer.py target "${args[@]}" > "$out/logs/$tag.target.txt" 2>&1 &
  local pt=$!
  timeout $((peer_s + 20)) "$netns" exec r2n0 env CUDA_VISIBLE_DEVICES=0 "${env[@]}" "$py" \
    tests/nixl/nixl_peer.py initiator "${args[@]}" > "$out/logs/$tag.initiator.txt" 2>&1 &
  local pi=$!
  if [[ -n $fault ]]; then
    # After a quarter of the bytes: the stream is running on every rail.
    local want=$((transfers * block / 4)) i
    for ((i = 0; i < 600; i++)); do
      local got
      got=$(grep '^progress ' "$out/logs/$tag.initiator.txt" 2>/dev/null | tail -n 1 | cut -d' ' -f2)
      [[ ${got:-0} -ge $want ]] && break
      kill -0 "$pi" 2>/dev/null || break
      sleep 0.1
    done
    "$netns" nic-down r2n0 "$fault_nic"
    echo "== $tag: r2n0 $fault_nic down after ${got:-0} bytes"
  fi
  local rci=0 rct=0
  wait "$pi" || rci=$?
  wait "$pt" || rct=$?
  echo "== $tag: initiator exit $rci, target exit $rct"
  grep -v '^progress \|NIXL INFO' "$out/logs/$tag.initiator.txt" | tail -n 3
  grep -v '^progress \|NIXL INFO' "$out/logs/$tag.target.txt" | tail -n 2
  ((rci == 0 && rct == 0)) || status=1
}

run host host
run vram cuda
run down cuda down

# READs move data one way and WRITEs the other: the rails' rate in both directions, GB/s.
link=$("$py" -c "
import re; m = re.fullmatch(r'([0-9.]+)([kmg]?)bit', '$rate')
print(2 * 4 * float(m.group(1)) * {'k': 1e3, 'm': 1e6, 'g': 1e9, '': 1}[m.group(2)] / 8e9)")
{
  echo "nixl_peer.py, $transfers transfers of $block bytes (alternately READ and WRITE, ${WINDOW:-8} in" \
    "flight), 2 nodes (network namespaces) x 4 veth NICs at $rate each ($link GB/s summed over" \
    "both directions)," \
    "initiator on GPU 0, target on GPU 1"
  echo
  echo "| case | memory | result | GB/s | of the links' rate |"
  echo "|---|---|---|---:|---:|"
  for t in host:"four rails" vram:"four rails" down:"$fault_nic down mid-stream"; do
    tag=${t%%:*}
    f=$out/logs/$tag.initiator.txt
    "$py" - "$f" "$out/logs/$tag.target.txt" "${t#*:}" "$tag" "$link" <<'PYEOF'
import re, sys
init, target, what, tag, link = sys.argv[1:6]
text = open(init).read()
ttext = open(target).read()
ok = re.search(r"^ok transfers (\d+) bytes (\d+)$", text, re.M)
el = re.search(r"^elapsed ([0-9.]+)$", text, re.M)
tok = re.search(r"^ok notifications (\d+) each once$", ttext, re.M)
mem = "GPU (VRAM)" if tag != "host" else "host (DRAM)"
if ok and el and tok:
    gbps = int(ok.group(2)) / float(el.group(1)) / 1e9
    print(f"| {what} | {mem} | {ok.group(1)} transfers, every byte right; {tok.group(1)} "
          f"notifications once each | {gbps:.3f} | {100 * gbps / float(link):.1f}% |")
else:
    err = [l for l in (text + ttext).splitlines() if l.startswith("error")]
    print(f"| {what} | {mem} | FAILED: {err[:1]} | - | - |")
PYEOF
  done
} | tee "$out/summary.md"
grep -h 'is down\|fenced' "$out"/logs/down.*.txt | head -n 3
exit "$status"
