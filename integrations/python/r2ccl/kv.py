"""r2ccl.KvEngine: blocks of a paged KV cache moved between a prefill and a decode process, over
libr2ccl.so's r2cclKv* functions. Only register_pool takes tensors (and imports torch)."""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from . import _lib
from ._errors import R2cclError, raise_for
from ._tensors import torch_module

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True)
class Span:
    """Blocks of layers [first_layer, last_layer), every part: src_blocks[i] of the sending pool
    lands in dst_blocks[i] of the receiving one."""

    first_layer: int
    last_layer: int
    src_blocks: Sequence[int]
    dst_blocks: Sequence[int]


@dataclasses.dataclass(frozen=True)
class Notification:
    """A request pushed to this side has ended."""

    request: int
    peer: int
    state: str  # "done", "failed" or "cancelled"
    verified: bool  # R2CCL_KV_VERIFY: every block's checksum matched
    payload: bytes
    invalid_blocks: list[int]  # failed or cancelled: the destination blocks not valid
    reason: str

    @property
    def invalid_block_count(self) -> int:
        return len(self.invalid_blocks)


def _spans(spans: Sequence[Span | tuple]) -> tuple[ctypes.Array, list]:
    keep = []
    arr = (_lib.KvSpan * max(1, len(spans)))()
    for i, s in enumerate(spans):
        s = s if isinstance(s, Span) else Span(*s)
        if len(s.src_blocks) != len(s.dst_blocks):
            raise ValueError(
                f"r2ccl: span {i} has {len(s.src_blocks)} source blocks and "
                f"{len(s.dst_blocks)} destination blocks"
            )
        src = (ctypes.c_uint32 * max(1, len(s.src_blocks)))(*s.src_blocks)
        dst = (ctypes.c_uint32 * max(1, len(s.dst_blocks)))(*s.dst_blocks)
        keep += [src, dst]
        arr[i] = _lib.KvSpan(s.first_layer, s.last_layer, src, dst, len(s.src_blocks))
    return arr, keep


class KvEngine:
    """An engine on an endpoint of its own (its rails: R2CCL_NICS). `name` labels this side in
    the peer's messages. Usable from any thread."""

    def __init__(self, name: str | None = None) -> None:
        self._lib = _lib.library()
        self._handle: int | None = None
        self._pools: dict[int, list[torch.Tensor]] = {}
        self._begun: dict[int, int] = {}  # request -> local pool, from begin() until seal()
        handle = ctypes.c_void_p()
        raise_for(
            self._lib.r2cclKvEngineCreate(ctypes.byref(handle), name.encode() if name else None),
            "KvEngineCreate",
            lambda: self._lib.r2cclKvGetLastError(None),
        )
        self._handle = handle.value

    def _live(self) -> int:
        if self._handle is None:
            raise R2cclError("r2ccl: the KV engine is closed")
        return self._handle

    def _call(self, what: str, fn, *args) -> None:
        handle = self._live()
        raise_for(fn(handle, *args), what, lambda: self._lib.r2cclKvGetLastError(handle))

    def register_pool(
        self,
        buffers: Sequence[torch.Tensor],
        *,
        layers: int,
        blocks: int,
        block_bytes: int,
        parts: int = 2,
        places: Sequence[tuple[int, int, int]] | None = None,
    ) -> int:
        """Registers the KV cache held in `buffers` (contiguous tensors on the CPU or on CUDA GPUs:
        GPU memory goes through host staging over tcp rails) as a pool; returns its number. `places[layer * parts + part]` = (buffer, offset, stride) in bytes; None:
        every layer and part one after another in buffer 0. The tensors are kept alive until
        unregister_pool."""
        if not buffers:
            raise ValueError("r2ccl: register_pool needs at least one buffer")
        torch = torch_module(f"register_pool's buffers must be torch tensors (got {type(buffers[0]).__name__})")
        for i, b in enumerate(buffers):
            if not isinstance(b, torch.Tensor):
                raise TypeError(f"r2ccl: buffers[{i}] must be a torch.Tensor, not {type(b).__name__}")
            if b.device.type not in ("cpu", "cuda"):
                raise ValueError(f"r2ccl: buffers[{i}] is on {b.device}; KV pools are CPU or CUDA memory")
            if not b.is_contiguous():
                raise ValueError(f"r2ccl: buffers[{i}] is not contiguous")
        ptrs = (ctypes.c_void_p * len(buffers))(*[b.data_ptr() for b in buffers])
        lens = (ctypes.c_size_t * len(buffers))(*[b.numel() * b.element_size() for b in buffers])
        place_arr = None
        if places is not None:
            place_arr = (_lib.KvPlace * len(places))(*[_lib.KvPlace(*p) for p in places])
            if len(places) != layers * parts:
                raise ValueError(f"r2ccl: {len(places)} places; layers * parts is {layers * parts}")
        layout = _lib.KvLayout(layers, blocks, block_bytes, parts, place_arr)
        pool = ctypes.c_uint32()
        self._call(
            "KvRegisterPool", self._lib.r2cclKvRegisterPool, ptrs, lens, len(buffers),
            ctypes.byref(layout), ctypes.byref(pool),
        )
        self._pools[pool.value] = list(buffers)
        return pool.value

    def unregister_pool(self, pool: int) -> None:
        self._call("KvUnregisterPool", self._lib.r2cclKvUnregisterPool, pool)
        self._pools.pop(pool, None)

    def metadata(self) -> bytes:
        """This side's metadata (endpoint, token, pools), for the other side's connect()."""
        size = ctypes.c_size_t(0)
        self._call("KvGetMetadata", self._lib.r2cclKvGetMetadata, None, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        self._call("KvGetMetadata", self._lib.r2cclKvGetMetadata, buf, ctypes.byref(size))
        return buf.raw[: size.value]

    def connect(self, metadata: bytes) -> int:
        """Connects to the side whose metadata this is; returns its peer number here."""
        if not isinstance(metadata, (bytes, bytearray)):
            raise TypeError(f"r2ccl: metadata must be bytes, not {type(metadata).__name__}")
        peer = ctypes.c_int(-1)
        self._call("KvLoadRemote", self._lib.r2cclKvLoadRemote, bytes(metadata), len(metadata), ctypes.byref(peer))
        return peer.value

    def disconnect(self, peer: int) -> None:
        self._call("KvDisconnect", self._lib.r2cclKvDisconnect, peer)

    def _settle(self, pool: int) -> None:
        """The blocks of a pool on CUDA are read when they are handed over: what the current
        streams of its devices wrote must be there first."""
        devices = {b.device for b in self._pools.get(pool, []) if b.device.type == "cuda"}
        if devices:
            import torch

            for d in devices:
                torch.cuda.current_stream(d).synchronize()

    def submit(
        self, request: int, peer: int, local_pool: int, remote_pool: int,
        spans: Sequence[Span | tuple], payload: bytes = b"",
    ) -> None:
        """Pushes the spans' blocks of `local_pool` into the peer's `remote_pool`; the peer is
        notified, with `payload`, once every block landed. A pool on CUDA: the current streams of
        its devices are synchronized first, so that what they wrote goes."""
        self._settle(local_pool)
        arr, _keep = _spans(spans)
        self._call(
            "KvSubmit", self._lib.r2cclKvSubmit, request, peer, local_pool, remote_pool, arr,
            len(spans), bytes(payload), len(payload),
        )

    def begin(self, request: int, peer: int, local_pool: int, remote_pool: int) -> None:
        """Starts a push filled layer by layer with add() and ended with seal()."""
        self._call("KvBegin", self._lib.r2cclKvBegin, request, peer, local_pool, remote_pool)
        self._begun[request] = local_pool

    def add(self, request: int, span: Span | tuple) -> None:
        """Adds blocks to a push that begin() started (a pool on CUDA: as submit())."""
        self._settle(self._begun.get(request, -1))

        arr, _keep = _spans([span])
        self._call("KvAdd", self._lib.r2cclKvAdd, request, arr)

    def seal(self, request: int, payload: bytes = b"") -> None:
        self._call("KvSeal", self._lib.r2cclKvSeal, request, bytes(payload), len(payload))
        self._begun.pop(request, None)

    def pull(
        self, request: int, peer: int, local_pool: int, remote_pool: int, spans: Sequence[Span | tuple]
    ) -> None:
        """The peer pushes the spans' blocks of its `remote_pool` into our `local_pool`."""
        arr, _keep = _spans(spans)
        self._call("KvPull", self._lib.r2cclKvPull, request, peer, local_pool, remote_pool, arr, len(spans))

    def poll(self, request: int) -> str:
        """The request's state: pending, in_flight, done, failed or cancelled."""
        state = ctypes.c_int(0)
        handle = self._live()
        result = self._lib.r2cclKvPoll(handle, request, ctypes.byref(state))
        if result != _lib.IN_PROGRESS:
            raise_for(result, "KvPoll", lambda: self._lib.r2cclKvGetLastError(handle))
        return _lib.KV_STATES[state.value]

    def wait(self, request: int, timeout: float = 60.0) -> str:
        """Waits until the request ends (R2cclError with code r2cclTimeout after `timeout` s)."""
        state = ctypes.c_int(0)
        self._call("KvWait", self._lib.r2cclKvWait, request, int(timeout * 1000), ctypes.byref(state))
        return _lib.KV_STATES[state.value]

    def cancel(self, request: int) -> None:
        """Stops a push (it ends cancelled once what was in flight lands), or abandons a pull at
        once (writes of the peer already in flight may still land in its blocks)."""
        self._call("KvCancel", self._lib.r2cclKvCancel, request)

    def invalid_blocks(self, request: int) -> list[int]:
        """The destination blocks not valid after this side's request (a push or a pull) ended
        failed or cancelled; [] after done."""
        return self._invalid_blocks(-1, request)

    def _invalid_blocks(self, peer: int, request: int) -> list[int]:
        count = ctypes.c_size_t(0)
        get = self._lib.r2cclKvGetInvalidBlocks
        self._call("KvGetInvalidBlocks", get, peer, request, None, 0, ctypes.byref(count))
        if count.value == 0:
            return []
        blocks = (ctypes.c_uint32 * count.value)()
        self._call("KvGetInvalidBlocks", get, peer, request, blocks, count.value, ctypes.byref(count))
        return list(blocks[: count.value])

    def notifications(self) -> list[Notification]:
        """Every notification waiting (requests pushed to this side that ended), oldest first."""
        out = []
        payload = ctypes.create_string_buffer(_lib.KV_MAX_PAYLOAD)
        for _ in range(1 << 16):  # bounded: the engine's own queue is smaller
            note = _lib.KvNotification()
            got = ctypes.c_int(0)
            self._call(
                "KvGetNotification", self._lib.r2cclKvGetNotification, ctypes.byref(note), payload,
                _lib.KV_MAX_PAYLOAD, ctypes.byref(got),
            )
            if not got.value:
                break
            invalid = self._invalid_blocks(note.peer, note.request) if note.invalidBlocks else []
            out.append(
                Notification(
                    request=note.request, peer=note.peer, state=_lib.KV_STATES.get(note.state, "failed"),
                    verified=bool(note.verified), payload=payload.raw[: note.payloadBytes],
                    invalid_blocks=invalid, reason=note.reason.decode(errors="replace"),
                )
            )
        return out

    def close(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            raise_for(self._lib.r2cclKvEngineDestroy(handle), "KvEngineDestroy", lambda: self._lib.r2cclKvGetLastError(None))
        self._pools.clear()

    def __enter__(self) -> KvEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
