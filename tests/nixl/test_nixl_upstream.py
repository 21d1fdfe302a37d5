"""NIXL's own tests against r2ccl's backend, and the plugin's installation.

- NIXL 1.4.0's Python suite (vendored unmodified in integrations/nixl/third_party/nixl-1.4.0)
  with `--backend R2CCL`, against the 1.4.0 wheel: 24 pass; the 2 that NIXL itself skips
  unconditionally (test_instantiate_all, test_incorrect_plugin_env) are the only skips.
- NIXL's two-peer example (`expanded_two_peers.py --backend R2CCL`): two processes exchange
  metadata through NIXL's listener, then prepped READs, WRITEs, a repost and notifications.
- `python -m r2ccl.nixl install` put the plugin beside NIXL's own in both wheel directories; the
  plugin's `nixlBackendEngine` vtable is as large as that of NIXL's bundled UCX plugin in each;
  and the plugin refuses to load into a NIXL wheel of another release, naming both versions.

Runs in the environment of `scripts/run vllm-test`. UCX_MODULES=^ib: NIXL's bundled UCX crashes
at process exit once its InfiniBand module loaded (libnl), on this machine with no IB device;
NIXL's suite creates UCX agents in test_nixl_bindings.py.
"""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NIXL_SRC = REPO / "integrations" / "nixl" / "third_party" / "nixl-1.4.0"
TIMEOUT_S = 300


def env(**extra):
    e = dict(os.environ)
    e.update({"UCX_MODULES": "^ib", "R2CCL_NICS": "lo", "PYTHONDONTWRITEBYTECODE": "1"})
    e.update(extra)
    return e


def test_nixl_python_suite_passes_with_the_r2ccl_backend(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "pytest", str(NIXL_SRC / "test" / "python"), "--backend", "R2CCL",
         "-q", "-rs", "-p", "no:cacheprovider", "--rootdir", str(tmp_path)],
        cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    out = r.stdout + r.stderr
    print(out[-3000:])
    assert r.returncode == 0, out[-6000:]
    m = re.search(r"(\d+) passed, (\d+) skipped", out)
    assert m and int(m.group(1)) == 24 and int(m.group(2)) == 2, out[-6000:]
    skips = re.findall(r"^SKIPPED \[1\] (\S+): (.*)$", out, re.M)
    assert sorted(s[0].rsplit(":", 1)[1] for s in skips) == ["242", "98"], out[-3000:]
    assert all(reason == "unconditional skip" for _, reason in skips), skips


def test_nixl_two_peer_example_with_the_r2ccl_backend(tmp_path):
    script = NIXL_SRC / "examples" / "python" / "expanded_two_peers.py"
    port = 20000 + os.getpid() % 20000
    common = ["--ip", "127.0.0.1", "--port", str(port), "--backend", "R2CCL"]
    target = subprocess.Popen([sys.executable, str(script), "--mode", "target", *common],
                              cwd=tmp_path, env=env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(3)  # the target's listener first, as NIXL's own instructions say
        init = subprocess.run([sys.executable, str(script), "--mode", "initiator", *common],
                              cwd=tmp_path, env=env(), capture_output=True, text=True,
                              timeout=120)
        t_out, _ = target.communicate(timeout=120)
    finally:
        if target.poll() is None:
            target.kill()
    i_out = init.stdout + init.stderr
    assert init.returncode == 0, i_out
    assert target.returncode == 0, t_out
    assert "Backend R2CCL was instantiated" in i_out and "Backend R2CCL was instantiated" in t_out
    assert "Initiator final data verification passed" in i_out, i_out
    assert "Target data verification passed" in t_out, t_out
    assert "Test Complete." in i_out and "Test Complete." in t_out


def wheel_dirs():
    import importlib.util
    out = {}
    for pkg in ("nixl_cu12", "nixl_cu13"):
        spec = importlib.util.find_spec(pkg)
        if spec is None:
            pytest.fail(f"{pkg} is not installed in {sys.prefix} (tests/vllm/requirements.txt "
                        "pins nixl-cu12 and nixl-cu13 1.4.0)")
        out[pkg] = Path(list(spec.submodule_search_locations)[0]).parent
    return out


def test_installed_beside_nixls_own_plugins_in_both_wheels():
    r = subprocess.run([sys.executable, "-m", "r2ccl.nixl", "status"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "built for NIXL 1.4.0" in r.stdout, r.stdout
    for pkg, site in wheel_dirs().items():
        plugins = site / f".{pkg}.mesonpy.libs" / "plugins"
        assert (plugins / "libplugin_R2CCL.so").is_file(), r.stdout
        assert (plugins / "libplugin_UCX.so").is_file(), r.stdout  # NIXL's own are still there
        assert re.search(rf"^{pkg} 1\.4\.0: .*\(R2CCL installed\)$", r.stdout, re.M), r.stdout


def vtable_size(lib: Path, dynamic: bool) -> int:
    """The size of `vtable for nixlBackendEngine` in a plugin (nm; -D for exported symbols)."""
    r = subprocess.run(["nm", "-C", "-S", *(["-D"] if dynamic else []), str(lib)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    sizes = [int(ln.split()[1], 16) for ln in r.stdout.splitlines()
             if ln.endswith(" vtable for nixlBackendEngine")]
    assert len(sizes) == 1, f"no vtable for nixlBackendEngine in {lib}"
    return sizes[0]


def test_backend_class_layout_matches_the_installed_nixl():
    # The plugin API version does not change with the class: the vtable the plugin was built
    # with must be the one NIXL's own bundled UCX plugin was built with, in every wheel.
    for pkg, site in wheel_dirs().items():
        plugins = site / f".{pkg}.mesonpy.libs" / "plugins"
        ucx = vtable_size(plugins / "libplugin_UCX.so", dynamic=True)
        ours = vtable_size(plugins / "libplugin_R2CCL.so", dynamic=False)
        print(f"{pkg}: vtable for nixlBackendEngine: UCX {ucx:#x}, R2CCL {ours:#x}")
        assert ours == ucx, (pkg, hex(ours), hex(ucx))


def test_refuses_to_load_into_another_nixl_release(tmp_path):
    # The installed cu13 wheel, hard-linked into a site directory whose dist-info says 1.5.1:
    # NIXL loads the plugin, and the plugin says no, naming both releases.
    site = wheel_dirs()["nixl_cu13"]
    fake = tmp_path / "site"
    fake.mkdir()
    for name in ("nixl_cu13", ".nixl_cu13.mesonpy.libs", "nixl_cu13.libs"):
        src = site / name
        if src.exists():
            r = subprocess.run(["cp", "-al", str(src), str(fake / name)], capture_output=True,
                               text=True, timeout=120)
            if r.returncode != 0:  # another file system: a copy
                shutil.copytree(src, fake / name, symlinks=True)
    (fake / "nixl_cu13-1.5.1.dist-info").mkdir()
    (fake / "nixl_cu13-1.5.1.dist-info" / "METADATA").write_text("Name: nixl-cu13\nVersion: 1.5.1\n")
    probe = ("import nixl_cu13._bindings as b, nixl_cu13\n"
             "print('from', nixl_cu13.__file__)\n"
             "a = b.nixlAgent('x', b.nixlAgentConfig(False))\n"
             "try:\n"
             "    a.createBackend('R2CCL', {})\n"
             "    print('created')\n"
             "except Exception as e:\n"
             "    print('refused', type(e).__name__)\n")
    r = subprocess.run([sys.executable, "-c", probe], env=env(PYTHONPATH=str(fake)),
                       capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert f"from {fake}" in out, out
    assert "refused" in out and "created" not in out, out
    assert re.search(r"built for NIXL 1\.4\.0 and does not load into NIXL 1\.5\.1", out), out
