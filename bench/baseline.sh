#!/usr/bin/env bash
# bench/baseline.sh: the baselines r2ccl's all-reduce is compared with: Open MPI's MPI_Allreduce
# (bench/src/mpi_allreduce.c) and Gloo through torch.distributed (bench/gloo_allreduce.py), with
# one rank per host of a netns testbed, or with every rank on loopback.
#
#   bench/baseline.sh [--impl openmpi|gloo|all] [--net testbed|loopback] [--hosts H] [--nics K]
#                     [--rate RATE] [--testbed NAME] [--ranks N] [--gloo-chunks K]
#                     [--timeout S] [-- BENCH_ARGS...]
#
#   --impl         which baseline(s) to run (default all: openmpi, then gloo)
#   --net          testbed (default): rank h on host h of a testbed of H hosts x K rails shaped
#                  to RATE (defaults 2, 4, 100mbit), made here and destroyed on exit, or the
#                  existing testbed --testbed NAME (left as it is);
#                  loopback: --ranks N (default 2) processes on 127.0.0.1, no namespaces
#   --gloo-chunks  split each Gloo all-reduce into K concurrent ones (gloo_allreduce.py --chunks),
#                  the way to make Gloo use several interfaces at once (default 1)
#   --timeout      hard wall-clock limit of each baseline run in seconds (default 300)
#   BENCH_ARGS     passed to both benchmarks (default: -b 8 -e 4M -f 2 -n 20 -w 5 -c 1);
#                  -l 1 (per-operation percentiles) is understood by the Open MPI one only
#
# Prints the benchmarks' JSON lines on stdout, one per size and baseline; progress on stderr.
#
# How each runs on the testbed (H hosts, rails eth1..ethK, management eth0 198.19.0.(h+1)):
#  * Open MPI: mpirun runs inside host 0's namespace with --host 198.19.0.1,...; it starts its
#    daemon on every other host through bench/netns-rsh (an ssh stand-in: `ip netns exec` into
#    the namespace holding that address).  Out-of-band traffic on eth0; MPI data through the
#    TCP BTL over eth1..ethK, which Open MPI stripes large messages across.
#  * Gloo: rank h runs in host h's namespace, rendezvous at 198.19.0.1, data over
#    GLOO_SOCKET_IFNAME=eth1,...,ethK (one Gloo device per interface; see gloo_allreduce.py for
#    how Gloo spreads collectives over them).
#
# Needs: openmpi-bin, libopenmpi-dev (mpicc), python3-torch (for /usr/bin/python3); root for the
# testbed.  The MPI benchmark is compiled into build-baseline/ when missing or out of date.
# Exit status: 0 every run passed, 1 a run failed or found wrong elements, 2 usage, 77 cannot
# run here (missing tools, or no testbed possible).
set -euo pipefail

readonly NAME=baseline
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
readonly root
readonly testbed=$root/tests/testbed/testbed
readonly rsh=$root/bench/netns-rsh
readonly gloo_py=$root/bench/gloo_allreduce.py
readonly mpi_src=$root/bench/src/mpi_allreduce.c
readonly mpi_bin=$root/build-baseline/mpi_allreduce
readonly python=/usr/bin/python3 # Debian's python3-torch is only importable by this one
readonly gloo_port=29500         # rendezvous port inside the testbed (its own namespaces)

die() {
  local code=$1
  shift
  printf '%s: %s\n' "$NAME" "$*" >&2
  exit "$code"
}
usage() { sed -n '6,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2; }

impl=all net=testbed hosts=2 nics=4 rate=100mbit tb_name="" ranks=2 chunks=1 run_timeout=300
bench_args=(-b 8 -e 4M -f 2 -n 20 -w 5 -c 1)
while [[ $# -gt 0 ]]; do
  case $1 in
    --impl | --net | --hosts | --nics | --rate | --testbed | --ranks | --gloo-chunks | --timeout)
      [[ $# -ge 2 ]] || die 2 "option '$1' needs a value"
      case $1 in
        --impl) impl=$2 ;;
        --net) net=$2 ;;
        --hosts) hosts=$2 ;;
        --nics) nics=$2 ;;
        --rate) rate=$2 ;;
        --testbed) tb_name=$2 ;;
        --ranks) ranks=$2 ;;
        --gloo-chunks) chunks=$2 ;;
        --timeout) run_timeout=$2 ;;
      esac
      shift 2
      ;;
    --) shift; bench_args=("$@"); break ;;
    -h | --help) usage ;;
    *) die 2 "unknown argument '$1' (see --help)" ;;
  esac
done
[[ $impl =~ ^(openmpi|gloo|all)$ ]] || die 2 "--impl must be openmpi, gloo or all"
[[ $net =~ ^(testbed|loopback)$ ]] || die 2 "--net must be testbed or loopback"
# int_in NAME VALUE LO HI: exits 2 unless VALUE is a decimal integer in LO..HI.
int_in() {
  [[ $2 =~ ^[0-9]{1,5}$ ]] || die 2 "$1 must be an integer $3..$4"
  ((10#$2 >= $3 && 10#$2 <= $4)) || die 2 "$1 must be an integer $3..$4"
}
int_in --hosts "$hosts" 2 16
int_in --nics "$nics" 1 8
int_in --ranks "$ranks" 1 16
int_in --gloo-chunks "$chunks" 1 64
int_in --timeout "$run_timeout" 1 99999
hosts=$((10#$hosts)) nics=$((10#$nics)) ranks=$((10#$ranks)) chunks=$((10#$chunks))

want() { [[ $impl == all || $impl == "$1" ]]; }
if want openmpi; then
  if ! command -v mpirun >/dev/null || ! command -v mpicc >/dev/null; then
    die 77 "mpirun/mpicc not found (apt-get install -y openmpi-bin libopenmpi-dev)"
  fi
fi
if want gloo; then
  "$python" -c 'import torch.distributed as d; assert d.is_gloo_available()' 2>/dev/null ||
    die 77 "$python cannot import torch with Gloo (apt-get install -y python3-torch)"
fi

work=$(mktemp -d /tmp/r2ccl-baseline.XXXXXX)
created=""
# shellcheck disable=SC2317 # called through the EXIT trap
cleanup() {
  [[ -z $created ]] || "$testbed" destroy "$created" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# The MPI benchmark: rebuilt when the source is newer than the binary.
if want openmpi && [[ ! -x $mpi_bin || $mpi_src -nt $mpi_bin ]]; then
  mkdir -p "$(dirname "$mpi_bin")"
  mpicc -O2 -Wall -Werror -o "$mpi_bin" "$mpi_src" || die 1 "mpicc failed"
fi

# Network setup: rank addresses, interface lists, how to run a command on host h.
if [[ $net == testbed ]]; then
  [[ $EUID -eq 0 ]] || die 77 "the testbed needs root (try --net loopback)"
  if [[ -z $tb_name ]]; then
    why=$("$testbed" check 2>&1 >/dev/null) || die 77 "no testbed here (${why#testbed: })"
    tb_name=bl$$ # at most 9 characters: testbed names may have 12
    echo "$NAME: testbed $tb_name: $hosts hosts x $nics rails at $rate" >&2
    "$testbed" create "$tb_name" --hosts "$hosts" --nics "$nics" --rate "$rate"
    created=$tb_name
  else
    # An existing testbed: use its hosts and rails as they are.
    status=$("$testbed" status "$tb_name") || die 2 "no testbed '$tb_name'"
    read -r hosts nics < <(sed -n 's/^testbed [^:]*: \([0-9]*\) hosts, \([0-9]*\) rails.*/\1 \2/p' <<<"$status")
    echo "$NAME: using testbed $tb_name: $hosts hosts x $nics rails" >&2
  fi
  nranks=$hosts
  rails=eth1
  for ((i = 2; i <= nics; i++)); do rails+=",eth$i"; done
  mpi_hosts=198.19.0.1
  for ((h = 2; h <= hosts; h++)); do mpi_hosts+=",198.19.0.$h"; done
  mpi_launch=(env "NETNS_RSH_TESTBED=$tb_name" ip netns exec "$tb_name-h0")
  mpi_net=(--host "$mpi_hosts" --map-by node --mca plm_rsh_agent "$rsh"
    --mca oob_tcp_if_include eth0 --mca btl_tcp_if_include "$rails")
  gloo_master=198.19.0.1:$gloo_port
  gloo_ifname=$rails
  on_host() { local h=$1; shift; ip netns exec "$tb_name-h$h" "$@"; }
else
  nranks=$ranks
  mpi_launch=()
  # --oversubscribe: more ranks than cores is allowed (Open MPI then yields when idle anyway).
  mpi_net=(--oversubscribe --mca oob_tcp_if_include lo --mca btl_tcp_if_include lo)
  port=""
  for ((p = 29500; p < 29600; p++)); do # a free port on loopback, bounded search
    [[ -n $(ss -Htln "sport = :$p" 2>/dev/null) ]] || { port=$p; break; }
  done
  [[ -n $port ]] || die 1 "no free TCP port in 29500..29599"
  gloo_master=127.0.0.1:$port
  gloo_ifname=lo
  on_host() { shift; "$@"; }
fi

failed=0

# Open MPI.  --bind-to none: every "host" is the same machine, and Open MPI would bind each
# host's rank to the first core, all of them the same core.  mpi_yield_when_idle: ranks poll
# for progress; yielding the core in between keeps them from starving each other and the
# kernel's TCP work on a machine with few cores.  pml ob1 + btl tcp,self: plain TCP sockets
# (neither UCX nor shared memory, which would bypass the NICs).
if want openmpi; then
  echo "$NAME: openmpi, $nranks ranks ($net): mpi_allreduce ${bench_args[*]}" >&2
  rc=0
  timeout -k 10 "$run_timeout" "${mpi_launch[@]}" mpirun --allow-run-as-root -np "$nranks" \
    --bind-to none "${mpi_net[@]}" --mca pml ob1 --mca btl tcp,self \
    --mca mpi_yield_when_idle 1 "$mpi_bin" "${bench_args[@]}" 2>"$work/mpi.err" || rc=$?
  if ((rc != 0)); then
    echo "$NAME: openmpi run FAILED (exit $rc; 124 = killed after ${run_timeout}s):" >&2
    cat "$work/mpi.err" >&2
    failed=1
  fi
fi

# Gloo: one process per rank, each in its host's namespace, each under the time limit.
if want gloo; then
  echo "$NAME: gloo, $nranks ranks ($net), GLOO_SOCKET_IFNAME=$gloo_ifname:" \
    "gloo_allreduce.py --chunks $chunks ${bench_args[*]}" >&2
  pids=()
  for ((r = 0; r < nranks; r++)); do
    cmd=(env "GLOO_SOCKET_IFNAME=$gloo_ifname" timeout -k 10 "$run_timeout"
      "$python" "$gloo_py" --rank "$r" --nranks "$nranks" --master "$gloo_master"
      --chunks "$chunks" "${bench_args[@]}")
    if ((r == 0)); then # rank 0 prints the results
      on_host "$r" "${cmd[@]}" 2>"$work/gloo.$r.err" &
    else
      on_host "$r" "${cmd[@]}" >"$work/gloo.$r.out" 2>"$work/gloo.$r.err" &
    fi
    pids+=($!)
  done
  for ((r = 0; r < nranks; r++)); do
    rc=0
    wait "${pids[r]}" || rc=$?
    if ((rc != 0)); then
      echo "$NAME: gloo rank $r FAILED (exit $rc; 124 = killed after ${run_timeout}s):" >&2
      cat "$work/gloo.$r.err" >&2
      failed=1
    fi
  done
fi

exit "$failed"
