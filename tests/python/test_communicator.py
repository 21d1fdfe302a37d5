"""r2ccl.Communicator with CPU tensors: every method, each result checked element by element;
bad input answered with an exception that names what was wrong, the communicator usable after."""

import os
import pathlib
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import r2ccl
from conftest import run_ranks

pytestmark = pytest.mark.usefixtures("rails")


def comms(n: int):
    uid = r2ccl.get_unique_id()
    return run_ranks(n, lambda r: r2ccl.Communicator(unique_id=uid, rank=r, world_size=n))


def each(cs, body):
    return run_ranks(len(cs), lambda r: body(r, cs[r]))


def close_all(cs):
    for c in cs:
        c.close()


def test_identity_and_version():
    cs = comms(3)
    assert [(c.rank, c.world_size) for c in cs] == [(0, 3), (1, 3), (2, 3)]
    assert r2ccl.library_version()[:2] == (0, 2)
    assert "rank 1 of 3" in repr(cs[1])
    close_all(cs)
    assert cs[0].closed and "closed" in repr(cs[0])


def test_the_package_version_is_cmakes():
    """r2ccl.__version__ is CMakeLists.txt's project version, from the source tree or installed
    from it (the metadata pip wrote)."""
    import re

    cmake = (pathlib.Path(__file__).resolve().parents[2] / "CMakeLists.txt").read_text()
    assert r2ccl.__version__ == re.search(r"project\(r2ccl VERSION ([0-9.]+)", cmake)[1]
    assert r2ccl.library_version()[:2] == tuple(int(v) for v in r2ccl.__version__.split(".")[:2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64, torch.uint8])
def test_all_reduce_sum_out_of_place_never_writes_the_input(dtype):
    cs = comms(2)

    def body(r, c):
        x = (torch.arange(1000) % 50 + r).to(dtype)
        keep = x.clone()
        y = c.all_reduce(x)
        assert torch.equal(x, keep), "all_reduce wrote its input"
        return y

    ys = each(cs, body)
    want = ((torch.arange(1000) % 50) * 2 + 1).to(dtype)
    for y in ys:
        assert y.dtype == dtype and torch.equal(y, want)
    close_all(cs)


def test_all_reduce_ops_in_place_and_into_output():
    cs = comms(3)

    def body(r, c):
        x = torch.tensor([1.0, 2.0, 3.0]) * (r + 1)
        out = {}
        for op in ("sum", "prod", "max", "min", "avg"):
            out[op] = c.all_reduce(x, op=op)
        out["ReduceOp.MAX"] = c.all_reduce(x, op=torch.distributed.ReduceOp.MAX)
        y = torch.empty(3)
        assert c.all_reduce(x, output=y) is y
        out["into"] = y
        z = x.clone()
        assert c.all_reduce(z, output=z) is z
        out["in place"] = z
        return out

    base = torch.tensor([1.0, 2.0, 3.0])
    for out in each(cs, body):
        assert torch.equal(out["sum"], base * 6)
        assert torch.equal(out["prod"], base**3 * 6)
        assert torch.equal(out["max"], base * 3)
        assert torch.equal(out["ReduceOp.MAX"], base * 3)
        assert torch.equal(out["min"], base)
        assert torch.allclose(out["avg"], base * 2)
        assert torch.equal(out["into"], base * 6)
        assert torch.equal(out["in place"], base * 6)
    close_all(cs)


def test_all_gather_reduce_scatter_broadcast_reduce_barrier():
    n = 3
    cs = comms(n)

    def body(r, c):
        x = torch.arange(8, dtype=torch.float32).reshape(2, 4) + 100 * r
        gathered = c.all_gather(x)
        # Block p of the input carries p * 1000, so a block sent to the wrong rank shows.
        rs_in = torch.cat([torch.full((2,), float(r + 1 + 1000 * p)) for p in range(n)])
        scattered = c.reduce_scatter(rs_in)
        b = torch.full((5,), float(r))
        c.broadcast(b, src=2)
        reduced = c.reduce(torch.full((4,), float(r + 1)), op="max", root=1)
        c.barrier()
        return gathered, scattered, b, reduced

    for r, (gathered, scattered, b, reduced) in enumerate(each(cs, body)):
        assert gathered.shape == (6, 4)
        want = torch.cat([torch.arange(8, dtype=torch.float32).reshape(2, 4) + 100 * p for p in range(n)])
        assert torch.equal(gathered, want)
        assert torch.equal(scattered, torch.full((2,), float(6 + 3000 * r)))
        assert torch.equal(b, torch.full((5,), 2.0))
        if r == 1:
            assert torch.equal(reduced, torch.full((4,), 3.0))
    close_all(cs)


def test_send_recv_and_a_grouped_ring_past_the_eager_limit():
    n = 3
    cs = comms(n)

    def body(r, c):
        if r == 0:
            c.send(torch.arange(10, dtype=torch.int64), 1)
        got = None
        if r == 1:
            got = c.recv(torch.empty(10, dtype=torch.int64), 0)
        out = torch.arange(100_000, dtype=torch.int32) + r * 1_000_000
        into = torch.empty_like(out)
        with c.group():
            c.send(out, (r + 1) % n)
            c.recv(into, (r - 1) % n)
        return got, into

    for r, (got, into) in enumerate(each(cs, body)):
        if r == 1:
            assert torch.equal(got, torch.arange(10, dtype=torch.int64))
        assert torch.equal(into, torch.arange(100_000, dtype=torch.int32) + ((r - 1) % n) * 1_000_000)
    close_all(cs)


def test_bad_input_names_what_was_wrong_and_the_communicator_still_works():
    cs = comms(2)

    def body(r, c):
        x = torch.ones(6)
        with pytest.raises(TypeError, match=r"input has dtype torch.int8, which r2ccl does not move"):
            c.all_reduce(torch.ones(6, dtype=torch.int8))
        with pytest.raises(ValueError, match=r"input is on meta; r2ccl moves CPU and CUDA tensors"):
            c.all_reduce(torch.ones(6, device="meta"))
        with pytest.raises(ValueError, match=r"input is not contiguous \(shape \(3, 2\), stride \(1, 3\)\)"):
            c.all_reduce(torch.ones(2, 3).t())
        with pytest.raises(ValueError, match=r"output has 5 elements; all_gather of the input needs 12"):
            c.all_gather(x, output=torch.empty(5))
        with pytest.raises(TypeError, match=r"output has dtype torch.float64 but input has torch.float32"):
            c.all_reduce(x, output=torch.empty(6, dtype=torch.float64))
        with pytest.raises(ValueError, match=r"input has 5 elements, not a multiple of the 2 ranks"):
            c.reduce_scatter(torch.ones(5))
        with pytest.raises(TypeError, match=r"input must be a torch.Tensor, not list"):
            c.all_reduce([1.0, 2.0])
        with pytest.raises(ValueError, match=r"op 'median' is not a reduction"):
            c.all_reduce(x, op="median")
        with pytest.raises(r2ccl.R2cclError, match=r"Send failed \(r2cclInvalidArgument\): .*7") as e:
            c.send(x, 7)
        assert e.value.code == 4 and e.value.code_name == "r2cclInvalidArgument"
        return c.all_reduce(x * (r + 1))

    for y in each(cs, body):
        assert torch.equal(y, torch.full((6,), 3.0))
    close_all(cs)


def test_a_closed_communicator_refuses_every_call():
    cs = comms(2)
    close_all(cs)
    for c in cs:
        with pytest.raises(r2ccl.R2cclError, match="the communicator is closed"):
            c.all_reduce(torch.ones(2))
        with pytest.raises(r2ccl.R2cclError, match="the communicator is closed"):
            c.barrier()
        c.close()  # twice is harmless


def test_ranks_calling_different_operations_both_fail_naming_the_mismatch(monkeypatch):
    monkeypatch.setenv("R2CCL_CHECK", "1")
    cs = comms(2)

    def body(r, c):
        with pytest.raises(r2ccl.R2cclError, match="mismatch") as e:
            if r == 0:
                c.all_reduce(torch.ones(8))
            else:
                c.all_gather(torch.ones(4))
        return str(e.value)

    texts = each(cs, body)
    assert all("all" in t for t in texts), texts
    # Both ranks agree again: the communicator carries on.
    ys = each(cs, lambda r, c: c.all_reduce(torch.ones(4) * r))
    assert all(torch.equal(y, torch.ones(4)) for y in ys)
    close_all(cs)


def test_split_register_and_async_error():
    cs = comms(3)

    def body(r, c):
        sub = c.split(-1 if r == 1 else 0)
        got = None
        if sub is not None:
            got = (sub.rank, sub.world_size, sub.all_reduce(torch.full((3,), float(r))))
            sub.close()
        t = torch.full((16,), float(r + 1))
        h = c.register(t)
        y = c.all_reduce(t)
        c.deregister(h)
        return sub is None, got, y, c.async_error()

    for r, (none, got, y, err) in enumerate(each(cs, body)):
        assert none == (r == 1)
        if r != 1:
            assert got[:2] == (r // 2, 2) and torch.equal(got[2], torch.full((3,), 2.0))
        assert torch.equal(y, torch.full((16,), 6.0))
        assert err is None
    close_all(cs)


def test_a_cached_registration_dropped_and_the_memory_used_again():
    cs = comms(2)

    def body(r, c):
        t = torch.full((1 << 18,), float(r + 1))  # 1 MiB: its registration is cached
        first = c.all_reduce(t).clone()
        c.invalidate_cache(t)
        t.copy_(torch.arange(1 << 18, dtype=torch.float32) * (r + 1))
        c.all_reduce(t, t)
        with pytest.raises(TypeError, match="tensor"):
            c.invalidate_cache("not a tensor")
        return first, t

    for first, t in each(cs, body):
        assert torch.equal(first, torch.full((1 << 18,), 3.0))
        assert torch.equal(t, torch.arange(1 << 18, dtype=torch.float32) * 3)
    close_all(cs)


def test_abort_from_another_thread_ends_a_blocked_receive():
    cs = comms(2)
    errors = []

    def receive():
        try:
            cs[0].recv(torch.empty(4), 1)  # rank 1 never sends
        except r2ccl.R2cclError as e:
            errors.append(e)

    t = threading.Thread(target=receive, daemon=True)
    t.start()
    time.sleep(0.3)
    cs[0].abort()
    t.join(30)
    assert not t.is_alive(), "the receive did not end after the abort"
    assert len(errors) == 1
    with pytest.raises(r2ccl.R2cclError, match="closed"):
        cs[0].barrier()
    cs[1].close()


def test_the_argument_forms_are_checked():
    with pytest.raises(ValueError, match="exactly one of"):
        r2ccl.Communicator()
    with pytest.raises(ValueError, match="the 128 bytes"):
        r2ccl.Communicator(unique_id=b"short", rank=0, world_size=1)
    with pytest.raises(ValueError, match="needs rank and world_size"):
        r2ccl.Communicator(unique_id=bytes(128))


def test_own_nccl_is_r2ccl_gpu_nccl_while_the_communicator_is_made(monkeypatch):
    uids = [r2ccl.get_unique_id() for _ in range(4)]  # ids are made under the caller's variables
    # libr2ccl reads R2CCL_GPU_NCCL when a communicator is made: a bad value fails there...
    monkeypatch.setenv("R2CCL_GPU_NCCL", "maybe")
    with pytest.raises(r2ccl.R2cclError, match="R2CCL_GPU_NCCL.*0 or 1"):
        r2ccl.Communicator(unique_id=uids[0], rank=0, world_size=1)
    # ...own_nccl overrides it while this one is made, and leaves it as it was.
    for uid, own in zip(uids[1:3], (False, True)):
        c = r2ccl.Communicator(unique_id=uid, rank=0, world_size=1, own_nccl=own)
        assert os.environ["R2CCL_GPU_NCCL"] == "maybe"
        y = c.all_reduce(torch.arange(10.0))
        assert torch.equal(y, torch.arange(10.0))
        c.close()
    monkeypatch.delenv("R2CCL_GPU_NCCL")
    c = r2ccl.Communicator(unique_id=uids[3], rank=0, world_size=1, own_nccl=False)
    assert "R2CCL_GPU_NCCL" not in os.environ
    c.close()


def r2ccl_dir():
    """Where the r2ccl this test imported lives (the source tree's, or the installed one)."""
    return pathlib.Path(r2ccl.__file__).resolve().parents[1]


PROCESS_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[1])
    import r2ccl
    rank = int(os.environ["RANK"])
    if sys.argv[2] == "group":
        dist.init_process_group("gloo", init_method="file://" + sys.argv[3], rank=rank, world_size=2)
        c = r2ccl.Communicator(dist.group.WORLD)
    else:
        c = r2ccl.Communicator(from_env=True)
    y = c.all_reduce(torch.full((1000,), float(rank + 1)))
    assert torch.equal(y, torch.full((1000,), 3.0)), y
    print("ok", c.rank, c.world_size)
    c.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    """
)


@pytest.mark.parametrize("how", ["group", "env"])
def test_two_processes_from_a_gloo_group_or_the_environment(tmp_path, how):
    script = tmp_path / "rank.py"
    script.write_text(PROCESS_SCRIPT)
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank))
        if how == "env":
            env.update(R2CCL_RANK=str(rank), R2CCL_NRANKS="2", R2CCL_BOOTSTRAP="127.0.0.1:29611")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(r2ccl_dir()), how, str(tmp_path / "store")],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
        )
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, out
        assert f"ok {rank} 2" in out, out


AGREE_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[1])
    from r2ccl import _lib, _tensors
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
    lib = _lib.library()
    # Per case: each rank's libr2ccl with CUDA, R2CCL_GPU_NCCL set, the engine's NCCL.
    cases = [((1, 1), (0, 0), True), ((1, 0), (0, 0), True), ((0, 1), (0, 0), False),
             ((1, 1), (1, 0), True), ((1, 1), (0, 1), True), ((1, 1), (0, 0), False)]
    for cuda, env, engine in cases:
        lib.cuda = bool(cuda[rank])
        os.environ.pop("R2CCL_GPU_NCCL", None)
        if env[rank]:
            os.environ["R2CCL_GPU_NCCL"] = "1"
        print("agreed", cuda, env, engine, _tensors.agree_on_cuda(True, engine, dist.group.WORLD))
    # Off CUDA nothing is agreed: one rank alone asks, and the group stays in step.
    if rank == 0:
        print("off", _tensors.agree_on_cuda(False, True, dist.group.WORLD))
    x = torch.tensor([rank + 1])
    dist.all_reduce(x)
    print("in step", int(x))
    # Gloo's threads go before the interpreter does (left to its finalization, they may abort it).
    dist.destroy_process_group()
    """
)


def test_engines_agree_whether_r2ccl_takes_cuda_tensors_and_keeps_nccl(tmp_path):
    """r2ccl on an engine's GPU group: it takes the CUDA tensors only where every rank's libr2ccl
    has CUDA, and leaves NCCL's calls to the engine only where no rank set R2CCL_GPU_NCCL; every
    rank comes to the same answer even where their libraries or environments differ."""
    script = tmp_path / "agree.py"
    script.write_text(AGREE_SCRIPT)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r2ccl_dir()), str(tmp_path / "store")],
            env=dict(os.environ, RANK=str(rank)), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    want = [
        "agreed (1, 1) (0, 0) True (True, True)",
        "agreed (1, 0) (0, 0) True (False, False)",
        "agreed (0, 1) (0, 0) False (False, False)",
        "agreed (1, 1) (1, 0) True (True, False)",
        "agreed (1, 1) (0, 1) True (True, False)",
        "agreed (1, 1) (0, 0) False (True, False)",
    ]
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, out
        lines = out.splitlines()
        assert [line for line in lines if line.startswith("agreed")] == want, out
        assert ("off (False, False)" in lines) == (rank == 0), out
        assert "in step 3" in lines, out


WITHOUT_TORCH_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["torch"] = None  # import torch fails, as where it is not installed
    sys.path.insert(0, sys.argv[1])
    import r2ccl
    with r2ccl.KvEngine("no-torch") as e:
        assert e.metadata()
        try:
            e.register_pool([bytearray(64)], layers=1, blocks=1, block_bytes=64, parts=1)
        except ModuleNotFoundError as err:
            print("register_pool:", err.name, err)
    c = r2ccl.Communicator(unique_id=r2ccl.get_unique_id(), rank=0, world_size=1)
    c.barrier()
    try:
        c.all_reduce([1.0, 2.0])
    except ModuleNotFoundError as err:
        print("all_reduce:", err.name, err)
    c.close()
    print("version", r2ccl.__version__)
    """
)


def test_without_torch_r2ccl_imports_and_a_tensor_call_says_how_to_install_it(tmp_path):
    """Where torch is not installed: r2ccl imports, the calls without tensors work (a KV engine, a
    one-rank communicator's barrier), and a call that takes a tensor raises ModuleNotFoundError
    naming PyTorch and `pip install torch`. (tests/python/wheel_venv_test.sh: the same, installed.)"""
    script = tmp_path / "no_torch.py"
    script.write_text(WITHOUT_TORCH_SCRIPT)
    p = subprocess.run(
        [sys.executable, str(script), str(r2ccl_dir())],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120,
    )
    assert p.returncode == 0, p.stdout
    for call, what in (("register_pool", "register_pool's buffers"), ("all_reduce", "input")):
        assert f"{call}: torch r2ccl: {what} must be" in p.stdout, p.stdout
    assert p.stdout.count("but PyTorch (torch) is not installed") == 2, p.stdout
    assert p.stdout.count("install it with `pip install torch`") == 2, p.stdout
    assert f"version {r2ccl.__version__}" in p.stdout, p.stdout


def test_a_successful_call_does_not_fetch_the_error_text():
    """The library's last-error text (a lock and a copy) is read only for a failed call."""
    cs = comms(2)
    lib = r2ccl._lib.library()
    real, asked = lib.r2cclGetLastError, []

    def counted(handle):
        asked.append(handle)
        return real(handle)

    lib.r2cclGetLastError = counted
    try:
        each(cs, lambda r, c: c.all_reduce(torch.ones(16), torch.empty(16)))
        assert asked == []
    finally:
        lib.r2cclGetLastError = real
    close_all(cs)


def test_the_library_is_loaded_once_whatever_the_threads(monkeypatch):
    from r2ccl import _lib

    made = []
    real = _lib.Library

    def slow_library():
        time.sleep(0.05)  # widens the window two first calls share
        lib = real()
        made.append(lib)
        return lib

    monkeypatch.setattr(_lib, "_library", None)
    monkeypatch.setattr(_lib, "Library", slow_library)
    start = threading.Barrier(8)
    got = []

    def first_use():
        start.wait(timeout=30)
        got.append(_lib.library())

    threads = [threading.Thread(target=first_use) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(made) == 1 and len(got) == 8 and all(g is made[0] for g in got)
