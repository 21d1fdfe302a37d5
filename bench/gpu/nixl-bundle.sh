#!/usr/bin/env bash
# Packs NIXL's Python agent API (the PyPI wheels nixl and nixl-cu13 of the release the NIXL plugin
# is built for) into bundle/nixl.tar.xz (ignored by git; carry it to the device tool): the GPU
# machines have no NIXL and no network. Only what the agent API loads is kept (libnixl, its
# libraries, the bindings of CPython 3.10 to 3.13); none of NIXL's own backends: the plugin
# (bench/gpu/build.sh plugin_R2CCL) goes into its plugins directory on the GPU machine. Run here
# (network). About 12 MB.
# usage: bench/gpu/nixl-bundle.sh [NIXL_VERSION (1.4.0)]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
version=${1:-1.4.0}
out=$root/bundle/nixl.tar.xz
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/site" "$tmp/wheels"
pip download -q --no-deps -d "$tmp/wheels" "nixl==$version"
for py in 3.10 3.11 3.12 3.13; do
  pip download -q --no-deps --only-binary=:all: --python-version "$py" -d "$tmp/wheels" \
    "nixl-cu13==$version"
done
python3 - "$tmp/wheels" "$tmp/site" <<'EOF'
import os, subprocess, sys, zipfile
wheels, site = sys.argv[1:3]
libdirs = (".nixl_cu13.mesonpy.libs", "nixl_cu13.libs")
for w in sorted(os.listdir(wheels)):
    with zipfile.ZipFile(os.path.join(wheels, w)) as z:
        for n in z.namelist():
            top = n.split("/")[0]
            if top in ("nixl", "nixl_cu13") or n == "nixl_meta_utils.py" or top in libdirs:
                z.extract(n, site)
# Keep, of the bundled libraries, the closure of the bindings: no backends, no tools.
def needed(path):
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True).stdout
    return [l.split("[")[1].rstrip("]") for l in out.splitlines() if "(NEEDED)" in l]
def find(name):
    for d in libdirs:
        p = os.path.join(site, d, name)
        if os.path.exists(p):
            return p
keep, todo = set(), [os.path.join(site, "nixl_cu13", f)
                     for f in os.listdir(os.path.join(site, "nixl_cu13")) if f.endswith(".so")]
while todo:
    f = todo.pop()
    if f in keep:
        continue
    keep.add(f)
    todo += [p for p in map(find, needed(f)) if p]
for d in libdirs:
    for dirpath, _, files in os.walk(os.path.join(site, d)):
        for f in files:
            p = os.path.join(dirpath, f)
            if p not in keep:
                os.remove(p)
os.makedirs(os.path.join(site, ".nixl_cu13.mesonpy.libs", "plugins"), exist_ok=True)
EOF
mkdir -p "$root/bundle"
tar -C "$tmp" -cJf "$out" site
du -h "$out"
