#!/usr/bin/env python3
"""Device collectives under faults, through the Python package on CUDA tensors, one process per
GPU (review N-C1, N-M1, N-M2). Every case must end with, on every rank, either the right values or
an error, never a wrong value unreported and never a hang; once a rank saw an error, its later
calls must be refused.

  late            the last rank reaches its all-reduces 8 s after the others (R2CCL_TIMEOUT=3):
                  waited for, every value right, no error
  killed          the last rank's process is killed while the others' all-reduce waits for it:
                  the others' calls end, async_error() names the failure, later calls raise
  abort           rank 0 aborts from a second thread while its all-reduce spins; the other ranks
                  then call theirs: each ends with an error, later calls raise
  streams         60 all-reduces of four sizes issued alternately on two streams, no
                  synchronisation between them: every value right
  destroy         close() right after enqueuing a 64 MiB all-reduce: the result right, and a new
                  communicator afterwards works
  create_destroy  100 communicators made, used and closed in one process: every value right, GPU
                  memory, threads and descriptors back where they were; the caller's current
                  device unchanged by making and closing one
  host_only       a communicator moving host memory only: no CUDA context in the process

usage: tests/gpu/faults.py [-n RANKS] [CASE...]    (default: every GPU, every case)
Exit 77 where there are fewer than two GPUs (skipped). Needs R2CCL_LIBRARY (libr2ccl with CUDA)
and integrations/python on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

CASES = ["late", "killed", "abort", "streams", "destroy", "create_destroy", "host_only"]
CASE_LIMIT_S = 180  # a case still running then is a hang


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def expected(n: int, world: int, dtype, seed: int):
    import torch

    k = torch.arange(n, dtype=torch.int64) % 13
    total = sum((k + 3 * r + seed) % 17 for r in range(world))
    return total.to(dtype)


def values(n: int, rank: int, dtype, seed: int):
    import torch

    k = torch.arange(n, dtype=torch.int64) % 13
    return ((k + 3 * rank + seed) % 17).to(dtype)


def report(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def refused(call) -> str | None:
    """The error a later call raises, or None where it ran."""
    import r2ccl

    try:
        call()
    except r2ccl.R2cclError as e:
        return str(e)
    return None


def worker(case: str, rank: int, world: int, port: int) -> None:
    os.environ.update(R2CCL_RANK=str(rank), R2CCL_NRANKS=str(world),
                      R2CCL_BOOTSTRAP=f"127.0.0.1:{port}", R2CCL_NICS=f"127.0.{20 + rank}.1",
                      R2CCL_TIMEOUT="3")
    # No tuning: 100 communicators in a row stay quick (FAULTS_GPU_TUNE=keep: the library's default).
    if os.environ.get("FAULTS_GPU_TUNE", "0") != "keep":
        os.environ["R2CCL_GPU_TUNE"] = os.environ.get("FAULTS_GPU_TUNE", "0")
    import r2ccl
    import torch

    if case == "host_only":
        comm = r2ccl.Communicator(from_env=True)
        x = values(4096, rank, torch.float32, 1)
        comm.all_reduce(x, x)
        right = torch.equal(x, expected(4096, world, torch.float32, 1))
        comm.close()
        cuda = ctypes.CDLL("libcuda.so.1")
        assert cuda.cuInit(0) == 0
        count = ctypes.c_int(0)
        assert cuda.cuDeviceGetCount(ctypes.byref(count)) == 0
        active = []
        for d in range(count.value):
            flags, on = ctypes.c_uint(0), ctypes.c_int(0)
            assert cuda.cuDevicePrimaryCtxGetState(d, ctypes.byref(flags), ctypes.byref(on)) == 0
            if on.value:
                active.append(d)
        report(rank=rank, ok=right and not active, right=right, contexts=active)
        return

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    if case == "create_destroy":
        create_destroy(rank, world, dev)
        return
    comm = r2ccl.Communicator(from_env=True, device=dev)
    warm = values(1024, rank, torch.float32, 0).to(dev)
    comm.all_reduce(warm, warm)
    torch.cuda.synchronize()
    assert torch.equal(warm.cpu(), expected(1024, world, torch.float32, 0)), "warm-up wrong"
    sizes = [1000, 65536 + 3, 1 << 20, 3 << 20]  # low-latency, one-shot, two-shot sizes (f32)

    if case == "late":
        if rank == world - 1:
            time.sleep(8)
        outs = []
        for i in range(4):
            for n in sizes:
                x = values(n, rank, torch.float32, i + 1).to(dev)
                comm.all_reduce(x, x)
                outs.append((x, n, i + 1))
        torch.cuda.synchronize()
        wrong = sum(not torch.equal(x.cpu(), expected(n, world, torch.float32, s))
                    for x, n, s in outs)
        err = comm.async_error()
        report(rank=rank, ok=wrong == 0 and err is None, wrong=wrong, error=str(err) if err else None)
        comm.close()
        return

    if case == "killed":
        if rank == world - 1:
            time.sleep(1)
            os.kill(os.getpid(), signal.SIGKILL)
        x = values(1 << 20, rank, torch.float32, 5).to(dev)
        t0 = time.monotonic()
        comm.all_reduce(x, x)
        torch.cuda.synchronize()
        took = time.monotonic() - t0
        right = torch.equal(x.cpu(), expected(1 << 20, world, torch.float32, 5))
        err = comm.async_error()
        later = refused(lambda: comm.all_reduce(values(16, rank, torch.float32, 0).to(dev)))
        report(rank=rank, ok=(right or err is not None) and err is not None and later is not None,
               right=right, error=str(err) if err else None, later=later, seconds=round(took, 1))
        comm.abort()
        return

    if case == "abort":
        if rank == 0:
            x = values(1 << 20, rank, torch.float32, 6).to(dev)
            comm.all_reduce(x, x)  # the others are not there yet: it spins
            t = threading.Timer(1.0, comm.abort)
            t0 = time.monotonic()
            t.start()
            torch.cuda.synchronize()
            t.join()
            took = time.monotonic() - t0
            later = refused(lambda: comm.all_reduce(values(16, rank, torch.float32, 0).to(dev)))
            report(rank=rank, ok=later is not None, later=later, seconds=round(took, 1))
            time.sleep(6)  # stay alive: the others must fail through the abort, not our exit
            return
        time.sleep(3)
        x = values(1 << 20, rank, torch.float32, 6).to(dev)
        try:
            comm.all_reduce(x, x)
            torch.cuda.synchronize()
        except r2ccl.R2cclError as e:  # refused at once: the abort reached this rank first
            report(rank=rank, ok=True, right=False, error=str(e), later=str(e))
            comm.abort()
            return
        right = torch.equal(x.cpu(), expected(1 << 20, world, torch.float32, 6))
        err = comm.async_error()
        later = refused(lambda: comm.all_reduce(values(16, rank, torch.float32, 0).to(dev)))
        report(rank=rank, ok=err is not None and later is not None, right=right,
               error=str(err) if err else None, later=later)
        comm.abort()
        return

    if case == "streams":
        streams = [torch.cuda.Stream(dev), torch.cuda.Stream(dev)]
        ins = [values(sizes[i % 4], rank, torch.float32, i).to(dev) for i in range(60)]
        torch.cuda.synchronize()
        for i, x in enumerate(ins):
            with torch.cuda.stream(streams[i % 2]):
                comm.all_reduce(x, x)
        torch.cuda.synchronize()
        wrong = [i for i, x in enumerate(ins)
                 if not torch.equal(x.cpu(), expected(sizes[i % 4], world, torch.float32, i))]
        err = comm.async_error()
        report(rank=rank, ok=not wrong and err is None, wrong=wrong[:8],
               error=str(err) if err else None)
        comm.close()
        return

    if case == "destroy":
        n = 16 << 20  # 64 MiB of f32
        x = values(n, rank, torch.float32, 7).to(dev)
        torch.cuda.synchronize()
        comm.all_reduce(x, x)
        comm.close()
        torch.cuda.synchronize()
        right = torch.equal(x.cpu(), expected(n, world, torch.float32, 7))
        os.environ["R2CCL_BOOTSTRAP"] = f"127.0.0.1:{port + 1}"
        again = r2ccl.Communicator(from_env=True, device=dev)
        y = values(1 << 20, rank, torch.float32, 8).to(dev)
        again.all_reduce(y, y)
        torch.cuda.synchronize()
        right2 = torch.equal(y.cpu(), expected(1 << 20, world, torch.float32, 8))
        again.close()
        report(rank=rank, ok=right and right2, right=right, right_after=right2)
        return
    raise SystemExit(f"unknown case {case}")


def create_destroy(rank: int, world: int, dev) -> None:
    import r2ccl
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['FAULTS_PG_PORT']}",
                            rank=rank, world_size=world)
    other = (rank + 1) % world
    wrong = moved = 0
    marks = {}
    for i in range(100):
        with torch.cuda.device(other):
            comm = r2ccl.Communicator(dist.group.WORLD, device=dev)
            moved += torch.cuda.current_device() != other
        x = values(4096 + i, rank, torch.float32, i).to(dev)
        comm.all_reduce(x, x)
        torch.cuda.synchronize()
        wrong += not torch.equal(x.cpu(), expected(4096 + i, world, torch.float32, i))
        with torch.cuda.device(other):
            comm.close()
            moved += torch.cuda.current_device() != other
        if i in (4, 99):
            torch.cuda.synchronize()
            marks[i] = dict(free=torch.cuda.mem_get_info(dev)[0],
                            fds=len(os.listdir("/proc/self/fd")),
                            threads=len(os.listdir("/proc/self/task")))
    dist.destroy_process_group()
    lost_mib = (marks[4]["free"] - marks[99]["free"]) / (1 << 20)
    grew = {k: marks[99][k] - marks[4][k] for k in ("fds", "threads")}
    report(rank=rank, ok=wrong == 0 and moved == 0 and lost_mib < 64 and max(grew.values()) <= 4,
           wrong=wrong, device_moved=moved, gpu_mib_lost=round(lost_mib, 1), grew=grew)


def run_case(case: str, world: int) -> bool:
    port = free_port()
    env = dict(os.environ, FAULTS_PG_PORT=str(free_port()))
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", case, "--rank", str(r),
                               "--world", str(world), "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for r in range(world)]
    deadline = time.monotonic() + CASE_LIMIT_S
    outputs, hung = [], False
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung = True
            for q in procs:
                q.kill()
            out, _ = p.communicate()
        outputs.append(out)
    ok = not hung
    for r, (p, out) in enumerate(zip(procs, outputs)):
        results = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
        killed_here = case == "killed" and r == world - 1
        if killed_here:
            good = p.returncode == -signal.SIGKILL
            print(f"  rank {r}: killed as planned" if good else f"  rank {r}: exit {p.returncode}")
        else:
            good = p.returncode == 0 and len(results) == 1 and results[0].get("ok") is True
            print(f"  rank {r}: exit {p.returncode}: {results[0] if results else 'no result'}")
        if not good and not killed_here or (killed_here and not good):
            ok = False
            print("    " + "\n    ".join(out.strip().splitlines()[-15:]))
    print(f"{'PASS' if ok else 'FAIL'} {case} on {world} GPUs{' (HUNG: killed)' if hung else ''}",
          flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=0)
    ap.add_argument("--worker")
    ap.add_argument("--rank", type=int)
    ap.add_argument("--world", type=int)
    ap.add_argument("--port", type=int)
    ap.add_argument("cases", nargs="*")
    a = ap.parse_args()
    if a.worker:
        worker(a.worker, a.rank, a.world, a.port)
        return 0
    import torch

    gpus = torch.cuda.device_count()
    world = a.n or gpus
    if world < 2 or gpus < world:
        print(f"skipped: {gpus} GPU(s) here, the fault cases need at least 2")
        return 77
    failed = [c for c in (a.cases or CASES) if not run_case(c, world)]
    print(f"{len(a.cases or CASES) - len(failed)} passed, {len(failed)} failed"
          + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
