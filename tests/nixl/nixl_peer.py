"""One side of a NIXL transfer stream through NIXL's agent API (the PyPI wheel), for the rail-fault
tests (tests/nixl/test_nixl_faults.py) and the UCX comparison (tests/nixl/compare.py).

    nixl_peer.py target    --dir D --backend R2CCL --transfers K [...]
    nixl_peer.py initiator --dir D --backend R2CCL --transfers K [...]

The target registers BLOCKS source blocks (a fixed pattern per block) and BLOCKS sink blocks
(zeros), and publishes its agent metadata and block addresses in D. The initiator loads them and
runs K transfers, alternately READ (a source block into one of its own slots, checked byte for
byte once DONE) and WRITE (a pattern of that transfer into a sink block), at most WINDOW in
flight, each with the notification "r<i>" or "w<i>". The target checks, on each "w<i>", that the
sink block holds transfer i's pattern, counts every notification (each must come exactly once),
and acknowledges each "w<i>" with a notification of its own, after which the initiator may
reuse that sink block.

With --memory cuda every buffer is a CUDA tensor of the process's GPU, registered as VRAM (the
GPU benchmark, bench/gpu/nixl-on-device.sh); the checks copy it to the host first.

Output, one line each: "progress <bytes>" (every 0.2 s), "elapsed <seconds>" of the stream,
"ok ..." and exit 0; "error ..." and exit 1; past --deadline, "error ... (a hang)" and exit 3.
With --expect-failure the initiator streams until a transfer fails ("failed <i> after <s> s:
<error>"), waits for the file D/restored, then runs --after transfers that must all succeed
("ok after-restore <n>").
"""

import argparse
import functools
import os
import pickle
import re
import sys
import time
from pathlib import Path

import numpy as np
from nixl._api import nixl_agent, nixl_agent_config


def say(*parts):
    print(*parts, flush=True)


@functools.lru_cache(maxsize=4)
def _offsets(size: int) -> np.ndarray:
    idx = np.arange(size, dtype=np.uint64)
    return ((idx * 2654435761 + (idx >> 8) * 97) & 0xFF).astype(np.uint8)


def pattern(seed: int, size: int) -> np.ndarray:
    """A block's bytes: distinct per seed and per offset (a byte-wide sum, wrapping)."""
    return _offsets(size) + np.uint8((seed * 40503) & 0xFF)


def write_atomic(path: Path, data: bytes):
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def wait_file(path: Path, deadline: float) -> bytes:
    while not path.exists():
        if time.monotonic() > deadline:
            say(f"error no {path.name} (a hang)")
            sys.exit(3)
        time.sleep(0.02)
    return path.read_bytes()


class HostMemory:
    """Buffers in host memory (numpy), registered as DRAM."""
    kind, dev = "DRAM", 0

    def zeros(self, n):
        return np.zeros(n, dtype=np.uint8)

    def filled(self, arr):
        return arr

    def addr(self, buf):
        return buf.ctypes.data

    def read(self, buf, off, n):
        return buf[off:off + n]

    def write(self, buf, off, arr):
        buf[off:off + len(arr)] = arr

    def clear(self, buf, off, n):
        buf[off:off + n] = 0


class CudaMemory:
    """Buffers in the GPU's memory (torch tensors of uint8), registered as VRAM."""
    kind = "VRAM"

    def __init__(self):
        import torch
        self.torch = torch
        self.dev = torch.cuda.current_device()

    def zeros(self, n):
        return self.torch.zeros(n, dtype=self.torch.uint8, device="cuda")

    def filled(self, arr):
        t = self.torch.from_numpy(np.ascontiguousarray(arr)).to("cuda")
        self.torch.cuda.synchronize()
        return t

    def addr(self, buf):
        return buf.data_ptr()

    def read(self, buf, off, n):
        return buf[off:off + n].cpu().numpy()

    def write(self, buf, off, arr):
        buf[off:off + len(arr)].copy_(self.torch.from_numpy(np.ascontiguousarray(arr)))
        self.torch.cuda.synchronize()  # in the GPU before the transfer reads it

    def clear(self, buf, off, n):
        buf[off:off + n].zero_()
        self.torch.cuda.synchronize()


class Peer:
    def __init__(self, args, name):
        self.args = args
        self.dir = Path(args.dir)
        self.deadline = time.monotonic() + args.deadline
        self.mem = CudaMemory() if args.memory == "cuda" else HostMemory()
        cfg = nixl_agent_config(backends=[args.backend])
        self.agent = nixl_agent(name, cfg)

    def register(self, buf):
        m = self.mem
        descs = self.agent.get_reg_descs([(m.addr(buf), buf.nbytes, m.dev, "")], m.kind)
        return self.agent.register_memory(descs, backends=[self.args.backend])

    def descs(self, addr, size):
        return self.agent.get_xfer_descs([(addr, size, self.mem.dev)], self.mem.kind)

    def check_deadline(self, what):
        if time.monotonic() > self.deadline:
            say(f"error {what} past the deadline of {self.args.deadline} s (a hang)")
            sys.exit(3)


def run_target(args):
    p = Peer(args, "target")
    m = p.mem
    size, nblocks = args.block, args.blocks
    src = m.filled(np.concatenate([pattern(1000 + b, size) for b in range(nblocks)]))
    sink = m.zeros(nblocks * size)
    p.register(src)
    p.register(sink)
    write_atomic(p.dir / "target.md", p.agent.get_agent_metadata())
    write_atomic(p.dir / "target.blocks",
                 pickle.dumps({"src": m.addr(src), "sink": m.addr(sink), "dev": m.dev,
                               "kind": m.kind, "block": size, "blocks": nblocks}))
    init_md = wait_file(p.dir / "initiator.md", p.deadline)
    p.agent.add_remote_agent(init_md)
    say("ready")
    seen = {}
    bad = []
    expected = {f"{'r' if i % 2 == 0 else 'w'}{i}" for i in range(args.transfers)}
    stop = p.dir / "stop"
    last_new = None
    while True:
        for agent, msgs in p.agent.get_new_notifs().items():
            for msg in msgs:
                tag = msg.decode()
                seen[tag] = seen.get(tag, 0) + 1
                if seen[tag] > 1:
                    bad.append(f"notification {tag} from {agent} came {seen[tag]} times")
                if tag.startswith("w") and seen[tag] == 1:
                    i = int(tag[1:])
                    b = (i // 2) % nblocks
                    got = m.read(sink, b * size, size)
                    if not np.array_equal(got, pattern(i, size)):
                        wrong = int(np.count_nonzero(got != pattern(i, size)))
                        bad.append(f"write {i}: sink block {b} has {wrong} wrong bytes")
                    p.agent.send_notif(agent, f"ack{i}".encode())
                last_new = time.monotonic()
        if args.open_ended and stop.exists() and (last_new is None or
                                                  time.monotonic() - last_new > 1.0):
            break
        if not args.open_ended and expected <= set(seen) and time.monotonic() - last_new > 1.0:
            break  # every notification, and a second more for a late duplicate
        p.check_deadline(f"{len(set(seen) & expected)} of {len(expected)} notifications")
        time.sleep(0.002)
    if bad:
        say("error " + "; ".join(bad[:5]))
        sys.exit(1)
    missing = sorted(expected - set(seen), key=lambda t: int(t[1:]))
    (p.dir / "target.done").touch()  # the initiator may leave now
    if missing and not args.open_ended:
        say(f"error {len(missing)} notifications never came: {missing[:5]}")
        sys.exit(1)
    say(f"ok notifications {len(seen)} each once")


def run_initiator(args):
    p = Peer(args, "initiator")
    m = p.mem
    target_md = wait_file(p.dir / "target.md", p.deadline)
    layout = pickle.loads(wait_file(p.dir / "target.blocks", p.deadline))
    size, nblocks = layout["block"], layout["blocks"]
    window = args.window
    slots = m.zeros(window * size)
    wsrc = m.zeros(window * size)
    p.register(slots)
    p.register(wsrc)
    name = p.agent.add_remote_agent(target_md)
    write_atomic(p.dir / "initiator.md", p.agent.get_agent_metadata())
    acked = set()
    done_bytes = 0
    last_progress = 0.0
    inflight = {}  # slot -> (i, handle)
    free = list(range(window))

    def remote_block(kind, b):
        base = layout["src"] if kind == "r" else layout["sink"]
        return p.agent.get_xfer_descs([(base + b * size, size, layout["dev"])], layout["kind"])

    def post(i, slot):
        kind = "r" if i % 2 == 0 else "w"
        b = (i // 2) % nblocks
        local = p.descs(m.addr(slots if kind == "r" else wsrc) + slot * size, size)
        if kind == "w":
            m.write(wsrc, slot * size, pattern(i, size))
        h = p.agent.initialize_xfer("READ" if kind == "r" else "WRITE", local, remote_block(kind, b),
                                    name, f"{kind}{i}".encode())
        state = p.agent.transfer(h)
        if state == "ERR":
            raise RuntimeError(f"transfer {i} not posted")
        inflight[slot] = (i, h)

    def drain_acks():
        for _, msgs in p.agent.get_new_notifs().items():
            for msg in msgs:
                t = msg.decode()
                if t.startswith("ack"):
                    acked.add(int(t[3:]))

    def sink_free(i):
        # The sink block of write i was last written by write i - 2*nblocks: acknowledged?
        prev = i - 2 * nblocks
        return i % 2 == 0 or prev < 0 or prev in acked

    def stream(first, count, expect_failure):
        nonlocal done_bytes, last_progress
        i = first
        end = first + count
        while i < end or inflight:
            drain_acks()
            while i < end and free and sink_free(i):
                post(i, free.pop())
                i += 1
            for slot, (j, h) in list(inflight.items()):
                try:
                    state = p.agent.check_xfer_state(h)
                except Exception as e:  # NIXL raises its typed errors
                    state = f"ERR {type(e).__name__}: {e}"
                if state == "PROC":
                    continue
                if state != "DONE":
                    if expect_failure:
                        return j, state
                    raise RuntimeError(f"transfer {j} ended {state}")
                if j % 2 == 0:
                    b = (j // 2) % nblocks
                    got = m.read(slots, slot * size, size)
                    if not np.array_equal(got, pattern(1000 + b, size)):
                        wrong = int(np.count_nonzero(got != pattern(1000 + b, size)))
                        raise RuntimeError(f"read {j}: {wrong} wrong bytes of source block {b}")
                    m.clear(slots, slot * size, size)
                p.agent.release_xfer_handle(h)
                del inflight[slot]
                free.append(slot)
                done_bytes += size
            now = time.monotonic()
            if now - last_progress > 0.2:
                say(f"progress {done_bytes}")
                last_progress = now
            p.check_deadline(f"transfer {i} of {end}")
            time.sleep(0.0005)
        return None, None

    try:
        if not args.expect_failure:
            t0 = time.monotonic()
            stream(0, args.transfers, False)
            say(f"elapsed {time.monotonic() - t0:.3f}")
            report_metrics()
            say(f"ok transfers {args.transfers} bytes {done_bytes}")
            return
        t0 = time.monotonic()
        j, state = stream(0, 1 << 30, True)
        say(f"failed {j} after {time.monotonic() - t0:.1f} s: {state}")
        # What failed is done with; the rest still in flight end one way or the other.
        t_wait = time.monotonic() + args.deadline
        while inflight and time.monotonic() < t_wait:
            for slot, (_, h) in list(inflight.items()):
                try:
                    st = p.agent.check_xfer_state(h)
                except Exception:
                    st = "ERR"
                if st != "PROC":
                    try:
                        p.agent.release_xfer_handle(h)
                    except Exception:
                        continue
                    del inflight[slot]
                    free.append(slot)
            time.sleep(0.01)
        if inflight:
            say(f"error {len(inflight)} transfers never ended after the failure (a hang)")
            sys.exit(3)
        wait_file(p.dir / "restored", p.deadline)
        acked.clear()
        # Fresh transfer numbers past every sink block's last use.
        first = 2 * nblocks * (1 + (j + 2 * nblocks) // (2 * nblocks)) + 2 * nblocks
        acked.update(range(first - 2 * nblocks, first))
        stream(first, args.after, False)
        say(f"ok after-restore {args.after}")
    except RuntimeError as e:
        say(f"error {e}")
        sys.exit(1)
    finally:
        (p.dir / "stop").touch()
        # Stays (bounded) until the target has taken every notification and acknowledged it.
        wait_file(p.dir / "target.done", time.monotonic() + 60)


def report_metrics():
    """r2ccl's NIXL counters of this process, from its own Prometheus endpoint (when served),
    summed over the process's communicators and engines (label comm)."""
    port = os.environ.get("R2CCL_METRICS_PORT")
    if not port:
        return
    import urllib.request
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {}
    for ln in text.splitlines():
        if ln.startswith("r2ccl_nixl_"):
            name, value = ln.rsplit(" ", 1)
            name = re.sub(r',?comm="[^"]*"', "", name).replace("{,", "{").replace("{}", "")
            values[name] = values.get(name, 0.0) + float(value)
    say("metrics " + " ".join(f"{k}={v:g}" for k, v in sorted(values.items())))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("role", choices=["target", "initiator"])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--backend", default="R2CCL")
    ap.add_argument("--transfers", type=int, default=200)
    ap.add_argument("--block", type=int, default=1 << 20)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--deadline", type=float, default=120.0)
    ap.add_argument("--expect-failure", action="store_true")
    ap.add_argument("--after", type=int, default=20)
    ap.add_argument("--memory", choices=["host", "cuda"], default="host",
                    help="where every buffer is (cuda: the process's GPU, as VRAM)")
    ap.add_argument("--open-ended", action="store_true",
                    help="target: run until D/stop appears (the initiator's count is open)")
    args = ap.parse_args()
    (run_target if args.role == "target" else run_initiator)(args)


if __name__ == "__main__":
    main()
