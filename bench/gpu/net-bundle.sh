#!/usr/bin/env bash
# Unpacks Debian's iproute2 and nftables, with the libraries the GPU machines' image lacks, into
# bundle/net (ignored by git; carry it to the device tool): the GPU machines have no ip, tc or
# nft and no network. Run here (Debian, network). About 6 MB once the docs are gone.
# usage: bench/gpu/net-bundle.sh [DIR]   (default: bundle/net at the repository root)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
dir=${1:-$root/bundle/net}
pkgs=(iproute2 nftables libbpf1 libmnl0 libelf1 libcap2 libxtables12 libnftables1 libnftnl11
  libjansson4 libedit2 libbsd0 libmd0)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && chmod 777 . && apt-get download "${pkgs[@]}" >/dev/null)
rm -rf "$dir"
mkdir -p "$dir"
for d in "$tmp"/*.deb; do dpkg -x "$d" "$dir"; done
rm -rf "$dir"/usr/share/{doc,man,bash-completion,lintian,zsh} "$dir"/usr/lib/x86_64-linux-gnu/tc \
  "$dir"/usr/share/doc-base
du -sh "$dir"
