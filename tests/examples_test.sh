#!/usr/bin/env bash
# tests/examples_test.sh c EXAMPLE_BINARY | python SOURCE_DIR: runs an example of examples/ as two
# ranks on loopback rails, as its comment says to, and checks that both ranks said they were right.
set -euo pipefail
kind=$1
export R2CCL_NICS=127.0.36.1,127.0.36.2 R2CCL_SOCKET_IFNAME=lo R2CCL_TIMEOUT=20s
out=$(mktemp)
trap 'rm -f "$out"' EXIT
case $kind in
  c)
    pids=()
    for r in 0 1; do
      R2CCL_RANK=$r R2CCL_NRANKS=2 R2CCL_BOOTSTRAP=127.0.0.1:29651 timeout 120 "$2" >>"$out" 2>&1 &
      pids+=($!)
    done
    rc=0
    for p in "${pids[@]}"; do wait "$p" || rc=1; done ;;
  python)
    # The variables torch.distributed.run sets for each process (Debian's torch 1.13 launcher
    # does not run on Python 3.11, so the ranks are started here).
    pids=()
    for r in 0 1; do
      RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29652 \
        PYTHONPATH=$2/integrations/python timeout 180 /usr/bin/python3 "$2/examples/allreduce.py" >>"$out" 2>&1 &
      pids+=($!)
    done
    rc=0
    for p in "${pids[@]}"; do wait "$p" || rc=1; done ;;
  *) echo "usage: tests/examples_test.sh c BINARY | python SOURCE_DIR" >&2; exit 2 ;;
esac
cat "$out"
[[ $rc -eq 0 ]] || { echo "examples_test: the $kind example failed" >&2; exit 1; }
for r in 0 1; do
  grep -q "rank $r of 2: all-reduce .*correct" "$out" || { echo "examples_test: rank $r did not report a correct all-reduce" >&2; exit 1; }
done
