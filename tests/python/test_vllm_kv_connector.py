"""r2ccl's vLLM KV connector (r2ccl.vllm.kv_connector) driven the way vLLM drives it: a prefill (P)
and a decode (D) instance in one process, each with its scheduler-side and worker-side connector,
vLLM's own config, Request, KVCacheManager and SchedulerOutput classes, KV caches as CPU tensors
laid out as vLLM-CPU's ([num_blocks, kv_heads, block_size, 2 * head_size]), and r2ccl's KV engines
on loopback. The calls come in vLLM's order: get_num_new_matched_tokens, allocation,
update_state_after_alloc, build_connector_meta on the scheduler; bind_connector_metadata, the
layers' save_kv_layer, wait_for_save, start_load_kv, get_transfer_results on the worker;
request_finished and update_connector_output once a request ends. Every byte D received is
compared with P's. Runs where vLLM is installed (scripts/run vllm-test)."""

import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/run vllm-test installs it)")

import torch  # noqa: E402
from vllm.config import CacheConfig, KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from r2ccl.vllm.kv_connector import R2cclConnector  # noqa: E402

BLOCK = 16
BLOCKS = 64
LAYERS = 4
HEADS, HEAD = 2, 8
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
TOKEN = "0123456789abcdef0123456789abcdef"
DEADLINE_S = 60


def kv_cache_config() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    return KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYER_NAMES, spec)])


class Instance:
    """One vLLM instance's two connectors, its block manager and its KV caches."""

    def __init__(self, engine_id: str, **extra) -> None:
        options = {"side_channel_host": "127.0.0.1", "side_channel_port": 0, "token": TOKEN,
                   "registration_wait_s": 10.0, **extra}
        self.config = VllmConfig(
            kv_transfer_config=KVTransferConfig(
                kv_connector="R2cclConnector", kv_connector_module_path="r2ccl.vllm.kv_connector",
                kv_role="kv_both", engine_id=engine_id, kv_connector_extra_config=options),
            cache_config=CacheConfig(block_size=BLOCK))
        kcc = kv_cache_config()
        self.manager = KVCacheManager(kcc, max_model_len=512, scheduler_block_size=BLOCK, hash_block_size=BLOCK,
                                      enable_caching=False)
        self.scheduler = R2cclConnector(self.config, KVConnectorRole.SCHEDULER, kcc)
        self.scheduler.bind_kv_cache_manager(self.manager)
        self.worker = R2cclConnector(self.config, KVConnectorRole.WORKER, kcc)
        self.caches = {n: torch.zeros(BLOCKS, HEADS, BLOCK, 2 * HEAD, dtype=torch.bfloat16) for n in LAYER_NAMES}
        self.worker.register_kv_caches(self.caches)
        # What the engine core does once the workers registered their caches.
        self.scheduler.set_xfer_handshake_metadata({0: self.worker.get_handshake_metadata()})
        self.finished: set[str] = set()  # requests vLLM freed since the last step (finished_req_ids)
        self.results = {"sending": set(), "recving": set(), "failed": set()}

    @property
    def port(self) -> int:
        return self.scheduler._scheduler._server.port

    def step(self, scheduled: dict[str, int], compute=None) -> None:
        """One engine step: the scheduler's metadata, the worker's forward (compute(layer_name)
        writes a layer's KV, then save_kv_layer), wait_for_save, start_load_kv and the results,
        fed back to the scheduler."""
        out = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
                              num_scheduled_tokens=dict(scheduled), total_num_scheduled_tokens=sum(scheduled.values()),
                              scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                              finished_req_ids=set(self.finished), free_encoder_mm_hashes=[])
        self.finished.clear()
        meta = self.scheduler.build_connector_meta(out)
        self.worker.bind_connector_metadata(meta)
        if compute is not None:
            for name in LAYER_NAMES:
                compute(name)
                self.worker.save_kv_layer(name, self.caches[name], None)
        self.worker.wait_for_save()
        self.worker.start_load_kv(None)
        r = self.worker.get_transfer_results(out.finished_req_ids)
        self.worker.clear_connector_metadata()
        self.scheduler.update_connector_output(KVConnectorOutput(
            finished_sending=r.finished_sending, finished_recving=r.finished_recving, failed_recving=r.failed_recving))
        self.results["sending"] |= r.finished_sending
        self.results["recving"] |= r.finished_recving
        self.results["failed"] |= r.failed_recving

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


@pytest.fixture
def pd():
    p, d = Instance("P"), Instance("D")
    yield p, d
    p.close()
    d.close()


def request(req_id: str, prompt_len: int, params: dict, seed: int) -> Request:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 2000, (prompt_len,), generator=g).tolist()
    return Request(req_id, ids, SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}), None)


def allocate(inst: Instance, req: Request, external: int) -> list[int]:
    """What vLLM's scheduler does for a request it admits: the connector's match, the blocks,
    update_state_after_alloc. Returns the request's blocks."""
    if external:
        blocks = inst.manager.allocate_slots(req, 0, num_external_computed_tokens=external, delay_cache_blocks=True)
    else:
        blocks = inst.manager.allocate_slots(req, req.num_prompt_tokens)
    assert blocks is not None
    inst.scheduler.update_state_after_alloc(req, inst.manager.get_blocks(req.request_id), external)
    return list(inst.manager.get_blocks(req.request_id).get_block_ids()[0])


def prefill_compute(p: Instance, blocks: list[int], seed: int):
    """A layer's forward on P: its KV of the request's blocks, distinct per layer."""
    def compute(name: str) -> None:
        g = torch.Generator().manual_seed(seed * 100 + LAYER_NAMES.index(name))
        for b in blocks:
            p.caches[name][b] = torch.randn(HEADS, BLOCK, 2 * HEAD, generator=g).to(torch.bfloat16)
    return compute


def until(cond, *instances, limit=DEADLINE_S) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        for inst in instances:
            inst.step({})
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def same_kv(p: Instance, d: Instance, p_blocks: list[int], d_blocks: list[int]) -> None:
    for name in LAYER_NAMES:
        for pb, db in zip(p_blocks, d_blocks):
            assert torch.equal(p.caches[name][pb], d.caches[name][db]), f"{name}: P block {pb} vs D block {db}"


def finish(p: Instance, req: Request, blocks: list[int]) -> dict:
    req.num_computed_tokens = req.num_prompt_tokens
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    hold, params = p.scheduler.request_finished(req, blocks)
    assert hold, "P must hold a pushed request's blocks until its push ended"
    p.finished.add(req.request_id)
    return params


def test_decode_first_pushes_each_layer_during_the_prefill_and_every_byte_lands(pd):
    p, d = pd
    n = 5 * BLOCK + 3
    rd = request("d-1", n, {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": p.port,
                            "transfer_id": "t-1"}, seed=1)
    rp = request("p-1", n, {"do_remote_decode": True, "transfer_id": "t-1"}, seed=1)
    # D: everything but the last prompt token comes from P, asynchronously.
    assert d.scheduler.get_num_new_matched_tokens(rd, 0) == (n - 1, True)
    d_blocks = allocate(d, rd, n - 1)
    d.step({})
    # P holds the request back until D's registration arrived (its side channel's thread).
    deadline = time.monotonic() + DEADLINE_S
    while p.scheduler.get_num_new_matched_tokens(rp, 0) == (None, False) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p.scheduler.get_num_new_matched_tokens(rp, 0) == (0, False)
    p_blocks = allocate(p, rp, 0)
    # The prefill step: each layer is pushed as soon as it is computed.
    p.step({rp.request_id: n}, prefill_compute(p, p_blocks, seed=1))
    assert "p-1" not in p.results["sending"], "blocks freed while the request still runs"
    finish(p, rp, p_blocks)
    assert until(lambda: "d-1" in d.results["recving"] and "p-1" in p.results["sending"], p, d)
    assert not d.results["failed"]
    used = (n - 1 + BLOCK - 1) // BLOCK
    same_kv(p, d, p_blocks[:used], d_blocks[:used])
    stats = p.worker.get_kv_connector_stats()
    assert stats is None or stats.data["pushes_failed"] == 0


def test_prefill_first_as_vllms_proxy_does_pushes_the_whole_request_once_d_registers(pd):
    p, d = pd
    n = 3 * BLOCK + 7
    rp = request("p-2", n, {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                            "remote_block_ids": None, "remote_host": None, "remote_port": None}, seed=2)
    assert p.scheduler.get_num_new_matched_tokens(rp, 0) == (0, False)
    p_blocks = allocate(p, rp, 0)
    p.step({rp.request_id: n}, prefill_compute(p, p_blocks, seed=2))
    params = finish(p, rp, p_blocks)
    assert params["do_remote_prefill"] and params["remote_port"] == p.port and params["transfer_id"] == "p-2"
    # The proxy hands P's kv_transfer_params to D.
    rd = request("d-2", n, params, seed=2)
    assert d.scheduler.get_num_new_matched_tokens(rd, 0) == (n - 1, True)
    d_blocks = allocate(d, rd, n - 1)
    assert until(lambda: "d-2" in d.results["recving"] and "p-2" in p.results["sending"], p, d)
    assert not d.results["failed"]
    used = (n - 1 + BLOCK - 1) // BLOCK
    same_kv(p, d, p_blocks[:used], d_blocks[:used])


def test_a_push_cut_midway_by_its_prefill_instance_vanishing_fails_that_request_only():
    p = Instance("P")
    d = Instance("D", transfer_timeout_s=3.0)
    try:
        ids = {}
        for k in ("a", "b"):
            n = 4 * BLOCK
            rd = request(f"d-{k}", n, {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": p.port,
                                       "transfer_id": f"t-{k}"}, seed=3)
            d.scheduler.get_num_new_matched_tokens(rd, 0)
            ids[k] = (rd, allocate(d, rd, n - 1))
        d.step({})
        rb = request("p-b", 4 * BLOCK, {"do_remote_decode": True, "transfer_id": "t-b"}, seed=3)
        ra = request("p-a", 4 * BLOCK, {"do_remote_decode": True, "transfer_id": "t-a"}, seed=3)
        deadline = time.monotonic() + DEADLINE_S
        while (p.scheduler.get_num_new_matched_tokens(ra, 0)[0] is None
               or p.scheduler.get_num_new_matched_tokens(rb, 0)[0] is None) and time.monotonic() < deadline:
            time.sleep(0.01)
        pb = allocate(p, rb, 0)
        p.step({rb.request_id: rb.num_prompt_tokens}, prefill_compute(p, pb, seed=3))
        finish(p, rb, pb)
        assert until(lambda: "d-b" in d.results["recving"], p, d)
        # Request a: its prefill pushes two of four layers, then P's process is gone.
        pa = allocate(p, ra, 0)
        out = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
                              num_scheduled_tokens={ra.request_id: ra.num_prompt_tokens},
                              total_num_scheduled_tokens=ra.num_prompt_tokens, scheduled_spec_decode_tokens={},
                              scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[])
        p.worker.bind_connector_metadata(p.scheduler.build_connector_meta(out))
        compute = prefill_compute(p, pa, seed=4)
        for name in LAYER_NAMES[:2]:
            compute(name)
            p.worker.save_kv_layer(name, p.caches[name], None)
        p.close()
        assert until(lambda: "d-a" in d.results["failed"], d, limit=30)
        assert "d-a" in d.results["recving"]  # a failed load is also reported as ended
        assert d.results["failed"] == {"d-a"}, d.results
    finally:
        d.close()


def test_a_push_to_a_decode_instance_that_vanished_ends_failed_and_frees_the_blocks():
    p = Instance("P")
    d = Instance("D")
    try:
        n = 4 * BLOCK
        rd = request("d-v", n, {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": p.port,
                                "transfer_id": "t-v"}, seed=6)
        d.scheduler.get_num_new_matched_tokens(rd, 0)
        allocate(d, rd, n - 1)
        d.step({})
        rp = request("p-v", n, {"do_remote_decode": True, "transfer_id": "t-v"}, seed=6)
        deadline = time.monotonic() + DEADLINE_S
        while p.scheduler.get_num_new_matched_tokens(rp, 0)[0] is None and time.monotonic() < deadline:
            time.sleep(0.01)
        d.close()  # D's process is gone before P prefills
        pb = allocate(p, rp, 0)
        p.step({rp.request_id: n}, prefill_compute(p, pb, seed=6))
        finish(p, rp, pb)
        # P's step loop goes on (no exception out of the connector) and frees the blocks.
        assert until(lambda: "p-v" in p.results["sending"], p)
    finally:
        p.close()


def test_a_registration_with_no_prefill_instance_behind_fails_the_request_naming_why(pd):
    _, d = pd
    dead = Instance("X")
    port = dead.port
    dead.close()
    rd = request("d-3", 40, {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": port,
                             "transfer_id": "t-3"}, seed=5)
    d.scheduler.get_num_new_matched_tokens(rd, 0)
    allocate(d, rd, 39)
    assert until(lambda: "d-3" in d.results["failed"], d, limit=30)


def test_a_side_channel_peer_without_the_token_is_refused():
    from r2ccl.vllm import kv_side_channel as side

    served = []
    server = side.Server("127.0.0.1", 0, b"right", lambda m: served.append(m) or {"ok": True})
    try:
        with pytest.raises(side.SideChannelError, match="does not hold this deployment's token"):
            side.call("127.0.0.1", server.port, b"wrong", {"op": "register"})
        assert side.call("127.0.0.1", server.port, b"right", {"op": "x"}) == {"ok": True}
        assert served == [{"op": "x"}]
    finally:
        server.close()


def test_bad_registrations_are_refused_naming_what_is_wrong(pd):
    p, d = pd
    serve = p.scheduler._scheduler._serve  # what the side channel hands an authenticated message
    good = {"engine_metadata": "AA==", "pool": 0, "layers": LAYERS, "block_bytes": 2 * BLOCK * HEADS * HEAD * 2,
            "parts": 1}
    cases = [
        ({"op": "steal"}, "unknown op 'steal'"),
        ({"op": "register", "transfer_id": "", "blocks": [], "first_block": 0, "peers": [good]},
         "transfer_id must be a string of 1 to 512 characters"),
        ({"op": "register", "transfer_id": "t", "blocks": [1, -2], "first_block": 0, "peers": [good]},
         "blocks must be a list of block numbers"),
        ({"op": "register", "transfer_id": "t", "blocks": [1], "first_block": -1, "peers": [good]},
         "first_block must be a non-negative integer"),
        ({"op": "register", "transfer_id": "t", "blocks": [1], "first_block": 0, "peers": [good, good]},
         "this prefill instance has TP = 1; the decode instance registered 2 ranks"),
        ({"op": "register", "transfer_id": "t", "blocks": [1], "first_block": 0, "peers": [{"pool": 0}]},
         "a rank's metadata is malformed"),
        ({"op": "register", "transfer_id": "t", "blocks": [1], "first_block": 0, "peers": [dict(good, layers=3)]},
         "decode rank 0's KV layout (3 layers"),
    ]
    for msg, why in cases:
        answer = serve(msg)
        assert why in answer.get("error", ""), (msg, answer)
    assert serve({"op": "register", "transfer_id": "t", "blocks": [1], "first_block": 0, "peers": [good]}) == {"ok": True}
