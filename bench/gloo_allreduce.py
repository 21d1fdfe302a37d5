#!/usr/bin/python3
"""gloo_allreduce.py: baseline all-reduce benchmark over Gloo (torch.distributed, backend "gloo").

The Gloo side of the side-by-side comparison with r2ccl; bench/src/mpi_allreduce.c is the Open MPI
side and prints the same lines.  One process per rank, started by hand or by bench/baseline.sh:

  /usr/bin/python3 bench/gloo_allreduce.py --rank R --nranks P --master HOST:PORT \\
      [-b MIN] [-e MAX] [-f FACTOR] [-n ITERS] [-w WARMUP] [-c 0|1] [--chunks K]

It needs Debian's python3-torch, which only the system interpreter /usr/bin/python3 can import.
Rank 0 listens at HOST:PORT (torch's TCPStore) for the rendezvous; the data then flows over
Gloo's own TCP connections.

Interfaces: Gloo takes them from GLOO_SOCKET_IFNAME (e.g. "eth1" or "lo").  A comma-separated
list ("eth1,eth2,eth3,eth4") makes torch create one Gloo device, and one full mesh of
connections, per interface, so Gloo uses all of them, but each collective runs entirely on one
of them: consecutive collectives take the interfaces in turn.  A single synchronous all-reduce
therefore moves over one interface at a time.  --chunks K splits every all-reduce into K
asynchronous all-reduces of contiguous slices issued together, so that with K = the number of
interfaces the slices travel over all of them at once (what a user of Gloo would do to stripe);
the lines then say "impl":"gloo-chunksK".  Without GLOO_SOCKET_IFNAME Gloo picks the interface
the host name resolves to.

Float32 sum, conventions of nccl-tests.  Sizes are bytes with an optional K, M or G suffix (powers
of 1024), rounded down to whole float32 elements (at least one).  For each size: WARMUP untimed
all-reduces, a barrier, ITERS timed ones (time.perf_counter); the time of a size is the largest
over the ranks of the per-iteration average (an all_reduce MAX).  torch.distributed.all_reduce
works in place, so the timed iterations reduce a zero-filled work tensor (zeros stay zeros; the
values do not change the cost).  With -c 1 the inputs (rank r, element i: (7r + 3i) % 9 - 4, small
integers, so the float sums are exact) are copied into a tensor that is then reduced and checked
element by element on every rank.

Rank 0 prints one JSON object per size and line:
  {"impl":"gloo","op":"allreduce","nranks":P,"bytes":B,"time_us":T,
   "algbw_gbps":A,"busbw_gbps":BB,"wrong":W}
algbw = bytes / time / 1e9, busbw = algbw * 2 * (P - 1) / P, wrong = wrong elements summed over
the ranks (0 when not checked).

Exit status: 0 ok, 1 some element was wrong, 2 bad arguments.
"""

import argparse
import datetime
import json
import re
import sys
import time

MAX_BYTES = 1 << 32  # 4 GiB: far above what the testbed can move
FLOAT_BYTES = 4


def parse_size(text):
    """'64', '8K', '4M', '1G' -> bytes (powers of 1024)."""
    m = re.fullmatch(r"([0-9]{1,12})([kKmMgG]?)", text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid size '{text}' (e.g. 8, 64K, 4M)")
    value = int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]
    if value > MAX_BYTES:
        raise argparse.ArgumentTypeError(f"size '{text}' is above 4G")
    return value


def int_in(lo, hi):
    """argparse type: a decimal integer in [lo, hi]."""

    def parse(text):
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is not in {lo}..{hi}")
        return value

    return parse


def parse_master(text):
    """'HOST:PORT' -> (HOST, PORT)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"invalid --master '{text}' (HOST:PORT)")
    return host, int(port)


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="Gloo all-reduce benchmark (float32 sum), nccl-tests conventions.")
    p.add_argument("--rank", type=int_in(0, 65535), required=True, help="this process's rank")
    p.add_argument("--nranks", type=int_in(1, 65536), required=True, help="number of ranks")
    p.add_argument("--master", type=parse_master, required=True,
                   help="HOST:PORT where rank 0 listens for the rendezvous")
    p.add_argument("-b", dest="min_bytes", type=parse_size, default=8,
                   help="smallest size in bytes, K/M/G suffixes (default 8)")
    p.add_argument("-e", dest="max_bytes", type=parse_size, default=4 << 20,
                   help="largest size in bytes (default 4M)")
    p.add_argument("-f", dest="factor", type=int_in(2, 1024), default=2,
                   help="size multiplier between steps (default 2)")
    p.add_argument("-n", dest="iters", type=int_in(1, 1000000), default=20,
                   help="timed iterations per size (default 20)")
    p.add_argument("-w", dest="warmup", type=int_in(0, 1000000), default=5,
                   help="untimed iterations per size (default 5)")
    p.add_argument("-W", dest="settle", type=int_in(0, 1000000), default=0,
                   help="untimed all-reduces of the smallest size before the first (default 0)")
    p.add_argument("-c", dest="check", type=int_in(0, 1), default=1,
                   help="check every element on every rank (default 1)")
    p.add_argument("--chunks", type=int_in(1, 64), default=1,
                   help="split each all-reduce into this many concurrent ones (default 1)")
    p.add_argument("--timeout", type=int_in(1, 3600), default=120,
                   help="seconds the rendezvous and each collective may take (default 120)")
    args = p.parse_args(argv)
    if args.rank >= args.nranks:
        p.error(f"--rank {args.rank} must be below --nranks {args.nranks}")
    if args.min_bytes > args.max_bytes:
        p.error("-b must not exceed -e")
    return args


def sizes(args):
    """MIN, MIN*FACTOR, ... up to MAX (bounded: FACTOR >= 2 and MAX <= 4 GiB)."""
    b = args.min_bytes
    while True:
        yield b
        if b > args.max_bytes // args.factor:
            return
        b *= args.factor


def main(argv):
    args = parse_args(argv)
    import torch  # imported late so that --help and argument errors need no torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # fills and checks only; Gloo has its own threads
    host, port = args.master
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=args.rank,
                            world_size=args.nranks,
                            timeout=datetime.timedelta(seconds=args.timeout))
    rank, nranks = args.rank, args.nranks
    impl = "gloo" if args.chunks == 1 else f"gloo-chunks{args.chunks}"

    max_count = max(1, args.max_bytes // FLOAT_BYTES)
    idx = torch.arange(max_count, dtype=torch.int64)
    inputs = ((rank * 7 + idx * 3) % 9 - 4).to(torch.float32)
    # Expected sums: the input depends on i only through i % 9.
    table = torch.tensor([sum((r * 7 + k * 3) % 9 - 4 for r in range(nranks)) for k in range(9)],
                         dtype=torch.float32)
    expected = table[idx % 9]
    del idx
    work = torch.zeros(max_count, dtype=torch.float32)
    checked = torch.empty(max_count, dtype=torch.float32)

    def allreduce(t):
        """One all-reduce of t, as --chunks concurrent all-reduces of contiguous slices."""
        if args.chunks == 1:
            dist.all_reduce(t)
            return
        step = -(-t.numel() // args.chunks)
        handles = [dist.all_reduce(part, async_op=True) for part in t.split(step)]
        for h in handles:
            h.wait()

    for _ in range(args.settle):  # lets the processes settle onto cores
        allreduce(work[:max(1, args.min_bytes // FLOAT_BYTES)])
    total_wrong = 0
    for nbytes in sizes(args):
        count = max(1, nbytes // FLOAT_BYTES)
        buf = work[:count]
        for _ in range(args.warmup):
            allreduce(buf)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            allreduce(buf)
        avg = torch.tensor([(time.perf_counter() - t0) / args.iters], dtype=torch.float64)
        dist.all_reduce(avg, op=dist.ReduceOp.MAX)

        wrong = torch.zeros(1, dtype=torch.int64)
        if args.check:
            out = checked[:count]
            out.copy_(inputs[:count])
            allreduce(out)
            wrong[0] = int((out != expected[:count]).sum())
        dist.all_reduce(wrong)  # every rank learns the total and exits with the same status
        total_wrong += int(wrong[0])

        if rank == 0:
            t = float(avg[0])
            moved = count * FLOAT_BYTES
            algbw = moved / t / 1e9 if t > 0 else 0.0
            busbw = algbw * 2 * (nranks - 1) / nranks
            print(json.dumps({"impl": impl, "op": "allreduce", "nranks": nranks, "bytes": moved,
                              "time_us": round(t * 1e6, 2), "algbw_gbps": round(algbw, 6),
                              "busbw_gbps": round(busbw, 6), "wrong": int(wrong[0])},
                             separators=(",", ":")), flush=True)

    dist.destroy_process_group()
    return 0 if total_wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
