#!/usr/bin/env python3
"""r2ccl's Python package on CUDA tensors, one process per GPU (ranks from R2CCL_RANK /
R2CCL_NRANKS / R2CCL_BOOTSTRAP over loopback, as bench/gpu/allreduce.sh starts r2ccl-gpu-perf).

  --check  every collective (all_reduce, all_gather, reduce_scatter, broadcast, reduce, send/recv)
           x dtype x size, in place and out of place, eager and replayed under torch.cuda.graph;
           every element compared with the exact result computed on the CPU; then the vLLM
           communicators' operations (r2ccl.vllm.ops) on CUDA tensors against NCCL
  --bench  bf16 sum all_reduce replayed from a torch.cuda.graph, measured the way r2ccl-gpu-perf
           and torch_baseline.py measure (a graph of --calls calls, CUDA events around the
           replays); with --cxx FILE (r2ccl-gpu-perf --bench's output of the same run), the ratio
           of Python to C++ per size

usage: bench/gpu/torch_r2ccl.py [--check] [--bench] [--min 8K] [--max 512M] [--cxx FILE]
Needs libr2ccl built with CUDA: R2CCL_LIBRARY, and integrations/python on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.multiprocessing as mp

from ports import free_port
from torch_baseline import parse_size, timed

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64,
          torch.uint8]
COUNTS = [0, 1, 7, 1000, 65536 + 5, (3 << 17) + 7]


def values(n: int, rank: int, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
    """Small whole numbers (quarters for floats), distinct per rank: every sum is exact."""
    k = (torch.arange(offset, offset + n, dtype=torch.int64) * 7919 + rank * 104729) % 15
    if dtype == torch.uint8:
        return k.to(dtype)
    if dtype.is_floating_point:
        return ((k - 7).to(torch.float64) * 0.25).to(dtype)
    return (k - 7).to(dtype)


def summed(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    acc = torch.zeros_like(parts[0], dtype=torch.float64 if dtype.is_floating_point else torch.int64)
    for p in parts:
        acc += p.to(acc.dtype)
    return acc.to(dtype) if dtype != torch.uint8 else (acc % 256).to(dtype)


def check(comm, rank: int, world: int, dev: torch.device) -> int:
    wrong = cases = 0
    root, nxt, prv = world - 1, (rank + 1) % world, (rank - 1) % world
    for op in ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "send_recv"]:
        if op == "send_recv" and world == 1:
            continue
        for dtype in DTYPES:
            for n in COUNTS:
                for graph in (False, True):
                    for in_place in (False, True):
                        if in_place and op in ("send_recv", "broadcast"):
                            continue
                        cases += 1
                        np_ = n * world
                        if op == "reduce_scatter":
                            src = values(np_, rank, dtype).to(dev)
                            want = summed([values(np_, r, dtype)[rank * n:(rank + 1) * n]
                                           for r in range(world)], dtype)
                            out = src[rank * n:(rank + 1) * n] if in_place else torch.empty(n, dtype=dtype, device=dev)
                        elif op == "all_gather":
                            big = torch.zeros(np_, dtype=dtype, device=dev)
                            src = big[rank * n:(rank + 1) * n] if in_place else values(n, rank, dtype).to(dev)
                            if in_place:
                                src.copy_(values(n, rank, dtype).to(dev))
                            want = torch.cat([values(n, r, dtype) for r in range(world)])
                            out = big if in_place else torch.empty(np_, dtype=dtype, device=dev)
                        else:
                            src = values(n, rank, dtype).to(dev)
                            out = src if in_place else torch.zeros(n, dtype=dtype, device=dev)
                            if op == "all_reduce" or (op == "reduce" and rank == root):
                                want = summed([values(n, r, dtype) for r in range(world)], dtype)
                            elif op == "reduce":
                                want = src.cpu().clone() if in_place else torch.zeros(n, dtype=dtype)
                            elif op == "broadcast":
                                want = values(n, root, dtype)
                                out = src
                            else:
                                want = values(n, prv, dtype)
                        initial = src.clone()

                        def call():
                            if op == "all_reduce":
                                comm.all_reduce(src, output=out)
                            elif op == "all_gather":
                                comm.all_gather(src, output=out)
                            elif op == "reduce_scatter":
                                comm.reduce_scatter(src, output=out)
                            elif op == "broadcast":
                                comm.broadcast(src, root)
                            elif op == "reduce":
                                comm.reduce(src, output=out, root=root)
                            else:
                                with comm.group():
                                    comm.send(src, nxt)
                                    comm.recv(out, prv)

                        if graph:
                            g = torch.cuda.CUDAGraph()
                            with torch.cuda.graph(g):
                                call()
                            src.copy_(initial)  # capture ran nothing; the replay runs it
                            g.replay()
                        else:
                            call()
                        torch.cuda.synchronize()
                        got = out.cpu()
                        if not torch.equal(got, want):
                            wrong += 1
                            bad = (got != want).nonzero()
                            print(f"rank {rank}: {op} {dtype} count {n} "
                                  f"{'graph' if graph else 'eager'} "
                                  f"{'in place' if in_place else 'out of place'}: "
                                  f"{bad.numel()} wrong, first at {bad[0].item()}", flush=True)
    total = torch.tensor([wrong], dtype=torch.int32)
    comm.all_reduce(total, output=total)
    if rank == 0:
        print(f"python check: {world} ranks, {cases} cases per rank (collectives x dtypes x sizes x "
              f"eager/torch.cuda.graph x in place/out of place): "
              f"{'every element right' if total.item() == 0 else f'{total.item()} cases WRONG'}",
              flush=True)
    return int(total.item() != 0)


class TorchPath:
    """The engine's own path, which r2ccl's engine communicators fall back to: the same calls over
    torch.distributed's NCCL group. Counts every call, so the check sees which path ran."""

    def __init__(self, device_group) -> None:
        self.device_group = device_group
        self.fallbacks = 0

    def all_reduce(self, x):
        self.fallbacks += 1
        out = x.clone()
        torch.distributed.all_reduce(out, group=self.device_group)
        return out

    def all_gather(self, x, dim=-1):
        self.fallbacks += 1
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, x, dim=-1):
        self.fallbacks += 1
        chunks = [c.contiguous() for c in x.chunk(self.world_size, dim=dim)]
        out = torch.empty_like(chunks[self.rank_in_group])
        torch.distributed.reduce_scatter(out, chunks, group=self.device_group)
        return out

    def broadcast(self, t, src=0):
        self.fallbacks += 1
        torch.distributed.broadcast(t, src=src, group=self.device_group)
        return t

    def send(self, t, dst=None):
        self.fallbacks += 1
        torch.distributed.send(t, dst, group=self.device_group)

    def recv(self, size, dtype, src=None):
        self.fallbacks += 1
        t = torch.empty(size, dtype=dtype, device=self.device)
        torch.distributed.recv(t, src, group=self.device_group)
        return t

    def destroy(self):
        pass


def check_engine_ops(rank: int, world: int, dev: torch.device, port: int) -> int:
    """The vLLM communicators' operations (r2ccl.vllm.ops.R2cclOps, shared by the CPU and CUDA
    classes) on CUDA tensors, eager and under torch.cuda.graph, against the engine's own path
    (NCCL through torch.distributed); every call must be r2ccl's."""
    import torch.distributed as dist
    from r2ccl.vllm.ops import R2cclOps

    class Ops(R2cclOps, TorchPath):
        pass

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    nccl = dist.new_group(backend="nccl")
    ops = Ops(nccl)
    ops.cpu_group, ops.world_size, ops.rank_in_group = dist.group.WORLD, world, rank
    ops.unique_name, ops.device = "tp:0", dev
    ops._start_r2ccl(dev)
    wrong = cases = 0
    x = values(6 * world * 1000, rank, torch.bfloat16).reshape(6 * world, 1000).to(dev)
    calls = {
        "all_reduce": lambda: ops.all_reduce(x),
        "all_gather dim -1": lambda: ops.all_gather(x, -1),
        "all_gather dim 0": lambda: ops.all_gather(x, 0),
        "reduce_scatter dim 0": lambda: ops.reduce_scatter(x, 0),
        "reduce_scatter dim -1": lambda: ops.reduce_scatter(x[:, : 250 * world], -1),
    }
    references = {
        "all_reduce": lambda: TorchPath.all_reduce(ops, x),
        "all_gather dim -1": lambda: TorchPath.all_gather(ops, x, -1),
        "all_gather dim 0": lambda: TorchPath.all_gather(ops, x, 0),
        "reduce_scatter dim 0": lambda: TorchPath.reduce_scatter(ops, x, 0),
        "reduce_scatter dim -1": lambda: TorchPath.reduce_scatter(ops, x[:, : 250 * world], -1),
    }
    for name, call in calls.items():
        want = references[name]()
        ops.fallbacks = 0
        eager = call()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            captured = call()
        g.replay()
        torch.cuda.synchronize()
        for how, got in (("eager", eager), ("graph", captured)):
            cases += 1
            if ops.fallbacks or not torch.equal(got, want):
                wrong += 1
                print(f"rank {rank}: engine {name} {how}: "
                      f"{'took the engine path' if ops.fallbacks else 'differs from NCCL'}",
                      flush=True)
    b = values(4097, rank, torch.float32).to(dev)
    ops.fallbacks = 0
    ops.broadcast(b, world - 1)
    cases += 1
    if ops.fallbacks or not torch.equal(b.cpu(), values(4097, world - 1, torch.float32)):
        wrong += 1
        print(f"rank {rank}: engine broadcast wrong", flush=True)
    ops.destroy()
    engine_wrong, engine_cases = check_engine_nccl(rank, world, dev, nccl)
    wrong += engine_wrong
    cases += engine_cases
    dist.destroy_process_group()
    if rank == 0:
        print(f"engine ops check: {world} ranks, {cases} cases per rank (vLLM's communicator "
              f"operations on CUDA tensors, eager and under torch.cuda.graph, against NCCL; "
              f"with the engine's NCCL taking device point to point and large all-reduces, vLLM's "
              f"and SGLang's): "
              f"{'every element right' if wrong == 0 else f'{wrong} cases WRONG on rank 0'}",
              flush=True)
    return int(wrong != 0)


def check_engine_nccl(rank: int, world: int, dev: torch.device, nccl) -> tuple[int, int]:
    """R2cclOps made with engine_nccl (as vLLM's CUDA communicator makes it): r2ccl's GPU side
    has no NCCL communicator; small all-reduces are r2ccl's, all-reduces from ENGINE_NCCL_FROM
    and device send/recv take the engine's path, and r2ccl's own device send says why it cannot
    run. Returns (wrong, cases)."""
    from r2ccl._tensors import ENGINE_NCCL_FROM
    from r2ccl.vllm.ops import R2cclOps

    class Ops(R2cclOps, TorchPath):
        pass

    ops = Ops(nccl)
    ops.cpu_group, ops.world_size, ops.rank_in_group = torch.distributed.group.WORLD, world, rank
    ops.unique_name, ops.device = "tp:0", dev
    ops._start_r2ccl(dev, engine_nccl=True)
    wrong = cases = 0

    def expect(name: str, ok: bool) -> None:
        nonlocal wrong, cases
        cases += 1
        if not ok:
            wrong += 1
            print(f"rank {rank}: engine_nccl {name} wrong", flush=True)

    expect("made without R2CCL_GPU_NCCL left set",
           ops.engine_nccl and "R2CCL_GPU_NCCL" not in os.environ)
    for n, engine in ((4096, False), (ENGINE_NCCL_FROM // 2, True)):
        x = values(n, rank, torch.bfloat16).to(dev)
        want = TorchPath.all_reduce(ops, x)
        ops.fallbacks = 0
        got = ops.all_reduce(x)
        torch.cuda.synchronize()
        expect(f"all_reduce of {n * 2} bytes", ops.fallbacks == int(engine) and
               torch.equal(got, want))
    t = values(1000, rank, torch.float32).to(dev)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    ops.fallbacks = 0
    if rank % 2 == 0:
        ops.send(t, nxt)
        got = ops.recv(t.shape, t.dtype, prv)
    else:
        got = ops.recv(t.shape, t.dtype, prv)
        ops.send(t, nxt)
    torch.cuda.synchronize()
    expect("send/recv", ops.fallbacks == 2 and
           torch.equal(got.cpu(), values(1000, prv, torch.float32)))
    try:
        ops.r2ccl.send(t, nxt)
        error = ""
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        error = str(e)
    expect(f"r2ccl's own device send refused ({error!r})",
           "R2CCL_GPU_NCCL=0" in error and "point to point" in error)
    ops.destroy()

    # Rank 0 alone has R2CCL_GPU_NCCL set: every rank keeps r2ccl's NCCL, and a large all-reduce
    # goes r2ccl's way on every rank.
    if rank == 0:
        os.environ["R2CCL_GPU_NCCL"] = "1"
    mixed = Ops(nccl)
    mixed.cpu_group, mixed.world_size, mixed.rank_in_group = ops.cpu_group, world, rank
    mixed.unique_name, mixed.device = "tp:0", dev
    mixed._start_r2ccl(dev, engine_nccl=True)
    os.environ.pop("R2CCL_GPU_NCCL", None)
    expect("environments that differ agreed on", not mixed.engine_nccl)
    x = values(ENGINE_NCCL_FROM // 2, rank, torch.bfloat16).to(dev)
    want = TorchPath.all_reduce(mixed, x)
    mixed.fallbacks = 0
    got = mixed.all_reduce(x)
    torch.cuda.synchronize()
    expect("large all_reduce with environments that differ",
           mixed.fallbacks == 0 and torch.equal(got, want))
    mixed.destroy()

    # SGLang's hooks on a group that has SGLang's NCCL communicator (pynccl_comm).
    from r2ccl.sglang import hooks

    class Coordinator:
        pass

    g = Coordinator()
    g.unique_name, g.world_size, g.device = "tp:0", world, dev
    g.cpu_group, g.pynccl_comm = torch.distributed.group.WORLD, object()
    hooks.after_init(None, g)
    expect("sglang made without its own NCCL",
           getattr(g, hooks.ENGINE_NCCL) and "R2CCL_GPU_NCCL" not in os.environ)
    originals = []

    def original(self, x, method=None):
        originals.append(x.numel())
        out = x.clone()
        torch.distributed.all_reduce(out, group=nccl)
        return out

    for n, engine in ((4096, False), (ENGINE_NCCL_FROM // 2, True)):
        x = values(n, rank, torch.bfloat16).to(dev)
        want = original(None, x)
        originals.clear()
        got = hooks.all_reduce_out_place(original, g, x, "pynccl")
        torch.cuda.synchronize()
        expect(f"sglang all_reduce of {n * 2} bytes",
               len(originals) == int(engine) and torch.equal(got, want))
    hooks.before_destroy(g)
    return wrong, cases


def read_cxx(path: str) -> dict[int, float]:
    """r2ccl-gpu-perf --bench's 'auto us' column by size."""
    out, column = {}, None
    with open(path) as f:
        for line in f:
            cols = line.split()
            if cols[:1] == ["bytes"]:
                column = [c for c in cols if c != "us"].index("auto")
            elif column is not None and cols and cols[0].isdigit():
                out[int(cols[0])] = float(cols[column])
    return out


def bench(comm, rank: int, world: int, dev: torch.device, args) -> None:
    lo, hi = parse_size(args.min), parse_size(args.max)
    cxx = read_cxx(args.cxx) if args.cxx and os.path.exists(args.cxx) else {}
    x = torch.zeros(hi // 2, dtype=torch.bfloat16, device=dev)
    y = torch.zeros_like(x)
    if rank == 0:
        print(f"# r2ccl Python package, torch {torch.__version__}, {world} x "
              f"{torch.cuda.get_device_name(dev)}; all_reduce bf16 sum under torch.cuda.graph, "
              f"graph of {args.calls} calls", flush=True)
        print(f"{'bytes':>10} {'python us':>10} {'c++ us':>9} {'ratio':>7}", flush=True)
    size = lo
    while size <= hi:
        n = size // 2
        iters = int(min(max(args.iters * (1 << 20) / size, 5), args.iters))
        src, dst = x[:n], y[:n]
        t = timed(lambda: comm.all_reduce(src, output=dst), args.calls, iters)
        if rank == 0:
            c = cxx.get(size, float("nan"))
            print(f"{size:>10} {t * 1e6:>10.2f} {c:>9.2f} {t * 1e6 / c:>7.3f}", flush=True)
        size *= 2


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(R2CCL_RANK=str(rank), R2CCL_NRANKS=str(world),
                      R2CCL_BOOTSTRAP=f"127.0.0.1:{port}", R2CCL_NICS=f"127.0.{20 + rank}.1")
    import r2ccl

    # The checks build their references with many small host ops: a few threads per rank, not
    # every core per rank.
    torch.set_num_threads(2)
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    comm = r2ccl.Communicator(from_env=True, device=dev)
    rc = 0
    if args.check:
        rc = check(comm, rank, world, dev)
        if world > 1:
            rc |= check_engine_ops(rank, world, dev, args.gloo_port)
    if args.bench and rc == 0:
        bench(comm, rank, world, dev, args)
    comm.barrier()
    comm.close()
    if rc:
        sys.exit(rc)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true")
    p.add_argument("--bench", action="store_true")
    p.add_argument("-n", type=int, default=0, help="ranks (default: every GPU)")
    p.add_argument("--min", default="8K")
    p.add_argument("--max", default="512M")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--cxx", default="")
    args = p.parse_args()
    gpus = torch.cuda.device_count()
    world = args.n or gpus
    if gpus < 1 or world > gpus:
        print(f"torch_r2ccl.py: needs {max(world, 1)} GPUs, this machine has {gpus}; skipped")
        return 77
    ports = [free_port()]  # r2ccl's bootstrap, and the gloo group of the engine check
    ports.append(free_port(taken=tuple(ports)))
    args.gloo_port = ports[1]
    mp.spawn(worker, args=(world, ports[0], args), nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
