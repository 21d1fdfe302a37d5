#!/usr/bin/env python3
"""GPU memory a communicator takes, one process per GPU: what the device's free memory lost
between before the communicator was made and after its first all-reduces (8 KiB and 64 MiB bf16,
so that NCCL's lazily made resources count), less what PyTorch's allocator reserved meanwhile
(the tensors), per rank; then what closing it gave back.

  r2ccl           the Python package's Communicator on CUDA tensors, as made by default
  r2ccl-gpu-nccl-0  the same with R2CCL_GPU_NCCL=0 (as vLLM's CUDA communicator makes it): no
                  NCCL communicator of its own, r2ccl's kernels take every size
  torch-nccl      PyTorch's NCCL process group, the engines' own path, for comparison

usage: bench/gpu/footprint.py [-n RANKS] [CASE...]   (default: every GPU, every case)
Needs libr2ccl built with CUDA: R2CCL_LIBRARY, and integrations/python on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import time

import torch
import torch.multiprocessing as mp
from ports import free_port

CASES = {
    "r2ccl": {},
    "r2ccl-gpu-nccl-0": {"R2CCL_GPU_NCCL": "0"},
    "torch-nccl": {},
}
MIB = 1 << 20
CASE_LIMIT_S = 300  # a case whose ranks have not all answered by then is a hang


def free_bytes(dev: torch.device) -> tuple[int, int]:
    torch.cuda.synchronize(dev)
    return torch.cuda.mem_get_info(dev)[0], torch.cuda.memory_reserved(dev)


def worker(rank: int, world: int, port: int, case: str, queue) -> None:
    os.environ.update(CASES[case])
    os.environ.update(R2CCL_RANK=str(rank), R2CCL_NRANKS=str(world),
                      R2CCL_BOOTSTRAP=f"127.0.0.1:{port}", R2CCL_NICS=f"127.0.{20 + rank}.1")
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    torch.zeros(1, device=dev)  # the CUDA context, before the first reading
    free0, reserved0 = free_bytes(dev)
    small = torch.ones(4096, dtype=torch.bfloat16, device=dev)
    large = torch.ones(32 * MIB, dtype=torch.bfloat16, device=dev)
    if case == "torch-nccl":
        import torch.distributed as dist

        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, device_id=dev)
        for t in (small, large):
            dist.all_reduce(t)
        right = bool((small == world).all()) and bool((large == world).all())
        free1, reserved1 = free_bytes(dev)
        dist.destroy_process_group()
    else:
        import r2ccl

        comm = r2ccl.Communicator(from_env=True, device=dev)
        outs = [comm.all_reduce(t) for t in (small, large)]
        right = all(bool((o == world).all()) for o in outs)
        del outs
        free1, reserved1 = free_bytes(dev)
        comm.close()
    torch.cuda.empty_cache()
    free2, reserved2 = free_bytes(dev)
    queue.put({
        "rank": rank,
        "right": right,
        "mib": ((free0 - free1) - (reserved1 - reserved0)) / MIB,
        "left_after_close_mib": ((free0 - free2) - (reserved2 - reserved0)) / MIB,
    })


def run(case: str, world: int) -> list[dict]:
    """Every rank's result of `case`; RuntimeError naming the rank where one fails or none has
    answered within CASE_LIMIT_S (every rank is ended either way)."""
    port = free_port()
    ctx = mp.get_context("spawn")
    results_q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, case, results_q))
             for r in range(world)]
    for p in procs:
        p.start()
    results = []
    deadline = time.monotonic() + CASE_LIMIT_S
    try:
        while len(results) < world:
            try:
                results.append(results_q.get(timeout=1))
            except queue.Empty:
                for rank, p in enumerate(procs):
                    if p.exitcode not in (None, 0):
                        raise RuntimeError(f"{case}: rank {rank} exited with {p.exitcode}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{case}: {world - len(results)} rank(s) had not answered "
                                       f"after {CASE_LIMIT_S} s")
        for rank, p in enumerate(procs):
            p.join(timeout=60)
            if p.exitcode != 0:
                raise RuntimeError(f"{case}: rank {rank} exited with {p.exitcode}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return sorted(results, key=lambda r: r["rank"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=0, help="ranks (default: every GPU)")
    p.add_argument("cases", nargs="*", default=list(CASES))
    args = p.parse_args()
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        p.error(f"unknown case(s) {', '.join(unknown)}; the cases are {', '.join(CASES)}")
    gpus = torch.cuda.device_count()
    world = args.n or gpus
    if world < 2 or world > gpus:
        print(f"footprint.py: needs {max(world, 2)} GPUs, this machine has {gpus}; skipped")
        return 77
    print(f"# GPU memory per rank, MiB, {world} x {torch.cuda.get_device_name(0)}")
    print(f"{'case':>18} {'taken':>10} {'after close':>12} right")
    rc = 0
    for case in args.cases:
        try:
            results = run(case, world)
        except RuntimeError as e:
            print(f"{case:>18} failed: {e}")
            rc = 1
            continue
        taken = max(r["mib"] for r in results)
        left = max(r["left_after_close_mib"] for r in results)
        right = all(r["right"] for r in results)
        rc |= 0 if right else 1
        print(f"{case:>18} {taken:10.1f} {left:12.1f} {right}")
        print("  " + json.dumps(results))
    return rc


if __name__ == "__main__":
    sys.exit(main())
