#!/usr/bin/env bash
# tests/python/wheel_venv_test.sh [SOURCE_DIR]: the Python package as a user gets it. Builds r2ccl's
# wheel with `pip wheel` (scikit-build-core comes from PyPI into pip's isolated build environment),
# installs it without an index (so a declared dependency would fail the install) into an empty
# virtual environment of Debian's /usr/bin/python3 (no torch, no system or user site-packages),
# and checks there, from outside the source tree, that:
#   - `import r2ccl` works and imports no torch; the vLLM and SGLang entry points load and are inert;
#   - r2ccl.__version__ and the installed metadata are CMakeLists.txt's project(r2ccl VERSION ...);
#   - the libr2ccl.so bundled in the package is the one loaded, and works: its version (major.minor
#     is the package's), a KV engine made, asked for its metadata and closed, and a one-rank
#     communicator's barrier, on loopback rails;
#   - a call that takes a tensor fails with ModuleNotFoundError naming PyTorch and `pip install torch`.
# Exits 77 (skipped), saying why, only where it cannot run: that Python has no venv/ensurepip
# (Debian's python3-venv), or pip cannot fetch scikit-build-core (no PyPI). R2CCL_WHEEL_PYTHON
# names another Python to make the environment with. The wheel is built in pyproject.toml's
# build-dir (build-python/ in the source tree), so a second run rebuilds only what changed.
set -euo pipefail
[[ $# -le 1 ]] || { echo "usage: tests/python/wheel_venv_test.sh [SOURCE_DIR]" >&2; exit 2; }
root=$(cd "${1:-$(dirname "${BASH_SOURCE[0]}")/../..}" && pwd)
python=${R2CCL_WHEEL_PYTHON:-/usr/bin/python3}
skip() { echo "wheel_venv_test: SKIPPED: $*" >&2; exit 77; }
fail() { echo "wheel_venv_test: FAILED: $*" >&2; exit 1; }
start=$SECONDS

[[ -f $root/pyproject.toml && -f $root/CMakeLists.txt ]] || fail "$root is not r2ccl's source tree"
want=$(sed -n 's/^project(r2ccl VERSION \([0-9.]*\).*/\1/p' "$root/CMakeLists.txt")
[[ -n $want ]] || fail "no project(r2ccl VERSION ...) in $root/CMakeLists.txt"
command -v "$python" >/dev/null || skip "$python is not installed"
"$python" -c 'import venv, ensurepip' 2>/dev/null ||
  skip "$python cannot make a virtual environment with pip (no venv/ensurepip: apt-get install python3-venv)"

work=$(mktemp -d "${TMPDIR:-/tmp}/r2ccl-wheel-venv.XXXXXX")
trap 'rm -rf "$work"' EXIT
log=$work/log
quiet() { "$@" >"$log" 2>&1 || { cat "$log" >&2; fail "$*"; }; }
venv=$work/venv
# Nothing from outside the environment: not the caller's PYTHONPATH, site-packages or library.
unset PYTHONPATH PYTHONHOME R2CCL_LIBRARY R2CCL_VLLM R2CCL_SGLANG
export PYTHONNOUSERSITE=1 PIP_DISABLE_PIP_VERSION_CHECK=1

quiet "$python" -m venv "$venv"
py=$venv/bin/python
if "$py" -c 'import torch' >/dev/null 2>&1; then
  fail "torch imports in the new environment $venv, which must be without it"
fi

# pip's isolated build needs scikit-build-core from the index: without it the test cannot run.
if ! "$py" -m pip download -q --no-deps --retries 1 --timeout 30 -d "$work/probe" 'scikit-build-core>=0.10' \
  >"$log" 2>&1; then
  skip "pip cannot fetch scikit-build-core (is PyPI reachable?): $(tail -n 1 "$log")"
fi

build_start=$SECONDS
export CMAKE_CXX_COMPILER_LAUNCHER=${CMAKE_CXX_COMPILER_LAUNCHER:-$(command -v ccache || true)}
quiet "$py" -m pip wheel -q --no-deps -w "$work/wheels" "$root"
build_s=$((SECONDS - build_start))
wheels=("$work"/wheels/r2ccl-*.whl)
[[ ${#wheels[@]} -eq 1 && -f ${wheels[0]} ]] || fail "pip wheel made no single r2ccl wheel: $(ls "$work/wheels")"
wheel=${wheels[0]}
[[ $(basename "$wheel") == r2ccl-"$want"-* ]] || fail "the wheel $(basename "$wheel") is not version $want"
# No index: the wheel's dependencies, if it declared any, could not be installed.
quiet "$py" -m pip install -q --no-index "$wheel"

cd "$work"  # not the source tree: the package imported is the installed one
R2CCL_NICS=127.0.38.1,127.0.38.2 R2CCL_SOCKET_IFNAME=lo R2CCL_TIMEOUT=20s \
  "$py" - "$want" <<'PY' || fail "the installed package (above)"
import importlib.metadata
import pathlib
import sys

want = sys.argv[1]
import r2ccl

assert "torch" not in sys.modules, "importing r2ccl imported torch"
pkg = pathlib.Path(r2ccl.__file__).resolve().parent
assert pkg.is_relative_to(pathlib.Path(sys.prefix).resolve()), f"r2ccl came from {pkg}, not {sys.prefix}"
assert r2ccl.__version__ == want, f"r2ccl.__version__ is {r2ccl.__version__!r}; CMakeLists.txt says {want}"
assert importlib.metadata.version("r2ccl") == want, importlib.metadata.version("r2ccl")
dist = importlib.metadata.distribution("r2ccl")
needs = [r for r in dist.requires or [] if "extra ==" not in r]
assert not needs, f"the wheel requires {needs}"

# The entry points vLLM and SGLang load in every process: they import here (no vLLM, SGLang or
# torch) and do nothing unless enabled.
eps = importlib.metadata.entry_points()
for group in ("vllm.platform_plugins", "vllm.general_plugins", "sglang.srt.plugins"):
    found = [e for e in (eps.select(group=group) if hasattr(eps, "select") else eps.get(group, [])) if e.name == "r2ccl"]
    assert len(found) == 1, f"{group}: {found}"
    assert found[0].load()() is None, group
assert "torch" not in sys.modules, "loading the entry points imported torch"

from r2ccl import _lib

lib = _lib.library()
assert pathlib.Path(lib.path).resolve().parent.parent == pkg, f"loaded {lib.path}, not the bundled library"
version = r2ccl.library_version()
assert ".".join(map(str, version[:2])) == ".".join(want.split(".")[:2]), (version, want)

with r2ccl.KvEngine("wheel-test") as engine:
    assert engine.metadata(), "a KV engine with no metadata"
    try:
        engine.register_pool([bytearray(64)], layers=1, blocks=1, block_bytes=64, parts=1)
    except ModuleNotFoundError as e:
        assert e.name == "torch" and "PyTorch" in str(e) and "pip install torch" in str(e), str(e)
        print("register_pool without torch:", e)
    else:
        raise AssertionError("register_pool without torch did not fail")

comm = r2ccl.Communicator(unique_id=r2ccl.get_unique_id(), rank=0, world_size=1)
assert (comm.rank, comm.world_size) == (0, 1)
comm.barrier()
try:
    comm.all_reduce([1.0, 2.0])
except ModuleNotFoundError as e:
    assert e.name == "torch" and "PyTorch" in str(e) and "pip install torch" in str(e), str(e)
    print("all_reduce without torch:", e)
else:
    raise AssertionError("all_reduce without torch did not fail")
comm.close()
assert "torch" not in sys.modules
print(f"r2ccl {r2ccl.__version__} from {pkg}, libr2ccl {'.'.join(map(str, version))} from {lib.path}")
PY
# The console script is installed, and without its extra says what to install.
sb_rc=0
sb_out=$("$venv/bin/r2ccl-servebench" engine --url http://127.0.0.1:9 --model m 2>&1) || sb_rc=$?
[[ $sb_rc -eq 2 && $sb_out == *"engine mode needs aiohttp: pip install 'r2ccl[servebench]'"* ]] ||
  fail "r2ccl-servebench without aiohttp: exit $sb_rc: $sb_out"
echo "wheel_venv_test: $(basename "$wheel") installed into an empty $("$py" -V) environment and used" \
  "without torch ($((SECONDS - start)) s, ${build_s} s of it building the wheel)"
