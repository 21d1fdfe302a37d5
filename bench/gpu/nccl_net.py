#!/usr/bin/env python3
"""NCCL's network transports between two network namespaces (bench/gpu/netns.sh): r2ccl's NCCL
net plugin (libnccl-net-r2ccl.so, striping each connection over the NICs of R2CCL_NICS) beside
NCCL's own socket transport, one process per GPU, torch.distributed's NCCL backend.

Two roles. `run` (outside the namespaces, as root) starts one rank per GPU inside its namespace
(netns.sh exec), rank r on GPU r (2 GPUs: one per namespace, NCCL_P2P_DISABLE=1
NCCL_SHM_DISABLE=1; 4 GPUs: two per namespace, NVLink inside one, the network across), each
namespace a host of its own to NCCL (NCCL_HOSTID); it applies a fault mid-run (netns.sh), keeps
watch, kills what stalls, and writes CASE.json with the ranks' results, exit codes, bytes per NIC
and what NCCL's logs say. `rank` is one rank. `summary` tabulates the CASE.json files of a folder.

Modes of a rank:
  correct  all_reduce (sum; bf16, fp16 and fp32, small integers, so exact), all_gather_into_tensor,
           reduce_scatter_tensor, broadcast (from either namespace), reduce (to either
           namespace), send/recv between the
           namespaces, over --sizes; then two CUDA graphs (the collectives; send/recv) captured
           at each of --graph-sizes and replayed --replays times, each replay with new inputs
           written into the static tensors. One CHECK line per check; exact comparison.
  loop     a --size bf16 all-reduce for --duration seconds, every result checked exactly (a
           position-dependent pattern of small integers, new each iteration), one PROGRESS line
           a second (iterations, bus bandwidth of that second, bad elements so far), the longest
           gap between two iterations. The controller faults a NIC --fault-at seconds in.
  bw       bus bandwidth of a --size bf16 all-reduce (CUDA events, --warmup, --iters); with a
           fault, then again after the controller has taken the NIC down (after --warmup more
           iterations for the failover).
A watchdog in each rank: no progress for --stall seconds prints STALLED and exits 3 (NCCL's
socket transport hangs, without an error, when a NIC of its goes down).

Exit codes (rank and run): 0 right, 1 a wrong result, 2 an error, 3 stalled, 4 killed at the
controller's timeout, 5 the plugin was asked for and NCCL used another network.

Transport r2ccl: r2ccl's own communicator (the Python package) on the CUDA tensors instead of
NCCL: across the namespaces its device path over the rails (R2CCL_NICS, staged through host
memory), with gloo over mgmt for the unique id and the barriers.

usage: nccl_net.py run --mode MODE --transport plugin|socket|gloo|r2ccl --gpus 2|4 --name NAME
                       --out DIR [--fault none|down|blackhole|flap] [--fault-nic eth1] ...
       nccl_net.py summary DIR
       nccl_net.py rank ... (started by run)
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import glob
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
NETNS = os.path.join(HERE, "netns.sh")
NAMESPACES = ("r2n0", "r2n1")
NICS = ("eth0", "eth1", "eth2", "eth3")
MASTER_ADDR = "198.19.0.1"  # r2n0's mgmt end
# Set only to test this script: the last rank alters one element of a result now and then.
SELFTEST_CORRUPT = os.environ.get("R2_NCCL_NET_SELFTEST_CORRUPT") == "1"
EXIT_OK, EXIT_WRONG, EXIT_ERROR, EXIT_STALLED, EXIT_KILLED, EXIT_WRONG_NET = 0, 1, 2, 3, 4, 5


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


def human(n: int) -> str:
    for unit, s in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= s and n % s == 0:
            return f"{n // s}{unit}"
    return str(n)


_say_lock = threading.Lock()


def say(*a) -> None:
    with _say_lock:
        print(*a, flush=True)


# ---------------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------------


class Watchdog:
    """STALLED and exit 3 when beat() has not been called for `limit` seconds. A Python thread
    (needs the GIL, which torch releases while it waits on the GPU), and faulthandler's C thread
    ten seconds later as a backstop (prints 'Timeout', exits 1; the controller reads it)."""

    def __init__(self, rank: int):
        self.rank, self.limit, self.what = rank, 1e9, "start"
        self.res: dict = {}  # what the rank has measured so far: printed on a stall
        self.last = time.monotonic()
        self.lock = threading.Lock()
        threading.Thread(target=self._run, daemon=True).start()

    def arm(self, limit: float, what: str) -> None:
        with self.lock:
            self.limit, self.what, self.last = limit, what, time.monotonic()
        faulthandler.dump_traceback_later(limit + 10, exit=True)

    def beat(self, what: str | None = None) -> None:
        with self.lock:
            self.last = time.monotonic()
            if what:
                self.what = what
        faulthandler.dump_traceback_later(self.limit + 10, exit=True)

    def _run(self) -> None:
        while True:
            time.sleep(0.25)
            with self.lock:
                idle, limit, what = time.monotonic() - self.last, self.limit, self.what
            if idle > limit:
                say(f"STALLED rank {self.rank}: no progress for {idle:.1f} s (limit {limit:g} s) "
                    f"in {what}")
                say("RESULT " + json.dumps({**self.res, "stalled_in": what,
                                             "stalled_after_s": round(idle, 1)}))
                sys.stderr.flush()
                os._exit(EXIT_STALLED)


def pattern(torch, n: int, seed: int, dtype, device):
    """n small integers, a hash of position and seed: exact in bf16 and fp16 (0..31, a sum of up
    to 8 stays below 256) and fp32 (0..65535); any misplaced piece of a buffer shows."""
    idx = torch.arange(n, dtype=torch.int64, device=device)
    h = (idx * 0x9E3779B1 + (seed * 0x85EBCA77 + 0x165667B1)) & 0xFFFFFFFF
    h = h ^ (h >> 15)
    h = (h * 0x2C1B3C6D) & 0xFFFFFFFF
    h = h ^ (h >> 12)
    v = (h >> 8) & (31 if dtype in (torch.bfloat16, torch.float16) else 0xFFFF)
    return v.to(dtype)


def seed_of(*parts: int) -> int:
    s = 0
    for p in parts:
        s = (s * 1000003 + p + 1) & 0x7FFFFFFF
    return s


def bad_count(torch, got, want) -> tuple[int, int]:
    """(elements that differ, first such index or -1)."""
    diff = got.reshape(-1) != want.reshape(-1)
    n = int(diff.sum().item())
    return n, (int(diff.nonzero()[0].item()) if n else -1)


class R2cclDist:
    """The torch.distributed calls these checks make, on r2ccl's Communicator (CUDA tensors,
    queued on the current stream, capturable); barriers are gloo's over mgmt after the device's
    work."""

    class P2POp:
        def __init__(self, op, tensor, peer):
            self.op, self.tensor, self.peer = op, tensor, peer

    def __init__(self, dist, dev):
        import r2ccl
        import torch
        self._dist, self._torch = dist, torch
        self.comm = r2ccl.Communicator(dist.group.WORLD, device=dev)
        self.isend, self.irecv = "send", "recv"

    def all_reduce(self, t):
        self.comm.all_reduce(t, t)

    def all_gather_into_tensor(self, out, inp):
        self.comm.all_gather(inp, out)

    def reduce_scatter_tensor(self, out, inp):
        self.comm.reduce_scatter(inp, out)

    def broadcast(self, t, src=0):
        self.comm.broadcast(t, src)

    def reduce(self, t, dst=0):
        self.comm.reduce(t, t, "sum", dst)

    def batch_isend_irecv(self, ops):
        with self.comm.group():
            for o in ops:
                (self.comm.send if o.op == "send" else self.comm.recv)(o.tensor, o.peer)
        return []

    def barrier(self):
        self._torch.cuda.synchronize()
        self._dist.barrier()

    def destroy_process_group(self):
        self.comm.close()
        self._dist.destroy_process_group()


def rank_main(a: argparse.Namespace) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's renames of collectives
    dog = Watchdog(rank)
    dog.arm(a.init_timeout, "import and init")
    import torch
    import torch.distributed as dist

    cuda = a.device == "cuda"
    if a.transport == "r2ccl":
        # r2ccl's own communicator on the CUDA tensors (its rails, staged through host memory
        # across the namespaces); gloo over mgmt only for the id and the barriers.
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=a.pg_timeout))
        dist = R2cclDist(dist, dev)
    elif cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev,
                                timeout=datetime.timedelta(seconds=a.pg_timeout))
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=a.pg_timeout))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if rank == 0:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else "-"
        gpu = torch.cuda.get_device_name(dev) if cuda else "cpu"
        say(f"# torch {torch.__version__}, NCCL {nccl}, {world} ranks, {gpu}, mode {a.mode}")
    dist.barrier()
    dog.beat("first barrier")
    res: dict = {"rank": rank, "world": world, "mode": a.mode}
    dog.res = res
    try:
        if a.mode == "correct":
            rc = do_correct(a, torch, dist, dev, rank, world, sync, dog, res)
        elif a.mode == "loop":
            rc = do_loop(a, torch, dist, dev, rank, world, dog, res)
        else:
            rc = do_bw(a, torch, dist, dev, rank, world, sync, dog, res)
    except Exception as e:  # noqa: BLE001 - reported, then a distinct exit code
        say(f"ERROR rank {rank}: {type(e).__name__}: {e}")
        res["error"] = f"{type(e).__name__}: {e}"
        say("RESULT " + json.dumps(res))
        sys.stdout.flush()
        os._exit(EXIT_ERROR)  # the other ranks may be stuck in a collective: no teardown
    say("RESULT " + json.dumps(res))
    dog.arm(30, "teardown")
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001
        say(f"teardown rank {rank}: {e}")
    faulthandler.cancel_dump_traceback_later()
    return rc


def do_correct(a, torch, dist, dev, rank, world, sync, dog, res) -> int:
    checks = {"pass": 0, "fail": 0, "failed": []}
    peer = (rank + world // 2) % world  # the same place in the other namespace
    cuda = dev.type == "cuda"

    def report(name: str, got, want) -> None:
        sync()
        if SELFTEST_CORRUPT and rank == world - 1 and got.numel() > 1:
            got.view(-1)[got.numel() // 2] += 1  # self-test: the check must see this
        n, first = bad_count(torch, got, want)
        # Every rank's verdict, so that one rank's wrong result fails all: an all-reduce of the
        # bad counts (over the same network).
        t = torch.tensor([float(n)], device=dev)
        dist.all_reduce(t)
        total = int(t.item())
        ok = total == 0
        checks["pass" if ok else "fail"] += 1
        if not ok:
            checks["failed"].append(name)
        if rank == 0 or n:
            say(f"CHECK {'ok  ' if ok else 'FAIL'} {name}: {total} wrong elements in all ranks"
                + (f" (rank {rank}: {n}, first at {first})" if n else ""))
        dog.beat(name)

    def pat(n, tag, r, dtype, it=0):
        return pattern(torch, n, seed_of(tag, r, it), dtype, dev)

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    for size in [parse_size(s) for s in a.sizes.split(",")]:
        for dname, dt in dtypes.items():
            n = size // (4 if dt == torch.float32 else 2)
            tag = seed_of(size, 1, n)
            # fp32 and bf16 share a pattern only through the mask in pattern(); the sums are
            # formed from the same values as the inputs.
            x = pat(n, tag, rank, dt)
            want = sum(pat(n, tag, r, dt).to(torch.int64) for r in range(world)).to(dt)
            dist.all_reduce(x)
            report(f"all_reduce {dname} {human(size)}", x, want)
        others = dtypes.items() if a.every_dtype else [("bf16", torch.bfloat16)]
        for dname, dt in others:
            n = size // (4 if dt == torch.float32 else 2)
            chunk = n // world
            tag = seed_of(size, 2)
            out = torch.full((chunk * world,), -1.0, dtype=dt, device=dev)
            dist.all_gather_into_tensor(out, pat(chunk, tag, rank, dt))
            report(f"all_gather_into_tensor {dname} {human(size)}", out,
                   torch.cat([pat(chunk, tag, r, dt) for r in range(world)]))
            tag = seed_of(size, 3)
            inp = pat(chunk * world, tag, rank, dt)
            out = torch.full((chunk,), -1.0, dtype=dt, device=dev)
            dist.reduce_scatter_tensor(out, inp)
            want = sum(pat(chunk * world, tag, r, dt).to(torch.int64) for r in range(world))
            report(f"reduce_scatter_tensor {dname} {human(size)}", out,
                   want[rank * chunk:(rank + 1) * chunk].to(dt))
            for src in (0, world - 1):
                tag = seed_of(size, 4, src)
                x = pat(n, tag, src, dt) if rank == src else torch.full((n,), -1.0, dtype=dt,
                                                                         device=dev)
                dist.broadcast(x, src=src)
                report(f"broadcast from {src} {dname} {human(size)}", x, pat(n, tag, src, dt))
            for root in (0, world - 1):
                tag = seed_of(size, 6, root)
                x = pat(n, tag, rank, dt)
                dist.reduce(x, dst=root)
                if rank == root:
                    want = sum(pat(n, tag, r, dt).to(torch.int64) for r in range(world)).to(dt)
                else:
                    want = x  # unspecified off the root
                report(f"reduce to {root} {dname} {human(size)}", x, want)
            tag = seed_of(size, 5)
            send, recv = pat(n, tag, rank, dt), torch.full((n,), -1.0, dtype=dt, device=dev)
            ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            report(f"send/recv with {peer} {dname} {human(size)}", recv, pat(n, tag, peer, dt))

    if cuda and a.graph_sizes:
        for size in [parse_size(s) for s in a.graph_sizes.split(",")]:
            graph_checks(a, torch, dist, dev, rank, world, peer, size, report, pat)
    res["checks"] = checks
    if rank == 0:
        say(f"SUMMARY correct: {checks['pass']} passed, {checks['fail']} failed"
            + (f": {', '.join(checks['failed'])}" if checks["failed"] else ""))
    return EXIT_OK if checks["fail"] == 0 else EXIT_WRONG


def graph_checks(a, torch, dist, dev, rank, world, peer, size, report, pat) -> None:
    bf, f32 = torch.bfloat16, torch.float32
    n = size // 2
    chunk = n // world
    st = {  # the static tensors of the graphs
        "ar_bf16": torch.zeros(n, dtype=bf, device=dev),
        "ar_fp32": torch.zeros(size // 4, dtype=f32, device=dev),
        "ag_in": torch.zeros(chunk, dtype=bf, device=dev),
        "ag_out": torch.zeros(chunk * world, dtype=bf, device=dev),
        "rs_in": torch.zeros(chunk * world, dtype=bf, device=dev),
        "rs_out": torch.zeros(chunk, dtype=bf, device=dev),
        "bc": torch.zeros(n, dtype=bf, device=dev),
        "send": torch.zeros(n, dtype=bf, device=dev),
        "recv": torch.zeros(n, dtype=bf, device=dev),
    }
    src = world - 1  # broadcast from the other namespace than rank 0's

    def collectives():
        dist.all_reduce(st["ar_bf16"])
        dist.all_reduce(st["ar_fp32"])
        dist.all_gather_into_tensor(st["ag_out"], st["ag_in"])
        dist.reduce_scatter_tensor(st["rs_out"], st["rs_in"])
        dist.broadcast(st["bc"], src=src)

    def sendrecv():
        ops = [dist.P2POp(dist.isend, st["send"], peer), dist.P2POp(dist.irecv, st["recv"], peer)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    for gname, body in (("collectives", collectives), ("send/recv", sendrecv)):
        label = f"graph {gname} {human(size)}"
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):  # warm up outside the graph, on a side stream
                    body()
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                body()
        except Exception as e:  # noqa: BLE001
            t = torch.tensor([1.0], device=dev)
            report(f"{label}: capture failed: {type(e).__name__}: {e}", t, torch.zeros_like(t))
            continue
        for it in range(a.replays):
            tag = seed_of(size, 7, it)
            # New inputs into the static tensors; outputs poisoned, so a replay that did
            # nothing shows.
            st["ar_bf16"].copy_(pat(n, tag, rank, bf))
            st["ar_fp32"].copy_(pat(size // 4, tag + 1, rank, f32))
            st["ag_in"].copy_(pat(chunk, tag + 2, rank, bf))
            st["ag_out"].fill_(-1)
            st["rs_in"].copy_(pat(chunk * world, tag + 3, rank, bf))
            st["rs_out"].fill_(-1)
            st["bc"].copy_(pat(n, tag + 4, src, bf) if rank == src else
                           torch.full((n,), -1.0, dtype=bf, device=dev))
            st["send"].copy_(pat(n, tag + 5, rank, bf))
            st["recv"].fill_(-1)
            g.replay()
            if gname == "collectives":
                report(f"{label} replay {it} all_reduce bf16", st["ar_bf16"],
                       sum(pat(n, tag, r, bf).to(torch.int64) for r in range(world)).to(bf))
                report(f"{label} replay {it} all_reduce fp32", st["ar_fp32"],
                       sum(pat(size // 4, tag + 1, r, f32).to(torch.int64)
                           for r in range(world)).to(f32))
                report(f"{label} replay {it} all_gather", st["ag_out"],
                       torch.cat([pat(chunk, tag + 2, r, bf) for r in range(world)]))
                want = sum(pat(chunk * world, tag + 3, r, bf).to(torch.int64) for r in range(world))
                report(f"{label} replay {it} reduce_scatter", st["rs_out"],
                       want[rank * chunk:(rank + 1) * chunk].to(bf))
                report(f"{label} replay {it} broadcast from {src}", st["bc"],
                       pat(n, tag + 4, src, bf))
            else:
                report(f"{label} replay {it}", st["recv"], pat(n, tag + 5, peer, bf))
        del g


def do_loop(a, torch, dist, dev, rank, world, dog, res) -> int:
    bf = torch.bfloat16
    n = a.size // 2
    variants = 4
    # Inputs and expected sums of `variants` iterations, in turn; the last element carries rank
    # 0's stop flag, so that every rank ends after the same iteration.
    inputs = [pattern(torch, n - 1, seed_of(9, k, rank), bf, dev) for k in range(variants)]
    wants = [sum(pattern(torch, n - 1, seed_of(9, k, r), bf, dev).to(torch.int64)
                 for r in range(world)).to(bf) for k in range(variants)]
    x = torch.empty(n, dtype=bf, device=dev)
    busbytes = a.size * 2 * (world - 1) / world
    dog.arm(a.stall, "loop")
    t0 = time.monotonic()
    res.update(iterations=0, size=a.size)
    say(f"LOOP-START rank {rank}")
    it = bad_total = bad_iters = 0
    last_it_t = t0
    max_gap, max_gap_at = 0.0, 0.0
    win_t, win_it = t0, 0
    per_second = []
    stop_flag = 0.0
    while True:
        k = it % variants
        x[:-1].copy_(inputs[k])
        x[-1:].fill_(stop_flag)
        dist.all_reduce(x)
        if SELFTEST_CORRUPT and rank == world - 1 and it == 3:
            x[n // 3] += 1  # self-test: the check must see this
        bad, first = bad_count(torch, x[:-1], wants[k])
        stop = float(x[-1].item()) > 0
        now = time.monotonic()
        it += 1
        dog.beat()
        gap = now - last_it_t
        if gap > max_gap:
            max_gap, max_gap_at = gap, now - t0
        last_it_t = now
        if bad:
            bad_total += bad
            bad_iters += 1
            if bad_iters <= 20:
                say(f"MISMATCH rank {rank} iteration {it} t={now - t0:.2f}s: {bad} wrong, "
                    f"first at {first}")
        if now - win_t >= 1.0:
            bw = (it - win_it) * busbytes / (now - win_t) / 1e9
            per_second.append(round(bw, 4))
            if rank == 0:
                say(f"PROGRESS t={now - t0:6.2f}s it={it} busbw={bw:.3f} GB/s "
                    f"bad={bad_total} max_gap={max_gap:.3f}s")
            win_t, win_it = now, it
            res.update(iterations=it, seconds=round(now - t0, 3), bad_elements=bad_total,
                       bad_iterations=bad_iters, max_gap_s=round(max_gap, 3),
                       max_gap_at_s=round(max_gap_at, 2), per_second_busbw=per_second)
        if stop:
            break
        if rank == 0 and now - t0 >= a.duration:
            stop_flag = 1.0
    el = time.monotonic() - t0
    res.update(iterations=it, seconds=round(el, 3), bad_elements=bad_total,
               bad_iterations=bad_iters, busbw_GBps=round(it * busbytes / el / 1e9, 4),
               max_gap_s=round(max_gap, 3), max_gap_at_s=round(max_gap_at, 2),
               per_second_busbw=per_second, size=a.size)
    say(f"SUMMARY loop rank {rank}: {it} iterations in {el:.1f} s, busbw {res['busbw_GBps']} "
        f"GB/s, {bad_iters} wrong iterations, longest gap {max_gap:.3f} s at t={max_gap_at:.1f}s")
    return EXIT_OK if bad_total == 0 else EXIT_WRONG


def do_bw(a, torch, dist, dev, rank, world, sync, dog, res) -> int:
    bf = torch.bfloat16
    n = a.size // 2
    x = torch.zeros(n, dtype=bf, device=dev)
    cuda = dev.type == "cuda"
    # --size is the whole buffer: the all-reduce's, the all-gather's output, the
    # reduce-scatter's input. Bus bytes as nccl-tests count them.
    if a.coll == "all_reduce":
        busbytes = a.size * 2 * (world - 1) / world

        def step():
            dist.all_reduce(x)
    else:
        busbytes = a.size * (world - 1) / world
        part = torch.zeros(n // world, dtype=bf, device=dev)
        if a.coll == "all_gather":
            def step():
                dist.all_gather_into_tensor(x, part)
        else:
            def step():
                dist.reduce_scatter_tensor(part, x)

    def measure(label: str) -> float:
        dog.arm(a.stall, f"bw warmup {label}")
        for _ in range(a.warmup):
            step()
            sync()
            dog.beat()
        dog.arm(a.stall + a.iters * 2, f"bw timed {label}")
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(a.iters):
                step()
            end.record()
            end.synchronize()
            sec = start.elapsed_time(end) * 1e-3 / a.iters
        else:
            t = time.perf_counter()
            for _ in range(a.iters):
                step()
            sec = (time.perf_counter() - t) / a.iters
        dog.beat()
        bw = busbytes / sec / 1e9
        res[f"busbw_{label}_GBps"] = round(bw, 4)
        res[f"us_{label}"] = round(sec * 1e6, 1)
        if rank == 0:
            say(f"BW {label}: {human(a.size)} bf16 {a.coll} {sec * 1e3:.2f} ms, "
                f"busbw {bw:.3f} GB/s")
        return bw

    measure("healthy")
    if a.fault_file:
        if rank == 0:
            say("FAULT-NOW")  # the controller takes the NIC down, then writes the file
            deadline = time.monotonic() + 30
            while not os.path.exists(a.fault_file) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(2.0)  # the steady state with the NIC down (the loops time the failover)
            dog.beat()
        dog.arm(a.stall, "barrier after the fault")
        dist.barrier()
        measure("degraded")
    # One checked all-reduce at the end.
    tag = seed_of(11)
    x.copy_(pattern(torch, n, seed_of(tag, rank), bf, dev))
    dist.all_reduce(x)
    want = sum(pattern(torch, n, seed_of(tag, r), bf, dev).to(torch.int64)
               for r in range(world)).to(bf)
    bad, _ = bad_count(torch, x, want)
    res["final_check_bad"] = bad
    if bad:
        say(f"MISMATCH rank {rank}: final all_reduce {bad} wrong")
    return EXIT_OK if bad == 0 else EXIT_WRONG


# ---------------------------------------------------------------------------------------------
# The controller
# ---------------------------------------------------------------------------------------------


def netns(*args: str, check: bool = True, timeout: float = 60) -> str:
    p = subprocess.run([NETNS, *args], capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f"netns.sh {' '.join(args)}: {p.stderr.strip()}")
    return p.stdout


def nic_stats() -> dict:
    out = {}
    for line in netns("stats", check=False).splitlines():
        f = line.split()
        if len(f) == 5:
            out[f"{f[0]}/{f[1]}"] = {"state": f[2], "tx": int(f[3]), "rx": int(f[4])}
    return out


def rank_env(a, rank: int, world: int, port: int, logdir: str) -> tuple[str, dict]:
    per_ns = world // len(NAMESPACES)
    ns_i = rank // per_ns
    ns = NAMESPACES[ns_i]
    env = dict(os.environ)
    for k in ("NCCL_NET", "NCCL_NET_PLUGIN", "NCCL_SOCKET_IFNAME", "R2CCL_NICS"):
        env.pop(k, None)
    env.update(MASTER_ADDR=MASTER_ADDR, MASTER_PORT=str(port), RANK=str(rank),
               WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_ns),
               LOCAL_WORLD_SIZE=str(per_ns), PYTHONUNBUFFERED="1")
    if a.transport == "r2ccl":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(ns_i * per_ns + i) for i in range(per_ns))
        env.update(R2CCL_NICS=",".join(a.nics), R2CCL_SOCKET_IFNAME="mgmt",
                   GLOO_SOCKET_IFNAME="mgmt", R2CCL_NODE_ID=ns)
        for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
            env.setdefault(k, v)
    elif a.transport != "gloo":
        # rank r on GPU r: the namespace's GPUs visible, the rank's local index among them
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(ns_i * per_ns + i) for i in range(per_ns))
        env["NCCL_HOSTID"] = f"r2ccl-{ns}"  # each namespace a host of its own to NCCL
        for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1"), ("NCCL_MNNVL_ENABLE", "0"),
                     ("NCCL_DEBUG", "INFO"), ("NCCL_DEBUG_SUBSYS", "INIT,NET,ENV")):
            env.setdefault(k, v)
        env["NCCL_DEBUG_FILE"] = os.path.join(logdir, f"{a.name}.rank{rank}.nccl.log")
        if per_ns == 1:
            env.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1")
        if a.transport == "plugin":
            env.update(NCCL_NET_PLUGIN=a.plugin, NCCL_SOCKET_IFNAME="=mgmt",
                       R2CCL_NICS=",".join(a.nics))
            if a.nccl_net:
                env["NCCL_NET"] = a.nccl_net
        else:
            # NCCL's bootstrap then also runs on the first of these (eth0).
            env.update(NCCL_NET="Socket", NCCL_NET_PLUGIN="none",
                       NCCL_SOCKET_IFNAME="=" + ",".join(a.nics))
    else:
        env["GLOO_SOCKET_IFNAME"] = a.gloo_ifname
    for kv in a.env:
        k, _, v = kv.partition("=")
        env[k] = v
    return ns, env


def nccl_log_facts(logdir: str, name: str) -> dict:
    facts: dict = {"networks": [], "r2ccl_lines": 0, "warn_lines": 0, "r2ccl_tail": [],
                   "plugin_loaded": []}
    for path in sorted(glob.glob(os.path.join(logdir, f"{name}.rank*.nccl.log"))):
        try:
            with open(path, errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for ln in lines:
            m = re.search(r"Using network (\S+)", ln)
            if m and m.group(1) not in facts["networks"]:
                facts["networks"].append(m.group(1))
            if re.search(r"NET/Plugin.*(Loaded|Failed|not found|Could not)", ln, re.I):
                if len(facts["plugin_loaded"]) < 4:
                    facts["plugin_loaded"].append(ln.split("NCCL INFO ")[-1][:200])
            if "WARN" in ln:
                facts["warn_lines"] += 1
            if "r2ccl" in ln.lower():
                facts["r2ccl_lines"] += 1
                facts["r2ccl_tail"].append(ln[-240:])
                facts["r2ccl_tail"] = facts["r2ccl_tail"][-8:]
    return facts


def run_main(a: argparse.Namespace) -> int:
    world = a.gpus
    if world % len(NAMESPACES):
        raise SystemExit("--gpus must be even (2 or 4)")
    casedir = os.path.join(a.out, "cases")
    logdir = os.path.join(a.out, "logs")
    os.makedirs(casedir, exist_ok=True)
    os.makedirs(logdir, exist_ok=True)
    for old in glob.glob(os.path.join(logdir, f"{a.name}.rank*")):
        os.remove(old)
    port = a.port or random.randint(20000, 45000)
    fault_file = os.path.join(logdir, f"{a.name}.fault-applied")
    if os.path.exists(fault_file):
        os.remove(fault_file)
    netns("restore", check=False)
    before = nic_stats()
    procs, logs = [], []
    t_start = time.monotonic()
    for r in range(world):
        ns, env = rank_env(a, r, world, port, logdir)
        cmd = [NETNS, "exec", ns, a.python, os.path.abspath(__file__), "rank", "--mode", a.mode,
               "--transport", a.transport,
               "--device", "cpu" if a.transport == "gloo" else "cuda",
               "--size", str(a.size), "--sizes", a.sizes, "--graph-sizes", a.graph_sizes,
               "--replays", str(a.replays), "--duration", str(a.duration),
               "--stall", str(a.stall), "--init-timeout", str(a.init_timeout),
               "--iters", str(a.iters), "--warmup", str(a.warmup), "--coll", a.coll]
        if a.every_dtype:
            cmd.append("--every-dtype")
        if a.mode == "bw" and a.fault != "none":
            cmd += ["--fault-file", fault_file]
        log = open(os.path.join(logdir, f"{a.name}.rank{r}.out"), "w")
        logs.append(log)
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, bufsize=1,
                                      start_new_session=True))
    events = {"loop_start": threading.Event(), "fault_now": threading.Event()}
    results: dict[int, dict] = {}
    marks: dict[int, set] = {r: set() for r in range(world)}
    last_output = [time.monotonic()]

    def reader(r: int, p: subprocess.Popen, log) -> None:
        for line in p.stdout:
            log.write(line)
            log.flush()
            line = line.rstrip("\n")
            if r == 0:
                last_output[0] = time.monotonic()
            if line.startswith("RESULT "):
                try:
                    results[r] = json.loads(line[7:])
                except ValueError:
                    pass
                continue
            for mark in ("STALLED", "MISMATCH", "ERROR", "Timeout (", "Traceback"):
                if mark in line:
                    marks[r].add(mark)
            if line.startswith("LOOP-START") and r == 0:
                events["loop_start"].set()
            if line.startswith("FAULT-NOW"):
                events["fault_now"].set()
            if r == 0 or line.startswith(("STALLED", "MISMATCH", "ERROR", "CHECK FAIL")):
                say(f"  [{a.name} r{r} {time.monotonic() - t_start:6.1f}s] {line}")

    threads = [threading.Thread(target=reader, args=(r, p, logs[r]), daemon=True)
               for r, p in enumerate(procs)]
    for t in threads:
        t.start()

    fault_log: list = []
    flapper: list = []

    def apply_fault() -> None:
        ns, nic = a.fault_ns, a.fault_nic
        t = time.monotonic() - t_start
        if a.fault == "down":
            netns("nic-down", ns, nic)
        elif a.fault == "blackhole":
            netns("blackhole", ns, nic)
        elif a.fault == "flap":
            flapper.append(subprocess.Popen([NETNS, "flap", ns, nic, str(a.flaps),
                                             str(a.flap_down), str(a.flap_up)],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                            start_new_session=True))
        fault_log.append({"fault": a.fault, "ns": ns, "nic": nic, "at_s": round(t, 2)})
        say(f"  [{a.name} ctl {t:6.1f}s] fault {a.fault} {ns} {nic}"
            + (f" x{a.flaps} ({a.flap_down}s down, {a.flap_up}s up)" if a.fault == "flap" else ""))

    def fault_thread() -> None:
        if a.mode == "loop":
            if events["loop_start"].wait(a.init_timeout + 30):
                time.sleep(a.fault_at)
                if all(p.poll() is None for p in procs):
                    apply_fault()
        elif a.mode == "bw":
            if events["fault_now"].wait(a.timeout):
                apply_fault()
                time.sleep(0.5)
                with open(fault_file, "w") as f:
                    f.write("now\n")

    if a.fault != "none":
        threading.Thread(target=fault_thread, daemon=True).start()

    status = None
    deadline = t_start + a.timeout
    first_bad_exit = None
    while True:
        codes = [p.poll() for p in procs]
        now = time.monotonic()
        if all(c is not None for c in codes):
            break
        if first_bad_exit is None and any(c not in (None, 0) for c in codes):
            first_bad_exit = now
        if first_bad_exit is not None and now - first_bad_exit > a.grace:
            status = status or "peer-exit"
            break
        if now > deadline:
            status = "timeout"
            say(f"  [{a.name} ctl] TIMEOUT after {a.timeout} s: killing the ranks")
            break
        if now - last_output[0] > a.stall + a.init_timeout:
            status = "stalled-controller"
            say(f"  [{a.name} ctl] STALLED: nothing from rank 0 for "
                f"{now - last_output[0]:.0f} s: killing the ranks")
            break
        time.sleep(0.2)
    killed = []
    for r, p in enumerate(procs):
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            killed.append(r)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    for t in threads:
        t.join(timeout=5)
    for f in flapper:
        if f.poll() is None:
            os.killpg(f.pid, signal.SIGKILL)
        f.wait(timeout=10)
    netns("restore", check=False)
    after = nic_stats()
    for log in logs:
        log.close()
    wall = time.monotonic() - t_start

    codes = [p.returncode for p in procs]
    facts = nccl_log_facts(logdir, a.name) if a.transport not in ("gloo", "r2ccl") else {}
    stalled = any("STALLED" in marks[r] or "Timeout (" in marks[r] for r in marks) or \
        status == "stalled-controller"
    if stalled:
        verdict, rc = "STALLED", EXIT_STALLED
    elif any("MISMATCH" in marks[r] for r in marks) or EXIT_WRONG in codes:
        verdict, rc = "WRONG", EXIT_WRONG
    elif status == "timeout":
        verdict, rc = "TIMEOUT", EXIT_KILLED
    elif any(c != 0 for c in codes):
        verdict, rc = "ERROR", EXIT_ERROR
    else:
        verdict, rc = "OK", EXIT_OK
    if a.transport == "plugin" and facts.get("networks") and \
            any(n in ("Socket", "IB") for n in facts["networks"]):
        verdict, rc = f"WRONG-NET({','.join(facts['networks'])})", EXIT_WRONG_NET
    nic_delta = {}
    for k, v in after.items():
        if k in before:
            nic_delta[k] = {"state_after": v["state"],
                            "tx_MB": round((v["tx"] - before[k]["tx"]) / 1e6, 1),
                            "rx_MB": round((v["rx"] - before[k]["rx"]) / 1e6, 1)}
    case = {"name": a.name, "mode": a.mode, "coll": a.coll, "transport": a.transport,
            "gpus": world,
            "fault": a.fault, "fault_nic": a.fault_nic, "fault_ns": a.fault_ns,
            "faults_applied": fault_log, "verdict": verdict, "exit_codes": codes,
            "killed_ranks": killed, "wall_s": round(wall, 1),
            "results": {str(r): results.get(r) for r in range(world)},
            "marks": {str(r): sorted(m) for r, m in marks.items()}, "nic_bytes": nic_delta,
            "nccl_log": facts,
            "env": {k: v for k, v in rank_env(a, 0, world, port, logdir)[1].items()
                    if k.startswith(("NCCL_", "R2CCL_", "GLOO_", "CUDA_VISIBLE"))}}
    with open(os.path.join(casedir, f"{a.name}.json"), "w") as f:
        json.dump(case, f, indent=1)
    tx = " ".join(f"{k.split('/')[1]}={v['tx_MB']:.0f}" for k, v in nic_delta.items()
                  if k.startswith("r2n0/"))
    say(f"CASE {a.name}: {verdict} (exit codes {codes}, {wall:.0f} s; r2n0 tx MB {tx}; "
        f"networks {facts.get('networks')})")
    return rc


# ---------------------------------------------------------------------------------------------
# The summary
# ---------------------------------------------------------------------------------------------


def summary_main(a: argparse.Namespace) -> int:
    cases = []
    for path in sorted(glob.glob(os.path.join(a.dir, "cases", "*.json")),
                       key=os.path.getmtime):
        with open(path) as f:
            cases.append(json.load(f))
    rows = []
    for c in cases:
        r0 = c["results"].get("0") or {}
        if c["mode"] == "correct":
            ch = r0.get("checks") or {}
            figure = f"{ch.get('pass', 0)} passed, {ch.get('fail', 0)} failed"
        elif c["mode"] == "bw":
            figure = (f"{c.get('coll', 'all_reduce')} healthy "
                      f"{r0.get('busbw_healthy_GBps', '-')} GB/s")
            if c["fault"] != "none":
                deg = r0.get("busbw_degraded_GBps")
                deg = f"{deg} GB/s" if deg is not None else (
                    "stalled" if "stalled_in" in r0 else "-")
                figure += f", {c['fault_nic']} down {deg}"
        elif "stalled_in" in r0:
            figure = (f"stalled after {r0.get('iterations', '-')} it, "
                      f"{r0.get('seconds', '-')} s in; bad {r0.get('bad_iterations', '-')}")
        else:
            figure = (f"{r0.get('iterations', '-')} it, {r0.get('busbw_GBps', '-')} GB/s, "
                      f"longest gap {r0.get('max_gap_s', '-')} s, "
                      f"bad {r0.get('bad_iterations', '-')}")
        nets = ",".join((c.get("nccl_log") or {}).get("networks") or []) or "-"
        tx = "/".join(f"{v['tx_MB']:.0f}" for k, v in sorted(c["nic_bytes"].items())
                      if k.startswith("r2n0/eth"))
        fault = "-" if c["fault"] == "none" else f"{c['fault']} {c['fault_ns']}:{c['fault_nic']}"
        rows.append((c["name"], c["transport"], nets, c["mode"], fault, c["verdict"], figure,
                     tx, f"{c['wall_s']:.0f}"))
    head = ("case", "transport", "NCCL net", "mode", "fault", "verdict", "figures",
            "r2n0 tx MB eth0/1/2/3", "wall s")
    md = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    md += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    with open(os.path.join(a.dir, "summary.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(a.dir, "summary.json"), "w") as f:
        json.dump(cases, f, indent=1)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)] if rows else []
    for r in [head, *rows]:
        say("  ".join(str(x).ljust(w) for x, w in zip(r, widths)))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="role", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--mode", choices=("correct", "loop", "bw"), required=True)
    common.add_argument("--size", type=parse_size, default=parse_size("64M"),
                        help="loop and bw: bytes of the bf16 all-reduce (default 64M)")
    common.add_argument("--sizes", default="4K,64K,1M,16M,64M", help="correct: eager sizes")
    common.add_argument("--graph-sizes", default="64K,4M", help="correct: CUDA graph sizes")
    common.add_argument("--replays", type=int, default=6, help="correct: replays of a graph")
    common.add_argument("--every-dtype", action="store_true",
                        help="correct: every collective in bf16, fp16 and fp32 (else the "
                             "all-reduce only; the others in bf16)")
    common.add_argument("--duration", type=float, default=25.0, help="loop: seconds")
    common.add_argument("--stall", type=float, default=15.0,
                        help="seconds without progress that count as a stall")
    common.add_argument("--init-timeout", type=float, default=120.0)
    common.add_argument("--iters", type=int, default=20, help="bw: timed iterations")
    common.add_argument("--coll", choices=("all_reduce", "all_gather", "reduce_scatter"),
                        default="all_reduce", help="bw: the collective timed")
    common.add_argument("--warmup", type=int, default=5, help="bw: warm-up iterations")
    r = sub.add_parser("rank", parents=[common])
    r.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    r.add_argument("--transport", choices=("plugin", "socket", "gloo", "r2ccl"), default="socket")
    r.add_argument("--fault-file", default="")
    r.add_argument("--pg-timeout", type=float, default=300.0)
    c = sub.add_parser("run", parents=[common])
    c.add_argument("--transport", choices=("plugin", "socket", "gloo", "r2ccl"), required=True)
    c.add_argument("--gpus", type=int, default=2)
    c.add_argument("--name", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--plugin", default=os.path.join(HERE, "..", "..", "build-gpu", "lib",
                                                    "libnccl-net-r2ccl.so"))
    c.add_argument("--nccl-net", default="", help="plugin: NCCL_NET (the plugin's name)")
    c.add_argument("--nics", type=lambda s: s.split(","), default=list(NICS))
    c.add_argument("--gloo-ifname", default="eth0")
    c.add_argument("--fault", choices=("none", "down", "blackhole", "flap"), default="none")
    c.add_argument("--fault-nic", default="eth1")
    c.add_argument("--fault-ns", default="r2n0")
    c.add_argument("--fault-at", type=float, default=5.0, help="loop: seconds after its start")
    c.add_argument("--flaps", type=int, default=5)
    c.add_argument("--flap-down", type=float, default=1.0)
    c.add_argument("--flap-up", type=float, default=1.0)
    c.add_argument("--timeout", type=float, default=150.0, help="the whole case, seconds")
    c.add_argument("--grace", type=float, default=5.0,
                   help="seconds the other ranks get once one has failed")
    c.add_argument("--port", type=int, default=0)
    c.add_argument("--python", default=sys.executable)
    c.add_argument("--env", action="append", default=[], help="K=V for every rank (last word)")
    s = sub.add_parser("summary")
    s.add_argument("dir")
    a = p.parse_args()
    if a.role == "rank":
        return rank_main(a)
    if a.role == "run":
        a.plugin = os.path.abspath(a.plugin)
        a.out = os.path.abspath(a.out)
        return run_main(a)
    return summary_main(a)


if __name__ == "__main__":
    raise SystemExit(main())
