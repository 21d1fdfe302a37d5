#!/usr/bin/env bash
# tests/rdma/run.sh: run a command in the Soft-RoCE VM (tests/rdma/rdma-vm), for ctest.
#
#   tests/rdma/run.sh [--hosts H] [--nics M] [--timeout SEC] [--out DIR] -- COMMAND [ARGS...]
#
# Boots the QEMU guest with H hosts x M rxe NICs (defaults 2 x 2), runs COMMAND there as root in
# the current directory and exits with COMMAND's status (124: it ran past --timeout, default
# 600 s).  It never installs packages (scripts/run test does, before the tests run).  When the
# VM cannot run here -- not root, qemu or the kernel with rdma_rxe missing, any other harness
# failure (rdma-vm's exit 125) -- it prints one line saying why and exits 77, ctest's
# SKIP_RETURN_CODE (tests/run-ctest then fails the run if this machine could have run it).  Already inside the guest ($RDMA_VM set) it runs
# COMMAND directly.  Every wait is bounded: the whole run, package installation included, ends
# within --timeout + 900 s.
set -uo pipefail

readonly SKIP=77
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
vm=$here/rdma-vm
hosts=2 nics=2 tmo=600 out=
usage() { echo "usage: tests/rdma/run.sh [--hosts H] [--nics M] [--timeout SEC] [--out DIR] -- COMMAND [ARGS...]" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case $1 in
    --hosts) hosts=${2:?}; shift 2 ;;
    --nics) nics=${2:?}; shift 2 ;;
    --timeout) tmo=${2:?}; shift 2 ;;
    --out) out=${2:?}; shift 2 ;;
    --) shift; break ;;
    -h | --help) usage ;;
    *) echo "run.sh: unknown option '$1'" >&2; usage ;;
  esac
done
[[ $# -gt 0 ]] || usage
[[ $tmo =~ ^[0-9]+$ ]] || { echo "run.sh: --timeout needs a number" >&2; exit 2; }

skip() { echo "SKIP: rdma-vm unavailable: $*"; exit "$SKIP"; }

# Inside the guest already (e.g. a test that calls run.sh itself): no nested VM.
if [[ -n ${RDMA_VM:-} ]]; then
  exec timeout -k 10 "$tmo" "$@"
fi

# Cheap checks first, so that a machine that cannot run the VM skips at once.
[[ $(uname -m) == x86_64 ]] || skip "needs an x86_64 host (qemu-system-x86_64), this is $(uname -m)"
[[ $(id -u) == 0 ]] || skip "needs root (9p export of /, apt-get); run as root or under sudo"
[[ -x $vm ]] || skip "$vm is missing or not executable"
command -v qemu-system-x86_64 >/dev/null 2>&1 ||
  skip "qemu-system-x86_64 is not installed (scripts/run test installs it: Debian package qemu-system-x86)"

args=(--no-install --hosts "$hosts" --nics "$nics" --timeout "$tmo")
[[ -n $out ]] && args+=(--out "$out")
errlog=$(mktemp "${TMPDIR:-/tmp}/rdma-run.XXXXXX")
trap 'rm -f "$errlog"' EXIT
# stderr is streamed and also kept, to find the harness's reason when it fails.  The outer
# timeout covers boot (180 s) and the command (--timeout, then rdma-vm kills the guest 60 s
# later), with room to spare.
{
  timeout -k 30 $((tmo + 900)) "$vm" "${args[@]}" -- "$@" 2>&1 1>&3 3>&- | tee "$errlog" >&2
  rc=${PIPESTATUS[0]}
} 3>&1
case $rc in
  125)
    # rdma-vm's own lines start with "rdma-vm: "; the first one that is not the console tail's
    # framing is the reason (die() prints exactly one).
    why=$(grep -E '^rdma-vm: ' "$errlog" | grep -v -e '---- ' -e '^rdma-vm: installing:' | head -n 1)
    why=${why#rdma-vm: }
    skip "${why:-the VM harness failed (exit 125), see the output above}"
    ;;
  124)
    echo "run.sh: the command ran past its ${tmo}s limit in the VM (or the VM run past ${tmo}+900s)" >&2
    ;;
esac
exit "$rc"
