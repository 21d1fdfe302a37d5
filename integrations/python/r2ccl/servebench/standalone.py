"""Standalone mode: one process per rank issues the communication a serving engine issues, with
no engine and no GPU. Launched like any distributed job (torchrun's or mpirun's environment,
or --rank/--world/--master):

    r2ccl-servebench standalone --model llama-3.1-8b --tp 2 --rate 0.5 --duration 300 \\
        --backend r2ccl --out run/

Every instance's first rank (stage 0, TP index 0) runs the scheduler (scheduler.py) on the
requests that come to it and hands each step's plan to its TP group (a broadcast) and down its
pipeline (a send). Every rank then runs the step: the compute model's time for each layer
(slept, not computed) and the step's collectives on real tensors of the real sizes, through the
backend under test: r2ccl (its Communicator, split into the TP groups, pipeline links and KV
pairs) or torch.distributed's Gloo. Under prefill/decode disaggregation each prefill instance's
ranks send every finished prompt's KV cache, layer by layer, to the decode instance's ranks of
the same stage and TP index from a thread of their own, as a KV connector does; a decode
instance admits a request once its first rank holds the whole cache, and its other ranks wait
for theirs before the step that uses it.

Each instance's first rank writes OUT/rank<R>.json: every request's arrival and token times and
its error if it failed, and the steps (start, end, tokens, seconds spent communicating). Every
rank writes its own communication totals. `r2ccl-servebench report OUT` summarizes."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections import deque
from datetime import timedelta
from pathlib import Path

from . import model as m
from . import workload
from .scheduler import Scheduler, Seq, Step

PLAN_MAX_IDS = 256  # a plan names at most this many requests (prefills done / KV to wait for)
PLAN_LEN = 6 + PLAN_MAX_IDS
STOP, IDLE, RUN = 0, 1, 2
KV_KEEPALIVE_S = 1.0
IDLE_TICK_S = 0.05


class CommFailed(RuntimeError):
    pass


# ---- backends: the same calls over r2ccl or Gloo, on groups of global ranks

class Group:
    """A group of global ranks; `me` is this rank's index in it."""

    def __init__(self, backend, ranks: list[int], handle):
        self.backend, self.ranks, self.handle = backend, ranks, handle
        self.me = ranks.index(backend.rank)

    def _timed(self, op: str, nbytes: int, fn):
        t = time.perf_counter()
        me = threading.get_ident()
        self.backend.in_flight[me] = (time.monotonic(), op)
        try:
            fn()
        except Exception as e:  # noqa: BLE001 (any failure of the library ends this rank's run)
            raise CommFailed(f"{self.backend.name} {op} over ranks {self.ranks}: {e}") from None
        finally:
            self.backend.in_flight.pop(me, None)
        dt = time.perf_counter() - t
        self.backend.account(op, nbytes, dt)
        return dt


class R2Backend:
    name = "r2ccl"

    def __init__(self, rank: int, world: int, store, timeout_s: float):
        from r2ccl.communicator import Communicator, get_unique_id

        self.rank, self.world = rank, world
        if rank == 0:
            store.set("servebench/r2ccl-id", get_unique_id())
        store.wait(["servebench/r2ccl-id"], timedelta(seconds=timeout_s))
        uid = store.get("servebench/r2ccl-id")
        self.comm = Communicator(unique_id=uid, rank=rank, world_size=world)
        self.totals: dict[str, list[float]] = {}
        self.lock = threading.Lock()
        self.in_flight: dict[int, tuple[float, str]] = {}  # thread -> (since, call)

    def account(self, op: str, nbytes: int, dt: float) -> None:
        with self.lock:
            t = self.totals.setdefault(op, [0, 0, 0.0])
            t[0] += 1
            t[1] += nbytes
            t[2] += dt

    def group(self, ranks: list[int]) -> Group | None:
        """Every rank calls it with the same list, in the same order (a split of the world)."""
        mine = self.rank in ranks
        sub = self.comm.split(0 if mine else -1, ranks.index(self.rank) if mine else 0)
        return Group(self, ranks, sub) if mine else None

    def all_reduce(self, g: Group, t) -> float:
        return g._timed("all_reduce", t.numel() * t.element_size(), lambda: g.handle.all_reduce(t, t))

    def all_gather(self, g: Group, inp, out) -> float:
        return g._timed("all_gather", inp.numel() * inp.element_size(),
                        lambda: g.handle.all_gather(inp, out))

    def broadcast(self, g: Group, t, src: int) -> float:
        return g._timed("broadcast", t.numel() * t.element_size(), lambda: g.handle.broadcast(t, src))

    def send(self, g: Group, t, peer: int, op: str = "send") -> float:
        return g._timed(op, t.numel() * t.element_size(), lambda: g.handle.send(t, peer))

    def recv(self, g: Group, t, peer: int, op: str = "recv") -> float:
        return g._timed(op, t.numel() * t.element_size(), lambda: g.handle.recv(t, peer))

    def close(self) -> None:
        self.comm.close()


class GlooBackend(R2Backend):
    name = "gloo"

    def __init__(self, rank: int, world: int, store, timeout_s: float):
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.world = rank, world
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        self.totals = {}
        self.lock = threading.Lock()
        self.in_flight: dict[int, tuple[float, str]] = {}  # thread -> (since, call)

    def group(self, ranks: list[int]) -> Group | None:
        g = self.dist.new_group(ranks)
        return Group(self, ranks, g) if self.rank in ranks else None

    def all_reduce(self, g: Group, t) -> float:
        return g._timed("all_reduce", t.numel() * t.element_size(),
                        lambda: self.dist.all_reduce(t, group=g.handle))

    def all_gather(self, g: Group, inp, out) -> float:
        parts = list(out.chunk(len(g.ranks)))
        return g._timed("all_gather", inp.numel() * inp.element_size(),
                        lambda: self.dist.all_gather(parts, inp, group=g.handle))

    def broadcast(self, g: Group, t, src: int) -> float:
        return g._timed("broadcast", t.numel() * t.element_size(),
                        lambda: self.dist.broadcast(t, src=g.ranks[src], group=g.handle))

    def send(self, g: Group, t, peer: int, op: str = "send") -> float:
        return g._timed(op, t.numel() * t.element_size(),
                        lambda: self.dist.send(t, dst=g.ranks[peer], group=g.handle))

    def recv(self, g: Group, t, peer: int, op: str = "recv") -> float:
        return g._timed(op, t.numel() * t.element_size(),
                        lambda: self.dist.recv(t, src=g.ranks[peer], group=g.handle))

    def close(self) -> None:
        self.dist.destroy_process_group()


# ---- one rank

class Rank:
    def __init__(self, a, rank: int, world: int, store):
        import torch

        self.torch = torch
        self.a = a
        self.model = m.model_from(a.model, {k: getattr(a, k) for k in (
            "layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab")}, a.dtype)
        self.dep = m.Deployment(a.tp, a.pp, a.prefill, a.decode)
        self.dep.check(self.model)
        if world != self.dep.world:
            raise ValueError(f"the deployment needs {self.dep.world} ranks "
                             f"({self.dep.instances} instance(s) x TP {a.tp} x PP {a.pp}), "
                             f"not {world}")
        self.compute = m.compute_from(a.compute, self.model, self.dep, a.compute_scale)
        self.rank, self.world = rank, world
        self.instance, self.stage, self.tpi = self.dep.place(rank)
        self.role = self.dep.role(self.instance)
        self.leader = self.stage == 0 and self.tpi == 0
        backend = {"r2ccl": R2Backend, "gloo": GlooBackend}[a.backend]
        self.b = backend(rank, world, store,
                         a.setup_timeout if a.backend == "r2ccl" else a.comm_timeout)
        self._groups()
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
              "fp8": torch.uint8}[a.dtype]
        if a.backend == "gloo" and dt == torch.bfloat16:
            dt = torch.float16  # Gloo has no bf16 reductions; the same bytes move

        cap = a.max_batch_tokens * self.model.hidden
        self.act = torch.zeros(cap, dtype=dt)
        self.pp_buf = torch.zeros(2 * cap // self.dep.tp + 1, dtype=dt)
        self.pp_full = torch.zeros(2 * cap // self.dep.tp * self.dep.tp + self.dep.tp, dtype=dt)
        shard = max(self.model.vocab // self.dep.tp, 1)
        self.logits = torch.zeros(a.max_seqs * shard, dtype=dt)
        self.logits_all = torch.zeros(a.max_seqs * shard * self.dep.tp, dtype=dt)
        self.plan_t = torch.zeros(PLAN_LEN, dtype=torch.int64)
        self.steps: list[list[float]] = []
        self.kv_bytes = 0
        self.owed = 0.0
        self.error = ""

    def _groups(self) -> None:
        """Every rank makes every group, in one order (both backends need it)."""
        d = self.dep
        self.tp_group = self.pp_next = self.pp_prev = None
        self.kv_groups: dict[int, Group] = {}  # peer instance -> pair group
        for inst in range(d.instances):
            for st in range(d.pp):
                g = self.b.group([d.rank_of(inst, st, t) for t in range(d.tp)]) if d.tp > 1 else None
                if g is not None:
                    self.tp_group = g
        if d.pp > 1:
            for inst in range(d.instances):
                for t in range(d.tp):
                    for st in range(d.pp):
                        a, b = d.rank_of(inst, st, t), d.rank_of(inst, (st + 1) % d.pp, t)
                        g = self.b.group([a, b])
                        if g is not None and self.rank == a:
                            self.pp_next = g
                        if g is not None and self.rank == b:
                            self.pp_prev = g
        if d.disaggregated:
            for p in range(d.prefill):
                for dd in range(d.prefill, d.instances):
                    for st in range(d.pp):
                        for t in range(d.tp):
                            g = self.b.group([d.rank_of(p, st, t), d.rank_of(dd, st, t)])
                            if g is not None:
                                self.kv_groups[dd if self.role == "prefill" else p] = g

    # -- compute: owed time is slept in slices of at least a millisecond

    def work(self, seconds: float, flush: bool = False) -> None:
        self.owed += seconds
        if self.owed >= 1e-3 or (flush and self.owed > 0):
            t = time.perf_counter()
            time.sleep(self.owed)
            self.owed -= time.perf_counter() - t

    # -- a step on this rank

    def run_step(self, tokens: int, context: int, sampled: int) -> float:
        """The step's compute and communication; returns the seconds spent communicating."""
        d, b = self.dep, self.b
        comm = 0.0
        h = self.model.hidden
        act = self.act[: tokens * h]
        layers = self.model.layers // d.pp
        if self.stage > 0:
            part = self.pp_buf[: 2 * tokens * h // d.tp]
            comm += b.recv(self.pp_prev, part, 0, "pp_recv")
            if self.tp_group is not None:
                comm += b.all_gather(self.tp_group, part, self.pp_full[: part.numel() * d.tp])
        elif self.tp_group is not None:
            comm += b.all_reduce(self.tp_group, act)  # the vocabulary-parallel embedding
        per_layer = self.compute.layer_s(tokens, context) / 2
        for _ in range(layers):
            for _half in range(2):  # attention, then MLP
                self.work(per_layer)
                if self.tp_group is not None:
                    comm += b.all_reduce(self.tp_group, act)
        if self.stage < d.pp - 1:
            comm += b.send(self.pp_next, self.pp_buf[: 2 * tokens * h // d.tp], 1, "pp_send")
        elif sampled:
            self.work(self.compute.head_s(sampled), flush=True)
            if self.tp_group is not None:
                shard = self.logits.numel() // self.a.max_seqs
                comm += b.all_gather(self.tp_group, self.logits[: sampled * shard],
                                     self.logits_all[: sampled * shard * d.tp])
        self.work(0.0, flush=True)
        if d.pp > 1 and sampled:  # the sampled token ids go back to the first stage
            ids = self.plan_t[:sampled].clone()
            if self.stage == d.pp - 1:
                comm += b.send(self.pp_next, ids, 1, "pp_send")
            elif self.stage == 0:
                comm += b.recv(self.pp_prev, ids, 0, "pp_recv")
        return comm

    # -- plans: [kind, tokens, context, sampled, step, n_ids, ids...]

    def send_plan(self, kind: int, step: Step | None = None, ids: list[int] = ()) -> float:
        p = self.plan_t
        p.zero_()
        p[0] = kind
        if step is not None:
            p[1], p[2], p[3] = step.tokens, step.context, len(step.samples(self.role))
        p[5] = len(ids)
        for i, x in enumerate(ids[:PLAN_MAX_IDS]):
            p[6 + i] = x
        return self.forward_plan()

    def forward_plan(self) -> float:
        comm = 0.0
        if self.stage == 0 and self.tp_group is not None:
            comm += self.b.broadcast(self.tp_group, self.plan_t, 0)
        if self.stage < self.dep.pp - 1:
            comm += self.b.send(self.pp_next, self.plan_t, 1, "pp_send")
        return comm

    def recv_plan(self) -> tuple[int, int, int, int, list[int]]:
        if self.stage == 0:
            self.b.broadcast(self.tp_group, self.plan_t, 0)
        else:
            self.b.recv(self.pp_prev, self.plan_t, 0, "pp_recv")
        if self.stage < self.dep.pp - 1:
            self.b.send(self.pp_next, self.plan_t, 1, "pp_send")
        p = self.plan_t.tolist()
        return p[0], p[1], p[2], p[3], p[6:6 + p[5]]


class KvSender(threading.Thread):
    """A prefill rank's KV connector: sends each finished prompt's cache, layer by layer, to the
    decode instance it goes to. Header: [request, tokens]; [-1, 0] ends; [-2, 0] keeps alive."""

    def __init__(self, r: Rank):
        super().__init__(daemon=True, name="kv-sender")
        self.r = r
        self.q: queue.Queue = queue.Queue(maxsize=4096)
        self.error = ""

    def run(self) -> None:
        r, torch = self.r, self.r.torch
        layers = r.model.layers // r.dep.pp
        biggest = m.kv_shard_bytes(r.model, r.dep, r.a.max_input_len)
        buf = torch.zeros(biggest, dtype=torch.uint8)
        head = torch.zeros(2, dtype=torch.int64)
        try:
            while True:
                try:
                    item = self.q.get(timeout=KV_KEEPALIVE_S)
                except queue.Empty:
                    item = (-2, 0)
                req, tokens = item
                dests = list(r.kv_groups) if req < 0 else [r.dep.prefill + req % r.dep.decode]
                for dest in dests:
                    g = r.kv_groups[dest]
                    head[0], head[1] = req, tokens
                    r.b.send(g, head, 1 - g.me, "kv_header")
                    for _ in range(layers if req >= 0 else 0):
                        n = m.kv_shard_bytes(r.model, r.dep, tokens)
                        r.b.send(g, buf[:n], 1 - g.me, "kv_send")
                        r.kv_bytes += n
                if req == -1:
                    return
        except CommFailed as e:
            self.error = str(e)


class KvReceiver(threading.Thread):
    """A decode rank's side: receives every prompt's cache from one prefill instance."""

    def __init__(self, r: Rank, source: int, arrived):
        super().__init__(daemon=True, name=f"kv-receiver-{source}")
        self.r, self.g, self.arrived = r, r.kv_groups[source], arrived
        self.error = ""

    def run(self) -> None:
        r, torch = self.r, self.r.torch
        layers = r.model.layers // r.dep.pp
        buf = torch.zeros(m.kv_shard_bytes(r.model, r.dep, r.a.max_input_len), dtype=torch.uint8)
        head = torch.zeros(2, dtype=torch.int64)
        peer = 1 - self.g.me
        try:
            while True:
                r.b.recv(self.g, head, peer, "kv_header")
                req, tokens = int(head[0]), int(head[1])
                if req == -1:
                    return
                if req < 0:
                    continue
                if not 1 <= tokens <= r.a.max_input_len:
                    raise CommFailed(f"a KV header of {tokens} tokens")
                for _ in range(layers):
                    n = m.kv_shard_bytes(r.model, r.dep, tokens)
                    r.b.recv(self.g, buf[:n], peer, "kv_recv")
                    r.kv_bytes += n
                self.arrived(req, time.time())
        except CommFailed as e:
            self.error = str(e)


def run_rank(a, rank: int, world: int, store, out: Path) -> int:
    reqs = workload.from_args(a)
    a.max_input_len = max(q.input_len for q in reqs)
    r = Rank(a, rank, world, store)
    dep = r.dep
    if rank == 0:
        store.set("servebench/t0", repr(time.time() + 1.0))
    store.wait(["servebench/t0"], timedelta(seconds=a.setup_timeout))
    t0 = float(store.get("servebench/t0").decode())
    clock = lambda: time.time() - t0  # noqa: E731
    deadline = max(a.duration, reqs[-1].arrival_s) + a.drain

    # Which requests come to this instance.
    if dep.disaggregated:
        mine = ([q for q in reqs if q.index % dep.prefill == r.instance] if r.role == "prefill"
                else [q for q in reqs if q.index % dep.decode == r.instance - dep.prefill])
    else:
        mine = reqs

    arrived_lock = threading.Condition()
    kv_arrived: dict[int, float] = {}

    def arrived(req: int, t: float) -> None:
        with arrived_lock:
            kv_arrived[req] = t - t0
            arrived_lock.notify_all()

    sender = KvSender(r) if r.role == "prefill" else None
    receivers = ([KvReceiver(r, p, arrived) for p in r.kv_groups] if r.role == "decode" else [])
    for t in ([sender] if sender else []) + receivers:
        t.start()

    faults = []
    if rank == 0:
        for spec in a.fault:
            at, _, cmd = spec.partition(":")
            faults.append(threading.Timer(max(float(at) - clock(), 0.0), _fault, (cmd, clock, out)))
        for f in faults:
            f.daemon = True
            f.start()

    def write_report(errors: list[str]) -> None:
        """This rank's results; unfinished requests fail with the errors given."""
        report = {
            "rank": rank, "instance": r.instance, "stage": r.stage, "tp_index": r.tpi,
            "role": r.role, "backend": a.backend, "leader": r.leader,
            "model": r.model.__dict__, "deployment": dep.__dict__, "compute": r.compute.describe(),
            "max_batch_tokens": a.max_batch_tokens, "max_seqs": a.max_seqs,
            "comm": {k: {"calls": v[0], "bytes": v[1], "seconds": round(v[2], 6)}
                     for k, v in r.b.totals.items()},
            "kv_bytes": r.kv_bytes, "steps": r.steps, "errors": errors,
        }
        if r.leader and r.role != "prefill":
            why = "; ".join(errors) or "not finished within the drain time"
            report["requests"] = [
                {"index": q.index, "arrival_s": q.arrival_s, "input_len": q.input_len,
                 "output_len": q.output_len,
                 "token_s": [round(x, 6) for x in (seqs[q.index].token_s if q.index in seqs else [])],
                 "kv_arrived_s": kv_arrived.get(q.index),
                 "error": "" if q.index in seqs and seqs[q.index].generated >= q.output_len else why}
                for q in mine]
        if rank == 0:
            report["requests_total"] = len(reqs)
            report["duration_s"] = round(clock(), 3)
        (out / f"rank{rank}.json").write_text(json.dumps(report))

    # A call that never returns (a backend blocked on a dead link) still ends the run, with its
    # results written and the unfinished requests failed, naming the hang.
    finished = threading.Event()

    def watchdog() -> None:
        limit = a.comm_timeout + 30.0
        while not finished.wait(1.0):
            now = time.monotonic()
            stuck = [(now - since, op) for since, op in list(r.b.in_flight.values())
                     if now - since > limit]
            if stuck:
                why = f"{a.backend} hung: a {stuck[0][1]} has not returned in {stuck[0][0]:.0f} s"
                print(f"\nservebench rank {rank}: {why}", file=sys.stderr, flush=True)
                write_report([why])
                os._exit(1)

    threading.Thread(target=watchdog, daemon=True, name="watchdog").start()

    while clock() < 0:
        time.sleep(min(-clock(), 0.05))
    seqs: dict[int, Seq] = {}
    progress_at = 0.0
    try:
        if r.leader:
            sched = Scheduler(r.role, a.max_batch_tokens, a.max_seqs)
            pending = deque(mine)  # not yet arrived (for a decode instance: KV not yet here)
            by_index = {q.index: q for q in mine}

            def idle_wait() -> None:
                if r.role == "decode":
                    with arrived_lock:
                        arrived_lock.wait_for(lambda: any(i in by_index and i not in seqs
                                                          for i in kv_arrived), IDLE_TICK_S)
                else:
                    wait = pending[0].arrival_s - clock() if pending else IDLE_TICK_S
                    time.sleep(min(max(wait, 0.0), IDLE_TICK_S))

            while True:
                now = clock()
                if r.role != "decode":
                    while pending and pending[0].arrival_s <= now:
                        q = pending.popleft()
                        seqs[q.index] = sched.add(q)
                else:
                    with arrived_lock:
                        ready = sorted(i for i in kv_arrived if i in by_index and i not in seqs)
                    for i in ready:
                        seqs[i] = sched.add(by_index[i])
                    if ready:
                        pending = deque(q for q in pending if q.index not in seqs)
                if (not pending and sched.idle) or now > deadline:
                    r.send_plan(STOP)
                    break
                if not a.quiet and rank == 0 and now - progress_at >= 5:
                    progress_at = now
                    print(f"\rservebench {a.backend}: {now:6.1f} s, {len(sched.finished)}/"
                          f"{len(mine)} done, {len(sched.running)} running, "
                          f"{len(sched.waiting)} waiting", end="", file=sys.stderr, flush=True)
                if sched.idle:
                    r.send_plan(IDLE)
                    idle_wait()
                    continue
                step = sched.plan()
                if not step.work:
                    r.send_plan(IDLE)
                    idle_wait()
                    continue
                ids = ([s.req.index for s in step.prefills_done()] if r.role == "prefill" else
                       [s.req.index for s, n in step.work if s.generated == 0] if r.role == "decode"
                       else [])
                t_start = clock()
                comm = r.send_plan(RUN, step, ids)
                comm += r.run_step(step.tokens, step.context, len(step.samples(r.role)))
                t_end = clock()
                r.steps.append([round(t_start, 6), round(t_end, 6), step.tokens, round(comm, 6)])
                sched.complete(step, t_end)
                if sender:
                    for s, _ in step.work:
                        if s.req.index in ids:
                            sender.q.put((s.req.index, s.req.input_len))
        else:
            input_len = {q.index: q.input_len for q in reqs}
            while True:
                kind, tokens, context, sampled, ids = r.recv_plan()
                if kind == STOP:
                    break
                if kind == IDLE:
                    continue
                if r.role == "decode":
                    with arrived_lock:
                        ok = arrived_lock.wait_for(lambda: all(i in kv_arrived for i in ids),
                                                   timeout=a.setup_timeout)
                    if not ok:
                        raise CommFailed(f"the KV caches of {ids} did not arrive")
                t_start = clock()
                comm = r.run_step(tokens, context, sampled)
                r.steps.append([round(t_start, 6), round(clock(), 6), tokens, round(comm, 6)])
                if sender:
                    for i in ids:
                        sender.q.put((i, input_len[i]))
    except CommFailed as e:
        r.error = str(e)
        print(f"\nservebench rank {rank}: {e}", file=sys.stderr)
    if sender:
        sender.q.put((-1, 0))
        sender.join(timeout=a.drain if not r.error else 5)
    for t in receivers:
        t.join(timeout=5 if r.error else a.drain)
    for f in faults:
        f.cancel()
    if not a.quiet and rank == 0:
        print(file=sys.stderr)
    finished.set()
    errors = [e for e in [r.error] + [t.error for t in ([sender] if sender else []) + receivers] if e]
    write_report(errors)
    try:
        r.b.close()
    except Exception:  # noqa: BLE001 (a failed communicator may refuse to close cleanly)
        pass
    return 1 if errors else 0


def _fault(cmd: str, clock, out: Path) -> None:
    t = clock()
    p = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=60)
    with open(out / "faults.jsonl", "a") as f:
        f.write(json.dumps({"at_s": round(t, 3), "took_s": round(clock() - t, 3), "command": cmd,
                            "rc": p.returncode, "stderr": p.stderr.strip()[-400:]}) + "\n")


def launch_env() -> tuple[int, int, str, int]:
    """(rank, world, master host, master port) from torchrun's or Open MPI's environment."""
    env = os.environ
    rank = env.get("RANK") or env.get("OMPI_COMM_WORLD_RANK")
    world = env.get("WORLD_SIZE") or env.get("OMPI_COMM_WORLD_SIZE")
    if rank is None or world is None:
        raise ValueError("no rank: pass --rank and --world, or launch with torchrun or mpirun")
    return int(rank), int(world), env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "29500"))


def main(a) -> int:
    from torch.distributed import TCPStore

    if a.rank is None:
        rank, world, host, port = launch_env()
    else:
        rank, world = a.rank, a.world
    if a.master:
        host, _, p = a.master.rpartition(":")
        if not host or not p.isdigit():
            raise ValueError(f"--master '{a.master}' is not HOST:PORT")
        port = int(p)
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} of the master is not within 1-65535")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not within a world of {world}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    # Under torchrun the agent already serves the store at MASTER_ADDR:MASTER_PORT.
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and a.master is None
    store = TCPStore(host, port, world, is_master=rank == 0 and not agent,
                     timeout=timedelta(seconds=a.setup_timeout), wait_for_workers=False)
    return run_rank(a, rank, world, store, out)
