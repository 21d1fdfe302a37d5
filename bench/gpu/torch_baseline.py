#!/usr/bin/env python3
"""The baselines of r2ccl's NVLink all-reduce, measured the way r2ccl-gpu-perf measures it: bf16
sum, one process per GPU, a CUDA graph of --calls calls replayed --iters times, CUDA events around
the replays. NCCL through torch.distributed, and PyTorch's symmetric-memory all-reduce (one-shot
and two-shot, no multicast), each size's best of the two. Rank 0 prints one line per size.

usage: bench/gpu/torch_baseline.py [--min 8K] [--max 4M] [--calls 10] [--iters 200]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ports import free_port


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


def timed(fn, calls: int, iters: int) -> float:
    """Seconds per call of fn, replayed from a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):  # warm up outside the graph (lazy initialisation)
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    for _ in range(5):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e-3 / (iters * calls)


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    group = dist.group.WORLD
    import torch.distributed._symmetric_memory as symm_mem

    lo, hi = parse_size(args.min), parse_size(args.max)
    symm = symm_mem.empty(hi // 2, dtype=torch.bfloat16, device=dev)
    symm_mem.rendezvous(symm, group.group_name)
    plain = torch.zeros(hi // 2, dtype=torch.bfloat16, device=dev)
    if rank == 0:
        print(f"# torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
              f"{world} x {torch.cuda.get_device_name(dev)}; bf16 sum, graph of {args.calls} calls "
              f"x {args.iters} replays", flush=True)
        print(f"{'bytes':>10} {'nccl us':>10} {'one-shot us':>12} {'two-shot us':>12} "
              f"{'symm best us':>13}", flush=True)
    size = lo
    while size <= hi:
        n = size // 2
        x = plain[:n]
        nccl = timed(lambda: dist.all_reduce(x, group=group), args.calls, args.iters)
        s = symm[:n]
        one = timed(lambda: torch.ops.symm_mem.one_shot_all_reduce(s, "sum", group.group_name),
                    args.calls, args.iters)
        two = float("nan")
        if n % (8 * world) == 0:  # two-shot wants whole 16-byte pieces per rank
            two = timed(lambda: torch.ops.symm_mem.two_shot_all_reduce_(s, "sum", group.group_name),
                        args.calls, args.iters)
        best = min(one, two) if two == two else one
        if rank == 0:
            print(f"{size:>10} {nccl * 1e6:>10.2f} {one * 1e6:>12.2f} {two * 1e6:>12.2f} "
                  f"{best * 1e6:>13.2f}", flush=True)
        size *= 2
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min", default="8K")
    p.add_argument("--max", default="4M")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args()
    world = torch.cuda.device_count()
    if world < 2:
        print("torch_baseline.py: needs two GPUs; skipped")
        return 77
    mp.spawn(worker, args=(world, free_port(), args), nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
