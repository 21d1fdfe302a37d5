"""r2ccl's SGLang plugin against SGLang 0.5.23 (the wheel installed without its GPU dependencies):
each hook takes the parameters of the GroupCoordinator method it wraps, and in two processes a
real GroupCoordinator of SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1), built after SGLang
loaded its plugins, carries its all-reduce,
all-gather and reduce-scatter over r2ccl (its rail counters grow), every element checked. Runs
where SGLang is installed (scripts/run vllm-test)."""

import importlib.metadata
import inspect
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("sglang.srt.distributed.parallel_state", reason="SGLang is not installed here (scripts/run vllm-test installs it)")

import r2ccl  # noqa: E402


def test_the_installed_sglang_is_the_version_the_hooks_follow():
    from r2ccl.sglang import SGLANG_VERSION

    assert importlib.metadata.version("sglang") == SGLANG_VERSION


def test_every_hook_takes_the_parameters_of_the_method_it_wraps():
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    from r2ccl.sglang import hooks

    for name, hook in hooks.AROUND.items():
        theirs = list(inspect.signature(getattr(GroupCoordinator, name)).parameters)
        ours = list(inspect.signature(hook).parameters)
        assert ours[0] == "original" and ours[1:] == theirs, f"{name}: {ours} vs {theirs}"
    assert callable(GroupCoordinator.destroy)


def test_the_entry_point_is_installed_and_inert_unless_enabled(monkeypatch):
    eps = importlib.metadata.entry_points().select(group="sglang.srt.plugins")
    assert "r2ccl.sglang.plugin:register" in [e.value for e in eps]
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    from r2ccl.sglang import plugin

    before = GroupCoordinator.all_reduce
    monkeypatch.delenv("R2CCL_SGLANG", raising=False)
    plugin.register()
    assert GroupCoordinator.all_reduce is before


RANK = textwrap.dedent(
    """
    import re, sys, urllib.request
    import torch, torch.distributed as dist
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    g = GroupCoordinator([[0, 1]], rank, "gloo", use_pynccl=False, use_mscclpp=False,
                         use_custom_allreduce=False, use_torch_symm_mem_all_reduce=False,
                         use_hpu_communicator=False, use_xpu_communicator=False, group_name="tp")
    assert g._r2ccl is not None and g._r2ccl.world_size == 2

    x = (torch.arange(4096) % 61 + rank).to(torch.bfloat16)
    y = g.all_reduce(x)
    assert torch.equal(y, ((torch.arange(4096) % 61) * 2 + 1).to(torch.bfloat16)), y

    part = torch.arange(1000, dtype=torch.float32) + 10000 * rank
    out = torch.empty(2000)
    g.all_gather_into_tensor(out, part)
    assert torch.equal(out, torch.cat([torch.arange(1000.0), torch.arange(1000.0) + 10000])), out

    # Block b carries b * 1000, so a block delivered to the wrong rank shows.
    whole = torch.cat([torch.full((500,), float(rank + 1 + 1000 * b)) for b in range(2)])
    mine = torch.empty(500)
    g.reduce_scatter_tensor(mine, whole)
    assert torch.equal(mine, torch.full((500,), float(3 + 2000 * rank))), mine

    with urllib.request.urlopen(f"http://127.0.0.1:{int(sys.argv[3]) + rank}/metrics", timeout=5) as r:
        text = r.read().decode()
    sent = sum(float(v) for v in re.findall(r"^r2ccl_rail_tx_bytes_total{[^}]*} (\\S+)$", text, re.M))
    assert sent >= 4096 * 2 / 2 + 1000 * 4 / 2, sent
    g.destroy()
    dist.destroy_process_group()
    print("ok", rank, int(sent))
    """
)


def test_sglangs_tp_group_carries_its_collectives_over_r2ccl(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    # SGLANG_USE_CPU_ENGINE=1: SGLang's CPU engine, whose collectives take host tensors.
    env = dict(os.environ, R2CCL_SGLANG="1", R2CCL_NICS="127.0.35.1,127.0.35.2", R2CCL_METRICS_PORT="19470",
               R2CCL_SOCKET_IFNAME="lo", SGLANG_PLUGINS="r2ccl", SGLANG_USE_CPU_ENGINE="1")
    # The r2ccl this test imported: the source tree's, or the installed one.
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(r2ccl.__file__)), env.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / "store"), "19470"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
        for r in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, out[-4000:]
        assert f"ok {rank}" in out, out[-4000:]
