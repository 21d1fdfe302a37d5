#!/usr/bin/env bash
# A two-host testbed on one machine, for NCCL's network transports: network namespaces r2n0 and
# r2n1 joined by four veth pairs, eth0..eth3 in each (pair K: 198.18.K.1/24 in r2n0,
# 198.18.K.2/24 in r2n1), each end shaped with tc tbf (rate RATE, burst 1mb, latency 20ms), and
# a fifth pair, mgmt (198.19.0.1/24, 198.19.0.2/24), unshaped and never faulted, for the
# bootstraps (torch's rendezvous, NCCL's own bootstrap through NCCL_SOCKET_IFNAME). Faults act on
# one end (default r2n0): a link down, a black hole (nftables drops everything in and out of the
# NIC), a flap. Needs root and ip, tc, nft on PATH; where they are missing (the GPU machines) it
# uses Debian's, unpacked by bench/gpu/net-bundle.sh into R2_NET_BUNDLE (default bundle/net at
# the repository root), with their libraries on LD_LIBRARY_PATH for those tools only: a command
# run in a namespace (exec) gets the caller's environment unchanged.
#
# usage: bench/gpu/netns.sh COMMAND [ARGS]
#   up [RATE]                 build the testbed (tears an old one down first); RATE default 2gbit
#                             ("none": unshaped)
#   teardown                  delete both namespaces (and so every veth, qdisc, nft rule)
#   nic-down NS IF            ip -n NS link set IF down
#   nic-up NS IF              ... up
#   blackhole NS IF           nftables: drop every packet in and out of IF in NS
#   unblackhole NS IF         remove that rule
#   flap NS IF [N] [DOWN_S] [UP_S]   N times (default 5, at most 1000): down DOWN_S (default 1),
#                             up UP_S (default 1)
#   restore                   every NIC up, every black hole gone, in both namespaces
#   stats                     one line per NIC: NS IF STATE TX_BYTES RX_BYTES
#   check                     a TCP connection over each NIC and mgmt, r2n0 to r2n1; non-zero
#                             on a failure
#   exec NS CMD [ARGS...]     run CMD in NS (ip netns exec, or nsenter where that fails)
#   show                      addresses, qdiscs and nft rules of both namespaces
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
NS=(r2n0 r2n1)
NICS=(eth0 eth1 eth2 eth3)
orig_ld=${LD_LIBRARY_PATH-}
orig_ld_set=${LD_LIBRARY_PATH+1}

# The tools: the machine's own, or the bundle's with its libraries for these commands only.
bundle=${R2_NET_BUNDLE:-$root/bundle/net}
IP=ip TC=tc NFT=nft
tool_env=(command)  # command: the tool, not the functions below of the same name
if [[ ${R2_NET_BUNDLE_FORCE:-0} == 1 ]] || ! command -v ip >/dev/null || ! command -v tc >/dev/null ||
  ! command -v nft >/dev/null; then
  [[ -x $bundle/bin/ip ]] || { echo "netns.sh: no ip/tc/nft here and no bundle in $bundle" >&2; exit 2; }
  IP=$bundle/bin/ip TC=$bundle/sbin/tc NFT=$bundle/usr/sbin/nft
  tool_env=(env "LD_LIBRARY_PATH=$bundle/lib/x86_64-linux-gnu:$bundle/usr/lib/x86_64-linux-gnu${orig_ld:+:$orig_ld}")
fi
ip() { "${tool_env[@]}" "$IP" "$@"; }
tc() { "${tool_env[@]}" "$TC" "$@"; }
nft_in() {  # nft_in NS ARGS...: nft in namespace NS
  local ns=$1
  shift
  "${tool_env[@]}" nsenter --net="/run/netns/$ns" "$NFT" "$@"
}
die() { echo "netns.sh: $*" >&2; exit 2; }
check_ns() { [[ " ${NS[*]} " == *" $1 "* ]] || die "unknown namespace $1 (${NS[*]})"; }
check_if() { [[ " ${NICS[*]} " == *" $1 "* ]] || die "unknown or unfaultable NIC $1 (${NICS[*]})"; }
have_ns() { [[ -e /run/netns/$1 ]]; }

teardown() {
  local ns
  for ns in "${NS[@]}"; do
    if have_ns "$ns"; then ip netns del "$ns"; fi
  done
}

up() {
  local rate=${1:-2gbit} ns k
  teardown
  for ns in "${NS[@]}"; do
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    # No IPv6: no duplicate-address detection, no link-local addresses for a transport to pick.
    nsenter --net="/run/netns/$ns" sh -c \
      'for f in /proc/sys/net/ipv6/conf/all/disable_ipv6 /proc/sys/net/ipv6/conf/default/disable_ipv6; do
         [ -w "$f" ] && echo 1 > "$f"; done; true'
  done
  for k in 0 1 2 3; do
    ip -n r2n0 link add "eth$k" type veth peer name "eth$k" netns r2n1
    ip -n r2n0 addr add "198.18.$k.1/24" dev "eth$k"
    ip -n r2n1 addr add "198.18.$k.2/24" dev "eth$k"
    for ns in "${NS[@]}"; do
      if [[ $rate != none ]]; then
        tc -n "$ns" qdisc add dev "eth$k" root tbf rate "$rate" burst 1mb latency 20ms
      fi
      ip -n "$ns" link set "eth$k" up
    done
  done
  ip -n r2n0 link add mgmt type veth peer name mgmt netns r2n1
  ip -n r2n0 addr add 198.19.0.1/24 dev mgmt
  ip -n r2n1 addr add 198.19.0.2/24 dev mgmt
  ip -n r2n0 link set mgmt up
  ip -n r2n1 link set mgmt up
  echo "netns.sh: r2n0, r2n1: eth0..eth3 198.18.K.1|2/24 (tbf $rate), mgmt 198.19.0.1|2/24"
}

blackhole() {
  local ns=$1 nic=$2
  unblackhole "$ns" "$nic"
  nft_in "$ns" -f - <<EOF
table inet r2bh_$nic {
  chain in { type filter hook input priority -300; policy accept; iifname "$nic" drop; }
  chain out { type filter hook output priority -300; policy accept; oifname "$nic" drop; }
}
table netdev r2bhdev_$nic {
  chain in { type filter hook ingress device "$nic" priority -500; policy drop; }
}
EOF
}

unblackhole() {
  local ns=$1 nic=$2
  nft_in "$ns" delete table inet "r2bh_$nic" 2>/dev/null || true
  nft_in "$ns" delete table netdev "r2bhdev_$nic" 2>/dev/null || true
}

flap() {
  local ns=$1 nic=$2 n=${3:-5} down_s=${4:-1} up_s=${5:-1} i
  [[ $n =~ ^[0-9]+$ && $n -le 1000 ]] || die "flap: N must be 0..1000"
  for ((i = 1; i <= n; i++)); do
    ip -n "$ns" link set "$nic" down
    sleep "$down_s"
    ip -n "$ns" link set "$nic" up
    echo "netns.sh: flap $i/$n of $ns $nic"
    [[ $i -eq $n ]] || sleep "$up_s"
  done
}

restore() {
  local ns nic
  for ns in "${NS[@]}"; do
    have_ns "$ns" || continue
    for nic in "${NICS[@]}"; do
      unblackhole "$ns" "$nic"
      ip -n "$ns" link set "$nic" up
    done
  done
}

stats() {
  local ns nic
  for ns in "${NS[@]}"; do
    have_ns "$ns" || continue
    for nic in "${NICS[@]}" mgmt; do
      local d=/sys/class/net/$nic
      # The namespace's own sysfs: mount it privately in a throwaway mount namespace.
      nsenter --net="/run/netns/$ns" unshare --mount sh -c \
        "mount -t sysfs none /sys 2>/dev/null; printf '%s %s %s %s %s\n' $ns $nic \
          \$(cat $d/operstate) \$(cat $d/statistics/tx_bytes) \$(cat $d/statistics/rx_bytes)"
    done
  done
}

check() {  # a TCP connection from r2n0 to r2n1 over each NIC and mgmt (no ping on the GPU machines)
  local py=${R2_PYTHON:-python3} port=$((20000 + RANDOM % 20000))
  nsenter --net=/run/netns/r2n1 "$py" -c "
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('0.0.0.0', $port)); s.listen(8); s.settimeout(10)
for _ in range(5):
    try: s.accept()[0].close()
    except OSError: break
" &
  local lpid=$! rc=0 k
  sleep 0.5
  for k in 0 1 2 3 mgmt; do
    local addr=198.18.$k.2 nic=eth$k
    [[ $k != mgmt ]] || addr=198.19.0.2 nic=mgmt
    nsenter --net=/run/netns/r2n0 "$py" -c "
import socket; socket.create_connection(('$addr', $port), timeout=3).close()" 2>/dev/null ||
      { echo "netns.sh: $nic ($addr): no connection"; rc=1; }
  done
  kill "$lpid" 2>/dev/null || true
  wait "$lpid" 2>/dev/null || true
  [[ $rc -ne 0 ]] || echo "netns.sh: eth0..eth3 and mgmt connect"
  return $rc
}

exec_in() {
  local ns=$1
  shift
  check_ns "$ns"
  # The command gets the caller's LD_LIBRARY_PATH, not the bundle's.
  local envfix=(env -u LD_LIBRARY_PATH)
  [[ -z $orig_ld_set ]] || envfix=(env "LD_LIBRARY_PATH=$orig_ld")
  if [[ ${R2_NETNS_EXEC:-} != nsenter ]] && ip netns exec "$ns" true 2>/dev/null; then
    ip netns exec "$ns" "${envfix[@]}" "$@"
  else
    nsenter --net="/run/netns/$ns" "${envfix[@]}" "$@"
  fi
}

show() {
  local ns
  for ns in "${NS[@]}"; do
    have_ns "$ns" || { echo "== $ns: absent"; continue; }
    echo "== $ns"
    ip -n "$ns" -br addr
    tc -n "$ns" qdisc show | grep -v noqueue || true
    nft_in "$ns" list ruleset
  done
}

[[ $# -ge 1 ]] || { sed -n '/^# usage/,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2; }
cmd=$1
shift
case $cmd in
  up) up "$@" ;;
  teardown) teardown ;;
  nic-down | nic-up)
    [[ $# -eq 2 ]] || die "$cmd NS IF"
    check_ns "$1"; check_if "$2"
    ip -n "$1" link set "$2" "${cmd#nic-}" ;;
  blackhole | unblackhole)
    [[ $# -eq 2 ]] || die "$cmd NS IF"
    check_ns "$1"; check_if "$2"
    "$cmd" "$1" "$2" ;;
  flap)
    [[ $# -ge 2 ]] || die "flap NS IF [N] [DOWN_S] [UP_S]"
    check_ns "$1"; check_if "$2"
    flap "$@" ;;
  restore) restore ;;
  stats) stats ;;
  check) check ;;
  exec) [[ $# -ge 2 ]] || die "exec NS CMD..."; exec_in "$@" ;;
  show) show ;;
  *) die "unknown command $cmd" ;;
esac
