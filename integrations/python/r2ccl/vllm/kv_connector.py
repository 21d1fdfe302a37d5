"""R2cclConnector: vLLM's KV connector (KVConnectorBase_V1) over r2ccl's KV engine, loaded by
module path with no change to vLLM:

    --kv-transfer-config '{"kv_connector": "R2cclConnector",
                           "kv_connector_module_path": "r2ccl.vllm.kv_connector",
                           "kv_role": "kv_both", "kv_connector_extra_config": {...}}'

The prefill instance (P) pushes a request's KV into blocks the decode instance (D) allocated:
- D registers first (layer-streamed): the router sends the request to D with kv_transfer_params
  {"do_remote_prefill": true, "remote_host", "remote_port": P's side channel, "transfer_id"}, and
  to P with {"do_remote_decode": true, "transfer_id"}. D allocates its blocks and registers them
  with P over the side channel; P holds the request back (up to `registration_wait_s`) until the
  registration is there, then pushes each layer's blocks the moment the layer is computed
  (save_kv_layer), so that the transfer runs under the rest of the prefill.
- P first (what vLLM's toy proxy, llm-d and Dynamo do with NixlConnector): P prefills, holds the
  blocks and answers with kv_transfer_params naming its side channel; D registers when the
  request reaches it, and P pushes the whole request at once.
D loads asynchronously: a request waits until the push landed (finished_recving). A push that
failed, or that did not land within `transfer_timeout_s`, is reported as failed_recving with its
blocks invalid, so vLLM recomputes or fails it (kv_load_failure_policy): never a token from
partial KV. P frees a request's blocks once its push ended, or after `kv_lease_s` without a
registration.

Each TP rank of P pushes to the same TP rank of D (the two instances have the same TP size). One
KV-cache group (a model whose layers all share one KV cache spec)."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import itertools
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from .._errors import R2cclError
from . import kv_side_channel as side

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.r2ccl.kv_connector")  # under vLLM's logger: in its log

DEFAULTS = {
    "side_channel_host": None,  # VLLM_HOST_IP, else 127.0.0.1
    "side_channel_port": 5710,
    "registration_wait_s": 2.0,
    "transfer_timeout_s": 60.0,
    "kv_lease_s": 60.0,
}


def _option(vllm_config: VllmConfig, key: str) -> Any:
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    return extra.get(key, DEFAULTS[key])


def _side_channel_host(vllm_config: VllmConfig) -> str:
    return _option(vllm_config, "side_channel_host") or os.environ.get("VLLM_HOST_IP") or "127.0.0.1"


@dataclasses.dataclass
class R2cclHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells its scheduler at start-up (and D's scheduler tells P's)."""

    engine_metadata: bytes
    pool: int
    layers: int
    block_bytes: int
    parts: int


@dataclasses.dataclass
class Push:
    """One request's push from a P worker: src_blocks[i] of every layer into dst_blocks[i] of the
    D worker of the same TP rank."""

    req_id: str
    transfer_id: str
    src_blocks: list[int]
    dst_blocks: list[int]
    peers: list[R2cclHandshake]  # D's workers, by TP rank
    layered: bool  # during this step's forward, layer by layer; else at once


@dataclasses.dataclass
class Expect:
    """A D worker's request that waits for P's push."""

    req_id: str
    transfer_id: str
    deadline: float  # time.time()


@dataclasses.dataclass
class R2cclConnectorMetadata(KVConnectorMetadata):
    pushes: list[Push] = dataclasses.field(default_factory=list)
    expects: list[Expect] = dataclasses.field(default_factory=list)
    recv_failed: dict[str, str] = dataclasses.field(default_factory=dict)  # req_id -> why
    send_released: list[str] = dataclasses.field(default_factory=list)  # P req_ids, no push


@dataclasses.dataclass
class R2cclKVConnectorStats(KVConnectorStats):
    """Per step: pushes ended (sent, received, failed), bytes pushed, push seconds."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"pushes_sent": 0, "pushes_layered": 0, "pushes_received": 0, "pushes_failed": 0,
                     "bytes_sent": 0, "push_seconds": []}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, [] if isinstance(v, list) else 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        secs = self.data["push_seconds"]
        return {
            "pushes_sent": self.data["pushes_sent"],
            "pushes_layered": self.data["pushes_layered"],
            "pushes_received": self.data["pushes_received"],
            "pushes_failed": self.data["pushes_failed"],
            "MB_sent": round(self.data["bytes_sent"] / 1e6, 3),
            "avg_push_ms": round(1000 * sum(secs) / len(secs), 3) if secs else 0.0,
        }

    def is_empty(self) -> bool:
        return not any(self.data[k] for k in ("pushes_sent", "pushes_received", "pushes_failed"))


class R2cclPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def counter(name: str, doc: str):
            c = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            return {i: c.labels(*v) for i, v in per_engine_labelvalues.items()}

        self._sent = counter("vllm:r2ccl_kv_pushes_sent", "KV pushes that landed, prefill side")
        self._layered = counter("vllm:r2ccl_kv_pushes_layered", "Of those, pushed layer by layer during the prefill")
        self._received = counter("vllm:r2ccl_kv_pushes_received", "KV pushes received, decode side")
        self._failed = counter("vllm:r2ccl_kv_pushes_failed", "KV pushes that failed or timed out")
        self._bytes = counter("vllm:r2ccl_kv_bytes_sent", "KV bytes pushed")
        h = self._histogram_cls(
            name="vllm:r2ccl_kv_push_seconds", documentation="From a push's start to its end",
            buckets=[0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60], labelnames=labelnames)
        self._seconds = {i: h.labels(*v) for i, v in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = transfer_stats_data
        self._sent[engine_idx].inc(d.get("pushes_sent", 0))
        self._layered[engine_idx].inc(d.get("pushes_layered", 0))
        self._received[engine_idx].inc(d.get("pushes_received", 0))
        self._failed[engine_idx].inc(d.get("pushes_failed", 0))
        self._bytes[engine_idx].inc(d.get("bytes_sent", 0))
        for s in d.get("push_seconds", []):
            self._seconds[engine_idx].observe(s)


class R2cclConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        groups = len(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else 1
        if groups > 1:
            raise ValueError(f"r2ccl's KV connector moves one KV-cache group; this model has {groups}")
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ValueError("r2ccl's KV connector does not move KV across pipeline stages yet (PP > 1)")
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler: _Scheduler | None = _Scheduler(vllm_config)
            self._worker: _Worker | None = None
        else:
            self._scheduler = None
            self._worker = _Worker(vllm_config, kv_cache_config)

    # ---- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._worker.handshake()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker.start(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request runs only once its push landed

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self._worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        self._worker.seal()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._worker.results(finished_req_ids)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._worker.take_stats() if self._worker else None

    def shutdown(self) -> None:
        if self._worker:
            self._worker.close()
        if self._scheduler:
            self._scheduler.close()

    # ---- scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build_meta(scheduler_output, self._kv_cache_manager)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.finished(request, list(block_ids))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.finished(request, list(block_ids[0]) if block_ids else [])

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self._scheduler.set_workers(metadata)

    def has_pending_push_work(self) -> bool:
        return self._scheduler.pending()

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler.output(connector_output)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return R2cclKVConnectorStats(data=data) if data is not None else R2cclKVConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> KVConnectorPromMetrics | None:
        return R2cclPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _blocks_for(tokens: int, block_size: int) -> int:
    return (tokens + block_size - 1) // block_size


@dataclasses.dataclass
class _PRequest:
    """A request P prefills for a D."""

    request: Request
    transfer_id: str
    first_seen: float
    pushed: bool = False
    finished: bool = False  # its prefill ended; its blocks are held
    held_since: float = 0.0
    block_ids: list[int] = dataclasses.field(default_factory=list)  # held, from request_finished


@dataclasses.dataclass
class _Registration:
    blocks: list[int]  # D's, from the request's first block that P pushes
    first_block: int
    peers: list[R2cclHandshake]
    at: float = dataclasses.field(default_factory=time.monotonic)


class _Scheduler:
    def __init__(self, vllm_config: VllmConfig) -> None:
        self._block_size = vllm_config.cache_config.block_size
        self._tp = vllm_config.parallel_config.tensor_parallel_size
        self._extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self._token = side.token_from(self._extra)
        self._host = _side_channel_host(vllm_config)
        self._port = int(_option(vllm_config, "side_channel_port"))
        self._wait = float(_option(vllm_config, "registration_wait_s"))
        self._timeout = float(_option(vllm_config, "transfer_timeout_s"))
        self._lease = float(_option(vllm_config, "kv_lease_s"))
        self.engine_id = vllm_config.kv_transfer_config.engine_id
        self._lock = threading.Lock()
        self._workers: list[R2cclHandshake] | None = None
        self._server: side.Server | None = None
        # P side
        self._p: dict[str, _PRequest] = {}  # req_id ->
        self._registrations: dict[str, _Registration] = {}  # transfer_id -> (from D)
        # D side
        self._expects: list[Expect] = []
        self._failed: dict[str, str] = {}
        self._registering: set[str] = set()
        self._loading: set[str] = set()  # registered, the push not yet ended
        self._local_hits: dict[str, int] = {}  # D: tokens its own prefix cache had, per request

    # The side channel starts once the workers' metadata is known: a D's registration needs none
    # of it, but P's answer must not come before P can push.
    def set_workers(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        if sorted(metadata) != list(range(self._tp)):
            raise ValueError(f"r2ccl KV connector: handshake metadata of TP ranks {sorted(metadata)}, expected 0..{self._tp - 1}")
        self._workers = [metadata[r] for r in range(self._tp)]
        if self._server is None:
            self._server = side.Server(self._host, self._port, self._token, self._serve)
            logger.info("r2ccl KV connector: side channel on %s:%d", self._host, self._server.port)

    def close(self) -> None:
        if self._server:
            self._server.close()

    # ---- the side channel (its own threads)
    def _serve(self, msg: dict[str, Any]) -> dict[str, Any]:
        if msg.get("op") != "register":
            return {"error": f"unknown op {msg.get('op')!r}"}
        tid, blocks, first, peers = msg.get("transfer_id"), msg.get("blocks"), msg.get("first_block"), msg.get("peers")
        if not isinstance(tid, str) or not 0 < len(tid) <= 512:
            return {"error": "transfer_id must be a string of 1 to 512 characters"}
        if not isinstance(blocks, list) or not all(isinstance(b, int) and b >= 0 for b in blocks) or len(blocks) > 1 << 20:
            return {"error": "blocks must be a list of block numbers"}
        if not isinstance(first, int) or first < 0:
            return {"error": "first_block must be a non-negative integer"}
        if not isinstance(peers, list) or len(peers) != self._tp:
            return {"error": f"this prefill instance has TP = {self._tp}; the decode instance registered {len(peers) if isinstance(peers, list) else '?'} ranks"}
        try:
            hs = [R2cclHandshake(base64.b64decode(p["engine_metadata"]), int(p["pool"]), int(p["layers"]),
                                 int(p["block_bytes"]), int(p["parts"])) for p in peers]
        except (KeyError, TypeError, ValueError) as e:
            return {"error": f"a rank's metadata is malformed: {e}"}
        mine = self._workers[0] if self._workers else None
        for r, h in enumerate(hs):
            if mine and (h.layers, h.block_bytes, h.parts) != (mine.layers, mine.block_bytes, mine.parts):
                return {"error": f"decode rank {r}'s KV layout ({h.layers} layers, {h.block_bytes}-byte blocks, {h.parts} parts) "
                                 f"is not this prefill instance's ({mine.layers}, {mine.block_bytes}, {mine.parts})"}
        with self._lock:
            if len(self._registrations) >= 65536:
                return {"error": "too many registrations waiting"}
            self._registrations[tid] = _Registration(blocks, first, hs)
        return {"ok": True}

    def _register(self, req_id: str, tid: str, host: str, port: int, first: int, blocks: list[int]) -> None:
        """D side, on a thread: registers a request's blocks with P; a failure fails the request."""
        peers = [{"engine_metadata": base64.b64encode(w.engine_metadata).decode(), "pool": w.pool, "layers": w.layers,
                  "block_bytes": w.block_bytes, "parts": w.parts} for w in (self._workers or [])]
        try:
            answer = side.call(host, port, self._token, {"op": "register", "transfer_id": tid, "blocks": blocks,
                                                         "first_block": first, "peers": peers}, timeout=self._timeout)
            why = answer.get("error") if not answer.get("ok") else None
        except (OSError, side.SideChannelError) as e:
            why = f"could not register with {host}:{port}: {e}"
        with self._lock:
            self._registering.discard(req_id)
            if why:
                self._failed[req_id] = str(why)

    # ---- vLLM's calls
    def matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill") and not params.get("_r2ccl_registered"):
            self._local_hits[request.request_id] = num_computed_tokens
            count = len(request.prompt_token_ids or []) - 1 - num_computed_tokens
            return (count, True) if count > 0 else (0, False)
        if params.get("do_remote_decode") and params.get("transfer_id"):
            # D registers first: hold the request back until its registration is here, so that its
            # layers go as they are computed; past the wait, prefill and push at the end.
            tid = str(params["transfer_id"])
            with self._lock:
                here = tid in self._registrations
            entry = self._p.get(request.request_id)
            if entry is None:
                entry = self._p[request.request_id] = _PRequest(request, tid, time.monotonic())
            if not here and time.monotonic() - entry.first_seen < self._wait:
                return None, False
        return 0, False

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        if params.get("do_remote_decode"):
            tid = str(params.get("transfer_id") or request.request_id)
            self._p.setdefault(request.request_id, _PRequest(request, tid, time.monotonic()))
            return
        if not params.get("do_remote_prefill") or params.get("_r2ccl_registered") or num_external_tokens <= 0:
            return
        params["_r2ccl_registered"] = True
        ids = blocks.get_block_ids()[0]
        local = self._local_hits.pop(request.request_id, request.num_computed_tokens)
        first = local // self._block_size  # the tokens before come from D's own prefix cache
        end = _blocks_for(local + num_external_tokens, self._block_size)
        tid = str(params.get("transfer_id") or params.get("remote_request_id") or "")
        host, port = params.get("remote_host"), params.get("remote_port")
        if not tid or not host or not port:
            self._failed[request.request_id] = (f"kv_transfer_params lack transfer_id/remote_request_id, remote_host "
                                                f"or remote_port: {sorted(params)}")
            return
        dst = ids[first:end]
        self._loading.add(request.request_id)
        self._expects.append(Expect(request.request_id, tid, time.time() + self._timeout))
        with self._lock:
            self._registering.add(request.request_id)
        threading.Thread(target=self._register, args=(request.request_id, tid, str(host), int(port), first, list(dst)),
                         daemon=True).start()

    def build_meta(self, out: SchedulerOutput, kv_cache_manager: Any) -> R2cclConnectorMetadata:
        meta = R2cclConnectorMetadata()
        meta.expects, self._expects = self._expects, []
        with self._lock:
            meta.recv_failed, self._failed = self._failed, {}
        now = time.monotonic()
        with self._lock:  # registrations no request here claimed within the lease
            for tid in [tid for tid, r in self._registrations.items() if now - r.at > self._lease]:
                logger.warning("r2ccl KV connector: transfer %s: registered by a decode instance, but no "
                               "request here named it within %.0f s", tid, self._lease)
                del self._registrations[tid]
        for req_id, p in list(self._p.items()):
            if p.pushed:
                continue
            with self._lock:
                reg = self._registrations.get(p.transfer_id)
            scheduled = out.num_scheduled_tokens.get(req_id, 0)
            completes = scheduled > 0 and p.request.num_computed_tokens + scheduled >= p.request.num_prompt_tokens
            if reg is not None and (completes or p.finished):
                src = p.block_ids if p.finished else kv_cache_manager.get_blocks(req_id).get_block_ids()[0]
                n = min(len(reg.blocks), len(src) - reg.first_block)
                meta.pushes.append(Push(req_id, p.transfer_id, list(src[reg.first_block:reg.first_block + n]),
                                        reg.blocks[:n], reg.peers, layered=not p.finished))
                p.pushed = True
                with self._lock:
                    self._registrations.pop(p.transfer_id, None)
            elif p.finished and now - p.held_since > self._lease:
                logger.warning("r2ccl KV connector: request %s (transfer %s): no decode instance registered "
                               "within %.0f s; its blocks are freed", req_id, p.transfer_id, self._lease)
                meta.send_released.append(req_id)
                del self._p[req_id]
        return meta

    def finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params or {}
        self._local_hits.pop(request.request_id, None)  # a request that ended before its allocation
        if request.request_id in self._loading:
            # D: a push may still be writing into its blocks; they are freed once it ended (or
            # timed out), when the worker names the request in finished_recving.
            return True, None
        p = self._p.get(request.request_id)
        if not params.get("do_remote_decode") or p is None:
            return False, None
        from vllm.v1.request import RequestStatus

        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED) or not block_ids:
            if not p.pushed:
                del self._p[request.request_id]
                return False, None
        p.finished, p.held_since, p.block_ids = True, time.monotonic(), list(block_ids)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": p.transfer_id,
            "remote_request_id": request.request_id,
            "remote_engine_id": self.engine_id,
            "remote_host": self._host,
            "remote_port": self._server.port if self._server else self._port,
            "remote_block_ids": block_ids,
            "remote_num_tokens": request.num_computed_tokens,
            "tp_size": self._tp,
        }

    def output(self, connector_output: Any) -> None:
        for req_id in connector_output.finished_sending or ():
            self._p.pop(req_id, None)
        self._loading -= set(connector_output.finished_recving or ())

    def pending(self) -> bool:
        with self._lock:
            registering = bool(self._registering)
        return bool(self._p or self._expects or self._failed or self._loading or registering)


@dataclasses.dataclass
class _Sending:
    push: Push
    kv_id: int
    started: float
    layers_added: set[int] = dataclasses.field(default_factory=set)
    bytes: int = 0


class _Worker:
    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        from vllm.distributed import parallel_state

        self._config = vllm_config
        self._num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else None
        # The TP rank; where no TP group is set up (one process), the configured rank.
        self._rank = (parallel_state.get_tp_group().rank_in_group if parallel_state.model_parallel_is_initialized()
                      else vllm_config.parallel_config.rank)
        self._engine = None
        self._pool = -1
        self._layer_of: dict[str, int] = {}
        self._layers = 0
        self._block_bytes = 0
        self._parts = 1
        self._peers: dict[bytes, int] = {}  # D worker's metadata digest -> peer number
        self._ids = itertools.count(1)
        self._layered: list[_Sending] = []  # this step's
        self._sending: dict[int, _Sending] = {}  # kv_id ->
        self._expects: dict[str, Expect] = {}  # transfer_id ->
        self._done_sending: set[str] = set()
        # A layered push can end before its request does; vLLM frees the blocks of a request named
        # in finished_sending, so such a request is named only once vLLM said it finished.
        self._ended_running: set[str] = set()
        self._finished_running: set[str] = set()
        self._done_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._stats = R2cclKVConnectorStats()

    # Each layer's paged KV tensor: [num_blocks, ...] (one part: K and V of a block together, as
    # vLLM-CPU keeps them) or [2, num_blocks, ...] (K and V apart), every block contiguous.
    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from r2ccl import KvEngine

        buffers, places, seen = [], [], {}
        block_bytes = parts = None
        for name, t in kv_caches.items():
            if t.data_ptr() in seen:  # a layer that shares another's cache
                self._layer_of[name] = seen[t.data_ptr()]
                continue
            elt = t.element_size()
            nb = self._num_blocks or t.shape[0]
            if t.is_contiguous() and t.dim() >= 2 and t.shape[0] == nb:
                p, bb, part_off, stride = 1, t[0].numel() * elt, 0, t.stride(0) * elt
            elif t.is_contiguous() and t.dim() >= 3 and t.shape[0] == 2 and t.shape[1] == nb:
                p, bb, part_off, stride = 2, t[0, 0].numel() * elt, t.stride(0) * elt, t.stride(1) * elt
            else:
                raise ValueError(f"r2ccl KV connector: layer {name}'s KV cache has shape {tuple(t.shape)} and strides "
                                 f"{t.stride()}; expected a contiguous [num_blocks={nb}, ...] or [2, num_blocks, ...]")
            if block_bytes not in (None, bb) or parts not in (None, p):
                raise ValueError(f"r2ccl KV connector: layer {name} has {bb}-byte blocks in {p} part(s), the others "
                                 f"{block_bytes} in {parts}")
            block_bytes, parts = bb, p
            index = len(buffers)
            buffers.append(t)
            for part in range(p):
                places.append((index, part * part_off, stride))
            seen[t.data_ptr()] = index
            self._layer_of[name] = index
        self._layers, self._block_bytes, self._parts = len(buffers), block_bytes, parts
        nb = self._num_blocks or next(iter(kv_caches.values())).shape[0 if parts == 1 else 1]
        self._engine = KvEngine(f"vllm-{self._config.kv_transfer_config.engine_id}-tp{self._rank}")
        self._pool = self._engine.register_pool(buffers, layers=self._layers, blocks=nb, block_bytes=block_bytes,
                                                parts=parts, places=places)

    def handshake(self) -> R2cclHandshake:
        return R2cclHandshake(self._engine.metadata(), self._pool, self._layers, self._block_bytes, self._parts)

    def _peer(self, h: R2cclHandshake) -> int:
        """The decode worker's peer number, connected once: a channel whose rails went down keeps
        its number, and its rails rejoin when their links answer probes (r2ccl's own recovery)."""
        key = hashlib.sha256(h.engine_metadata).digest()
        if key not in self._peers:
            self._peers[key] = self._engine.connect(h.engine_metadata)
        return self._peers[key]

    def _fail_send(self, s: _Sending, why: str) -> None:
        logger.warning("r2ccl KV connector: push of request %s (transfer %s) failed: %s", s.push.req_id,
                       s.push.transfer_id, why)
        self._stats.data["pushes_failed"] += 1
        self._ended(s)  # its blocks are freed; D reports the failure

    def _ended(self, s: _Sending) -> None:
        (self._ended_running if s.push.layered else self._done_sending).add(s.push.req_id)

    def _begin(self, push: Push) -> _Sending | None:
        kv_id = next(self._ids)
        s = _Sending(push, kv_id, time.monotonic())
        try:
            peer = self._peer(push.peers[self._rank])
            remote = push.peers[self._rank].pool
            if push.layered:
                self._engine.begin(kv_id, peer, self._pool, remote)
            else:
                spans = [(0, self._layers, push.src_blocks, push.dst_blocks)]
                self._engine.submit(kv_id, peer, self._pool, remote, spans, push.transfer_id.encode())
                s.bytes = len(push.src_blocks) * self._layers * self._parts * self._block_bytes
        except Exception as e:  # noqa: BLE001 - the request is reported, the step goes on
            self._fail_send(s, str(e))
            return None
        self._sending[kv_id] = s
        return s

    def bind(self, meta: R2cclConnectorMetadata) -> None:
        self._layered = []
        for e in meta.expects:
            self._expects[e.transfer_id] = e
        for req_id, why in meta.recv_failed.items():
            logger.warning("r2ccl KV connector: request %s cannot load its KV: %s", req_id, why)
            for tid in [tid for tid, e in self._expects.items() if e.req_id == req_id]:
                del self._expects[tid]
            self._fail_recv(req_id)
        self._done_sending.update(meta.send_released)
        for push in meta.pushes:
            if push.layered and (s := self._begin(push)) is not None:
                self._layered.append(s)

    def start(self, meta: R2cclConnectorMetadata) -> None:
        for push in meta.pushes:
            if not push.layered:
                self._begin(push)

    def save_layer(self, layer_name: str) -> None:
        layer = self._layer_of.get(layer_name)
        if layer is None:
            return
        for s in self._layered:
            self._add(s, layer)

    def _add(self, s: _Sending, layer: int) -> None:
        if layer in s.layers_added or s.kv_id not in self._sending:
            return
        s.layers_added.add(layer)
        try:
            self._engine.add(s.kv_id, (layer, layer + 1, s.push.src_blocks, s.push.dst_blocks))
            s.bytes += len(s.push.src_blocks) * self._parts * self._block_bytes
        except Exception as e:  # noqa: BLE001
            self._sending.pop(s.kv_id, None)
            self._fail_send(s, str(e))

    def seal(self) -> None:
        for s in self._layered:
            for layer in range(self._layers):  # a layer whose save_kv_layer vLLM skipped goes now
                self._add(s, layer)
            if s.kv_id not in self._sending:
                continue
            try:
                self._engine.seal(s.kv_id, s.push.transfer_id.encode())
            except Exception as e:  # noqa: BLE001
                self._sending.pop(s.kv_id, None)
                self._fail_send(s, str(e))
        self._layered = []

    def _fail_recv(self, req_id: str) -> None:
        """The request's KV is not (all) here: vLLM recomputes it from its first token, or fails it
        (kv_load_failure_policy). Its blocks are not reported one by one: failed_recving covers
        them all, whatever landed."""
        self._failed_recving.add(req_id)
        self._done_recving.add(req_id)
        self._stats.data["pushes_failed"] += 1

    def results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        running = {s.push.req_id for s in self._sending.values() if s.push.layered} | self._ended_running
        self._finished_running |= finished_req_ids & running
        if self._engine is not None:
            for kv_id, s in list(self._sending.items()):
                try:
                    state = self._engine.poll(kv_id)
                except R2cclError as e:  # the push failed: poll says why
                    state = str(e)
                if state in ("pending", "in_flight"):
                    continue
                del self._sending[kv_id]
                if state == "done":
                    self._ended(s)
                    self._stats.data["pushes_sent"] += 1
                    self._stats.data["pushes_layered"] += int(s.push.layered)
                    self._stats.data["bytes_sent"] += s.bytes
                    self._stats.data["push_seconds"].append(time.monotonic() - s.started)
                else:
                    self._fail_send(s, state)
            try:
                notes = self._engine.notifications()
            except R2cclError as e:
                logger.warning("r2ccl KV connector: reading the KV engine's notifications: %s", e)
                notes = []
            for note in notes:
                tid = note.payload.decode(errors="replace")
                e = self._expects.pop(tid, None)
                if e is None:
                    logger.warning("r2ccl KV connector: a push of transfer %r that no request here waits for (%s)",
                                   tid, note.state)
                    continue
                if note.state == "done":
                    self._done_recving.add(e.req_id)
                    self._stats.data["pushes_received"] += 1
                else:
                    logger.warning("r2ccl KV connector: request %s: its KV push %s: %s", e.req_id, note.state, note.reason)
                    self._fail_recv(e.req_id)
        now = time.time()
        for tid, e in list(self._expects.items()):
            if now > e.deadline:
                del self._expects[tid]
                logger.warning("r2ccl KV connector: request %s: its KV did not arrive within transfer_timeout_s",
                               e.req_id)
                self._fail_recv(e.req_id)
        both = self._ended_running & self._finished_running
        self._ended_running -= both
        self._finished_running -= both
        self._done_sending |= both
        out = KVConnectorTransferResults(set(self._done_sending), set(self._done_recving), set(self._failed_recving))
        self._done_sending.clear()
        self._done_recving.clear()
        self._failed_recving.clear()
        return out

    def take_stats(self) -> KVConnectorStats | None:
        if self._stats.is_empty():
            return None
        out, self._stats = self._stats, R2cclKVConnectorStats()
        return out

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
