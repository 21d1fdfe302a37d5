"""One side of SGLang's `nixl` PD disaggregation transfer, driven at SGLang's own classes on CPU,
for tests/nixl/test_sglang_nixl.py.

    sglang_pd_peer.py prefill --host-ip IP --bootstrap IP:PORT --dir D [...]
    sglang_pd_peer.py decode  --host-ip IP --bootstrap IP:PORT --dir D [...]

Each side publishes a ServerArgs (device "cpu", disaggregation_transfer_backend "nixl") to SGLang's
runtime context, builds a KVArgs over host-memory KV pools (torch CPU tensors: one K and one V
buffer per layer, `page_bytes` per page, registered as DRAM; one aux/metadata buffer) and an
`NixlKVManager`; the NIXL backend is whatever SGLANG_DISAGGREGATION_NIXL_BACKEND names.

prefill: runs SGLang's `NixlKVBootstrapServer` on IP:PORT, fills its pool with a pattern unique to
each (KV entry, page, byte), and for every request (bootstrap room) makes an `NixlKVSender`, waits
until the decode's metadata arrived (KVPoll.WaitingForInput), then `init(num_pages, aux_index)`
and `send()`s the request's prefill pages in chunks (the last carries the aux slot), and polls
until KVPoll.Success.

decode: makes an `NixlKVReceiver` per request, `init()`s it and `send_metadata()`s the request's
decode pages (a different page permutation from the prefill's) and its aux slot, polls until
KVPoll.Success, then checks every byte: each request's decode pages hold exactly the prefill pages
they were paired with (every layer, K and V), its aux slot holds the prefill's, and every page and
aux slot that no request names is still zero.

Output lines: "ready ...", "progress <rooms done>", "metric <name...> <value>", "backend ...",
"ok ..." and exit 0; "error ..." and exit 1; past --deadline, "error ... (a hang)" and exit 3.
"""

import argparse
import logging
import os
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np


T0 = time.monotonic()


def say(*parts):
    print(*parts, flush=True)


def at():
    return f"at {time.monotonic() - T0:.1f} s"


def die(msg, rc=1):
    say(f"error {msg}")
    sys.stdout.flush()
    os._exit(rc)  # SGLang's prefill bootstrap thread is not a daemon: leave without joining it


class Deadline:
    def __init__(self, seconds):
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def check(self, what):
        if time.monotonic() > self.end:
            die(f"{what} past the deadline of {self.seconds} s (a hang)", 3)


# ------------------------------------------------------------------------------- the plan


def plan(args):
    """Both sides derive the same requests: room, prefill pages, decode pages, aux slots."""
    rng = np.random.default_rng(args.seed)
    n, p = args.requests, args.pages
    src_pool = n * p + args.spare
    dst_pool = n * p + args.spare
    src_pages = rng.permutation(src_pool)[: n * p].astype(np.int32).reshape(n, p)
    dst_pages = rng.permutation(dst_pool)[: n * p].astype(np.int32).reshape(n, p)
    # Runs of consecutive pages as well as scattered ones: SGLang groups contiguous runs.
    for r in range(0, n, 2):
        start = int(rng.integers(0, src_pool - p))
        if not np.isin(np.arange(start, start + p), np.delete(src_pages, r, 0)).any():
            src_pages[r] = np.arange(start, start + p, dtype=np.int32)
    rooms = [args.room_base + r for r in range(n)]
    src_aux = [(3 * r + 1) % args.aux_slots for r in range(n)]
    dst_aux = [(5 * r + 2) % args.aux_slots for r in range(n)]
    return rooms, src_pool, dst_pool, src_pages, dst_pages, src_aux, dst_aux


def page_pattern(entry: int, pages: np.ndarray, page_bytes: int) -> np.ndarray:
    """The bytes of prefill KV entry `entry`'s pages `pages` ([len(pages), page_bytes] uint8):
    an 8-byte header (entry, page) and a body that depends on entry, page and offset."""
    pages = np.asarray(pages, dtype=np.uint32)
    off = np.arange(page_bytes, dtype=np.uint32)
    body = (off[None, :] * np.uint32(2654435761) + (pages[:, None] + 1) * np.uint32(97)
            + np.uint32((entry + 1) * 40503) + (off[None, :] >> 8) * (pages[:, None] + 3))
    out = (body >> 5).astype(np.uint8)
    hdr = np.zeros((len(pages), 2), dtype="<u4")
    hdr[:, 0] = entry + 0x5A000000
    hdr[:, 1] = pages
    out[:, :8] = hdr.view(np.uint8).reshape(len(pages), 8)
    return out


def aux_pattern(slot: int, item: int) -> np.ndarray:
    return ((np.arange(item, dtype=np.uint32) * 31 + slot * 7 + 11) & 0xFF).astype(np.uint8)


# ---------------------------------------------------------------------- SGLang set-up on CPU


def stub_missing_gguf():
    """SGLang declares the `gguf` package but this venv lacks it; sglang.srt.disaggregation.utils
    imports model_config -> layers.quantization -> gguf.py, whose `import gguf` is used only inside
    GGUF weight kernels (gguf.GGML_QUANT_SIZES at call time). An empty module stands in for it when
    it is not installed; nothing on the KV transfer path touches it."""
    import importlib.util
    import types
    if importlib.util.find_spec("gguf") is not None:
        return False

    class _Names:  # gguf.py builds sets of GGMLQuantizationType members at import time
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return f"gguf-stub:{name}"

    stub = types.ModuleType("gguf")
    stub.__getattr__ = lambda name: _Names() if not name.startswith("__") else (_ for _ in ()).throw(
        AttributeError(name))
    sys.modules["gguf"] = stub
    return True


def setup_sglang(args, mode):
    """Publishes a CPU ServerArgs and this process's (single) rank to SGLang's runtime context."""
    if stub_missing_gguf():
        say("note: the gguf package is missing; an empty module stands in for it")
    from sglang.srt.runtime_context import get_context, get_parallel
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(
        model_path="unused-no-model-is-loaded",
        device="cpu",
        host=args.host_ip,
        page_size=args.page_tokens,
        disaggregation_mode=mode,
        disaggregation_transfer_backend="nixl",
        disaggregation_bootstrap_port=int(args.bootstrap.rsplit(":", 1)[1]),
    )
    # `publish()` would first resolve the model's config (ServerArgs.resolve_once loads the HF
    # config and quantization modules); there is no model here, so the raw ServerArgs is installed
    # directly and the launcher's rank stamp (TP1/PP1/DP1: every rank 0) is written explicitly.
    ctx = get_context()
    ctx.set_server_args(sa)
    ctx._publish_role = "scheduler"
    get_parallel().override_permanently(
        tp_rank=0, pp_rank=0, attn_tp_rank=0, attn_dp_rank=0, attn_cp_rank=0, attn_dcp_rank=0,
        moe_ep_rank=0, moe_dp_rank=0, moe_tp_rank=0, dp_rank=None,
        pp_group=None)  # read only to build a PPConsensusStore when pp_size > 1
    return sa


def make_kv_args(args, pool_pages, kv_bufs, aux_buf):
    from sglang.srt.disaggregation.base.conn import KVArgs

    ka = KVArgs()
    ka.engine_rank = 0
    ka.pp_rank = 0
    ka.system_dp_rank = 0
    ka.rust_http_port = None
    ka.kv_cache_dtype_str = "bfloat16"
    ka.kv_layout = None
    ka.prefill_start_layer = 0
    ka.prefill_end_layer = args.layers
    # MHA: every layer's K buffer, then every layer's V buffer (get_contiguous_buf_infos order).
    ka.kv_data_ptrs = [b.data_ptr() for b in kv_bufs]
    ka.kv_data_lens = [b.numel() for b in kv_bufs]
    ka.kv_item_lens = [args.page_bytes] * len(kv_bufs)
    ka.kv_layer_ids = list(range(args.layers)) * 2
    ka.num_draft_entries = 0
    # Host memory: NIXL DRAM (SGLang's own field; its GPU servers leave it at VRAM).
    ka.kv_data_mem_kinds = ["DRAM"] * len(kv_bufs)
    ka.kv_head_num = 2
    ka.total_kv_head_num = 2
    ka.page_size = args.page_tokens
    ka.aux_data_ptrs = [aux_buf.data_ptr()]
    ka.aux_data_lens = [aux_buf.numel()]
    ka.aux_item_lens = [args.aux_item]
    ka.ib_device = None
    ka.gpu_id = 0
    ka.state_types = []
    ka.state_data_ptrs = []
    ka.state_data_lens = []
    ka.state_item_lens = []
    ka.state_dim_per_tensor = []
    ka.state_slice_outer_counts = []
    ka.state_layer_ids = []
    ka.is_hybrid_mla_backend = False
    ka.state_conv_shard_groups = []
    ka.swa_kv_cache_layout = None
    ka.mla_compression_ratios = None
    return ka


def make_pool(args, pool_pages):
    import torch
    bufs = [torch.zeros(pool_pages * args.page_bytes, dtype=torch.uint8)
            for _ in range(2 * args.layers)]
    aux = torch.zeros(args.aux_slots * args.aux_item, dtype=torch.uint8)
    return bufs, aux


def report_backend(mgr, args):
    agent = mgr.agent
    backends = sorted(getattr(agent, "backends", {}).keys())
    say(f"backend env={os.environ.get('SGLANG_DISAGGREGATION_NIXL_BACKEND')} "
        f"agent_backends={','.join(backends)} plugins_has_R2CCL={'R2CCL' in agent.get_plugin_list()}")


def report_metrics(args):
    if not args.metrics_port:
        return
    url = f"http://127.0.0.1:{args.metrics_port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    except Exception as e:  # noqa: BLE001
        say(f"metric-error {url}: {e}")
        return
    for line in text.splitlines():
        if line.startswith(("r2ccl_nixl_transfer", "r2ccl_rail_tx_bytes_total",
                            "r2ccl_rail_rx_bytes_total", "r2ccl_rail_failovers_total",
                            "r2ccl_rail_state")):
            say(f"metric {line}")


def wait_file(path: Path, dl: Deadline, what):
    while not path.exists():
        dl.check(what)
        time.sleep(0.05)


# ---------------------------------------------------------------------------------- prefill


def run_prefill(args):
    dl = Deadline(args.deadline)
    setup_sglang(args, "prefill")
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.nixl.conn import (NixlKVBootstrapServer, NixlKVManager,
                                                      NixlKVSender)
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.runtime_context import get_server_args

    rooms, src_pool, _, src_pages, _, src_aux, _ = plan(args)
    host, port = args.bootstrap.rsplit(":", 1)
    server = NixlKVBootstrapServer(host, int(port))  # noqa: F841 (serves from its thread)
    bufs, aux = make_pool(args, src_pool)
    for e, b in enumerate(bufs):
        b.numpy().reshape(src_pool, args.page_bytes)[:] = page_pattern(
            e, np.arange(src_pool), args.page_bytes)
    auxv = aux.numpy().reshape(args.aux_slots, args.aux_item)
    for s in range(args.aux_slots):
        auxv[s] = aux_pattern(1000 + s, args.aux_item)
    ka = make_kv_args(args, src_pool, bufs, aux)
    mgr = NixlKVManager(ka, DisaggregationMode.PREFILL, get_server_args(), False)
    report_backend(mgr, args)
    say(f"ready prefill rooms {len(rooms)} {at()}")

    senders = {room: NixlKVSender(mgr, args.bootstrap, room) for room in rooms}
    started = set()
    done = {}
    last = 0.0
    while len(done) < len(rooms):
        for r, room in enumerate(rooms):
            if room in done:
                continue
            st = senders[room].poll()
            if room not in started:
                if st == KVPoll.WaitingForInput:
                    s = senders[room]
                    s.init(args.pages, src_aux[r])
                    pages = src_pages[r]
                    for c in range(0, args.pages, args.chunk):
                        s.send(pages[c:c + args.chunk])
                    started.add(room)
                elif st == KVPoll.Failed:
                    die(f"room {room} failed before its transfer: {mgr.failure_records.get(room)}")
                continue
            if st == KVPoll.Success:
                done[room] = st
            elif st == KVPoll.Failed:
                die(f"room {room} failed: {mgr.failure_records.get(room)}")
        now = time.monotonic()
        if now - last > 0.2:
            say(f"progress {len(done)} started {len(started)}")
            last = now
        dl.check(f"{len(done)} of {len(rooms)} rooms sent")
        time.sleep(0.002)
    say(f"progress {len(done)} started {len(started)}")
    report_metrics(args)
    say(f"ok prefill rooms {len(done)} {at()}")
    wait_file(Path(args.dir) / "decode.done", dl, "waiting for the decode to finish")
    sys.stdout.flush()
    os._exit(0)


# ----------------------------------------------------------------------------------- decode


def run_decode(args):
    dl = Deadline(args.deadline)
    setup_sglang(args, "decode")
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager, NixlKVReceiver
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.runtime_context import get_server_args

    rooms, src_pool, dst_pool, src_pages, dst_pages, src_aux, dst_aux = plan(args)
    bufs, aux = make_pool(args, dst_pool)
    ka = make_kv_args(args, dst_pool, bufs, aux)
    mgr = NixlKVManager(ka, DisaggregationMode.DECODE, get_server_args(), False)
    report_backend(mgr, args)
    say(f"manager decode {at()}")
    while not mgr.try_ensure_parallel_info(args.bootstrap):
        dl.check(f"prefill bootstrap server {args.bootstrap} not answering")
        time.sleep(0.5)
    say(f"ready decode {at()}")

    receivers = {}
    for r, room in enumerate(rooms):
        rx = NixlKVReceiver(mgr, args.bootstrap, room)
        rx.init(prefill_dp_rank=0)
        if rx.poll() == KVPoll.Failed:
            die(f"room {room}: receiver init failed: {mgr.failure_records.get(room)}")
        rx.send_metadata(dst_pages[r], aux_index=dst_aux[r])
        receivers[room] = rx
    done = {}
    last = 0.0
    t0 = time.monotonic()
    while len(done) < len(rooms):
        for room, rx in receivers.items():
            if room in done:
                continue
            st = rx.poll()
            if st == KVPoll.Success:
                done[room] = time.monotonic() - t0
            elif st == KVPoll.Failed:
                die(f"room {room} failed: {mgr.failure_records.get(room)}")
        now = time.monotonic()
        if now - last > 0.2:
            say(f"progress {len(done)}")
            last = now
        dl.check(f"{len(done)} of {len(rooms)} rooms received")
        time.sleep(0.002)
    took = time.monotonic() - t0
    say(f"progress {len(done)}")

    # Every byte.
    tv = time.monotonic()
    bad = []
    verified = 0
    touched = np.zeros(dst_pool, dtype=bool)
    for e, b in enumerate(bufs):
        v = b.numpy().reshape(dst_pool, args.page_bytes)
        for r in range(len(rooms)):
            want = page_pattern(e, src_pages[r], args.page_bytes)
            got = v[dst_pages[r]]
            if not np.array_equal(got, want):
                wrong = int(np.count_nonzero(got != want))
                bad.append(f"room {rooms[r]} entry {e}: {wrong} wrong bytes")
            verified += got.size
            touched[dst_pages[r]] = True
        rest = v[~touched]
        if rest.any():
            bad.append(f"entry {e}: {int(np.count_nonzero(rest))} bytes written outside the "
                       f"requests' pages")
    auxv = aux.numpy().reshape(args.aux_slots, args.aux_item)
    aux_used = np.zeros(args.aux_slots, dtype=bool)
    for r in range(len(rooms)):
        want = aux_pattern(1000 + src_aux[r], args.aux_item)
        if not np.array_equal(auxv[dst_aux[r]], want):
            bad.append(f"room {rooms[r]}: aux slot {dst_aux[r]} wrong")
        verified += args.aux_item
        aux_used[dst_aux[r]] = True
    if auxv[~aux_used].any():
        bad.append("aux bytes written outside the requests' slots")
    for rx in receivers.values():
        rx.clear()
    report_metrics(args)
    (Path(args.dir) / "decode.done").touch()
    if bad:
        die("; ".join(bad[:6]))
    say(f"ok decode rooms {len(done)} layers {args.layers} pages {args.pages} "
        f"bytes {verified} in {took:.2f} s (checked in {time.monotonic() - tv:.1f} s) {at()}")
    sys.stdout.flush()
    os._exit(0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("role", choices=["prefill", "decode"])
    ap.add_argument("--host-ip", required=True, help="this process's address (ZMQ, bootstrap)")
    ap.add_argument("--bootstrap", required=True, help="the prefill's bootstrap IP:PORT")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--pages", type=int, default=16, help="pages per request")
    ap.add_argument("--chunk", type=int, default=8, help="pages per KVSender.send()")
    ap.add_argument("--page-tokens", type=int, default=16)
    ap.add_argument("--page-bytes", type=int, default=64 << 10)
    ap.add_argument("--spare", type=int, default=24, help="pages no request uses")
    ap.add_argument("--aux-slots", type=int, default=64)
    ap.add_argument("--aux-item", type=int, default=256)
    ap.add_argument("--room-base", type=int, default=7000)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--deadline", type=float, default=90.0)
    ap.add_argument("--metrics-port", type=int, default=0)
    args = ap.parse_args()
    os.environ["SGLANG_HOST_IP"] = args.host_ip
    logging.basicConfig(level=os.environ.get("PEER_LOG_LEVEL", "WARNING"),
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    # SGLang's own line "NIXL KVManager initialized with backend: X" (INFO) is evidence.
    logging.getLogger("sglang.srt.disaggregation.nixl.conn").setLevel(logging.INFO)
    try:
        (run_prefill if args.role == "prefill" else run_decode)(args)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001
        import traceback
        traceback.print_exc(file=sys.stdout)
        die(f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
