"""r2ccl.Communicator: collectives and point-to-point transfers of torch tensors between ranks,
over libr2ccl.so. Shaped like vLLM's PyNcclCommunicator: made from a unique id that rank 0 of an
existing CPU process group (gloo) broadcasts, or from the launch environment. torch is imported
by the first call that needs it (_tensors.torch_module), not with this module."""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from . import _lib
from ._errors import R2cclError, raise_for
from ._tensors import checked, dtype_code, numel_is, same_dtype, stream_of, torch_module

if TYPE_CHECKING:
    import torch


def get_unique_id() -> bytes:
    """Rank 0 only: starts the rendezvous listener in this process and returns the 128-byte id to
    hand to every rank (r2cclGetUniqueId)."""
    lib = _lib.library()
    uid = _lib.UniqueId()
    raise_for(lib.r2cclGetUniqueId(ctypes.byref(uid)), "get_unique_id", lambda: lib.r2cclGetLastError(None))
    return bytes(bytearray(uid.internal))


def _op_code(op: object) -> int:
    if isinstance(op, str):
        if op.lower() in _lib.OPS:
            return _lib.OPS[op.lower()]
    elif "torch" in sys.modules:  # else `op` cannot be one of torch's ReduceOps
        reduce_op = sys.modules["torch"].distributed.ReduceOp
        by_op = {
            reduce_op.SUM: "sum",
            reduce_op.PRODUCT: "prod",
            reduce_op.MAX: "max",
            reduce_op.MIN: "min",
        }
        if hasattr(reduce_op, "AVG"):
            by_op[reduce_op.AVG] = "avg"
        for known, name in by_op.items():
            if op == known:
                return _lib.OPS[name]
    raise ValueError(f"r2ccl: op {op!r} is not a reduction r2ccl knows ({', '.join(_lib.OPS)})")


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def _output(input: torch.Tensor, output: torch.Tensor | None, shape: tuple, why: str) -> torch.Tensor:
    """A collective's output: a new tensor of `shape` when None, else `output` checked (a host
    tensor, contiguous, of `input`'s dtype, with as many elements as `shape`)."""
    if output is None:
        torch = torch_module("output=None makes a new torch tensor")
        return torch.empty(shape, dtype=input.dtype, device=input.device)
    checked(output, "output")
    same_dtype(input, output, "input", "output")
    numel_is(output, math.prod(shape), "output", why)
    return output


_env_lock = threading.Lock()


@contextlib.contextmanager
def _gpu_nccl(own: bool | None) -> Iterator[None]:
    """R2CCL_GPU_NCCL as `own` says while a communicator is made (libr2ccl reads its
    configuration then), as it was afterwards; nothing where `own` is None."""
    if own is None:
        yield
        return
    with _env_lock:
        before = os.environ.get("R2CCL_GPU_NCCL")
        os.environ["R2CCL_GPU_NCCL"] = "1" if own else "0"
        try:
            yield
        finally:
            if before is None:
                del os.environ["R2CCL_GPU_NCCL"]
            else:
                os.environ["R2CCL_GPU_NCCL"] = before


class Communicator:
    """A communicator of `world_size` ranks. Make it one of three ways:

    - `Communicator(group)`: every rank of a torch.distributed process group with a CPU backend
      (gloo) calls it; the group's rank 0 makes the id and broadcasts it over the group;
    - `Communicator(unique_id=..., rank=r, world_size=n)`: the id from `get_unique_id()` on rank
      0, handed out by any means;
    - `Communicator(from_env=True)`: R2CCL_RANK / R2CCL_NRANKS / R2CCL_BOOTSTRAP (or mpirun's
      variables).

    Tensors are CPU tensors, or CUDA tensors where libr2ccl was built with CUDA (one rank per GPU;
    NVLink inside a node, the rails across nodes): a call on CUDA tensors is queued on the device's current stream and returns at
    once, and works under `torch.cuda.graph` capture once the communicator's GPU side is set up
    (`device=` here, `bind_device()`, or one call on CUDA tensors before capturing).

    Collectives are out of place unless `output` is `input`; they never write their input
    otherwise. A communicator is used from one thread at a time; `abort()` may come from any.

    `own_nccl`: whether the GPU side among the GPUs of one node opens an NCCL communicator of its
    own (about 770 MiB of GPU memory per GPU) for the largest collectives and for send/recv on
    CUDA tensors; None: as R2CCL_GPU_NCCL says (default yes). An engine that has one for the
    group already passes False and keeps those calls on its own."""

    def __init__(
        self,
        group: torch.distributed.ProcessGroup | None = None,
        *,
        unique_id: bytes | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        from_env: bool = False,
        device: torch.device | int | str | None = None,
        own_nccl: bool | None = None,
    ) -> None:
        self._lib = _lib.library()
        self._handle: int | None = None
        self._device: int | None = None
        self._lock = threading.Lock()
        ways = (group is not None) + (unique_id is not None) + bool(from_env)
        if ways != 1:
            raise ValueError(
                "r2ccl: make a Communicator from exactly one of: a process group, a unique_id "
                "(with rank and world_size), or from_env=True"
            )
        handle = ctypes.c_void_p()
        if from_env:
            with _gpu_nccl(own_nccl):
                result = self._lib.r2cclCommInitFromEnv(ctypes.byref(handle))
            self._call(result, "CommInitFromEnv", None)
        else:
            if group is not None:
                unique_id, rank, world_size = self._id_from_group(group)
            if rank is None or world_size is None:
                raise ValueError("r2ccl: a unique_id needs rank and world_size")
            if not isinstance(unique_id, (bytes, bytearray)) or len(unique_id) != 128:
                raise ValueError("r2ccl: unique_id must be the 128 bytes get_unique_id() returned")
            uid = _lib.UniqueId()
            ctypes.memmove(uid.internal, bytes(unique_id), 128)
            with _gpu_nccl(own_nccl):
                result = self._lib.r2cclCommInitRank(
                    ctypes.byref(handle), int(world_size), uid, int(rank)
                )
            self._call(result, "CommInitRank", None)
        self._handle = handle.value
        self.rank = self._query(self._lib.r2cclCommUserRank, "CommUserRank")
        self.world_size = self._query(self._lib.r2cclCommCount, "CommCount")
        if device is not None and torch_module("device= takes a torch device").device(device).type == "cuda":
            self.bind_device(device)

    @staticmethod
    def _id_from_group(group: torch.distributed.ProcessGroup) -> tuple[bytes, int, int]:
        torch = torch_module("a Communicator made from a process group uses torch.distributed")
        dist = torch.distributed
        rank = dist.get_rank(group)
        world_size = dist.get_world_size(group)
        buf = torch.zeros(128, dtype=torch.uint8)
        if rank == 0:
            buf.copy_(torch.frombuffer(bytearray(get_unique_id()), dtype=torch.uint8))
        dist.broadcast(buf, src=dist.get_global_rank(group, 0), group=group)
        return bytes(buf.tolist()), rank, world_size

    # ---- plumbing

    def _call(self, result: int, what: str, handle: int | None) -> None:
        raise_for(result, what, lambda: self._lib.r2cclGetLastError(handle))

    def _live(self) -> int:
        if self._handle is None:
            raise R2cclError("r2ccl: the communicator is closed")
        return self._handle

    def _run(self, fn, what: str, tensor: torch.Tensor, *args) -> None:
        """An operation: its arguments, then the communicator and the stream: NULL for host
        memory, the current CUDA stream of `tensor`'s device for CUDA memory (queued there, as
        NCCL's calls are; capturable in a CUDA graph)."""
        handle = self._live()
        self._call(fn(*args, handle, stream_of(tensor)), what, handle)

    def _query(self, fn, what: str) -> int:
        out = ctypes.c_int(-1)
        self._call(fn(self._live(), ctypes.byref(out)), what, self._handle)
        return out.value

    # ---- collectives

    def all_reduce(
        self, input: torch.Tensor, output: torch.Tensor | None = None, op: object = "sum"
    ) -> torch.Tensor:
        """The element-wise reduction of every rank's `input`, into `output` (a new tensor when
        None; `input` itself for in place)."""
        checked(input, "input")
        output = _output(input, output, tuple(input.shape), "all_reduce of the input")
        self._run(
            self._lib.r2cclAllReduce, "AllReduce", input, _ptr(input), _ptr(output), input.numel(),
            dtype_code(input.dtype, "input"), _op_code(op),
        )
        return output

    def all_gather(self, input: torch.Tensor, output: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's `input`, rank after rank along dim 0, into `output` (world_size times
        `input`'s elements; a new tensor when None)."""
        checked(input, "input")
        shape = (input.shape[0] * self.world_size, *input.shape[1:]) if input.dim() else (self.world_size,)
        output = _output(input, output, shape, "all_gather of the input")
        self._run(
            self._lib.r2cclAllGather, "AllGather", input, _ptr(input), _ptr(output), input.numel(),
            dtype_code(input.dtype, "input"),
        )
        return output

    def reduce_scatter(
        self, input: torch.Tensor, output: torch.Tensor | None = None, op: object = "sum"
    ) -> torch.Tensor:
        """Block `rank` (of world_size equal blocks of `input`) of the element-wise reduction,
        into `output` (a new tensor when None)."""
        checked(input, "input")
        if input.numel() % self.world_size != 0:
            raise ValueError(
                f"r2ccl: input has {input.numel()} elements, not a multiple of the "
                f"{self.world_size} ranks"
            )
        n = input.numel() // self.world_size
        if input.dim() and input.shape[0] % self.world_size == 0:
            shape = (input.shape[0] // self.world_size, *input.shape[1:])
        else:
            shape = (n,)
        output = _output(input, output, shape, "reduce_scatter of the input")
        self._run(
            self._lib.r2cclReduceScatter, "ReduceScatter", input, _ptr(input), _ptr(output), n,
            dtype_code(input.dtype, "input"), _op_code(op),
        )
        return output

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`src`'s `tensor` into every rank's `tensor` (in place)."""
        checked(tensor, "tensor")
        self._run(
            self._lib.r2cclBroadcast, "Broadcast", tensor, _ptr(tensor), _ptr(tensor), tensor.numel(),
            dtype_code(tensor.dtype, "tensor"), int(src),
        )
        return tensor

    def reduce(
        self, input: torch.Tensor, output: torch.Tensor | None = None, op: object = "sum", root: int = 0
    ) -> torch.Tensor:
        """The reduction of every rank's `input` into `root`'s `output` (other ranks' `output`
        is left as it was)."""
        checked(input, "input")
        output = _output(input, output, tuple(input.shape), "reduce of the input")
        self._run(
            self._lib.r2cclReduce, "Reduce", input, _ptr(input), _ptr(output), input.numel(),
            dtype_code(input.dtype, "input"), _op_code(op), int(root),
        )
        return output

    def barrier(self) -> None:
        """Returns once every rank reached it (on a communicator bound to a GPU with `device=`
        or `bind_device()`, also once the work queued on that GPU's current stream is done)."""
        handle = self._live()
        stream = None
        if self._device is not None:  # bound by bind_device, which imported torch
            cuda = torch_module("a barrier on a GPU waits for its torch stream").cuda
            stream = cuda.current_stream(self._device).cuda_stream
        self._call(self._lib.r2cclBarrier(handle, stream), "Barrier", handle)

    def bind_device(self, device: torch.device | int | str) -> None:
        """Sets up the GPU side on `device` now (r2cclCommBindDevice; every rank, each with its own
        GPU). A communicator's first call on CUDA tensors does it otherwise, but not inside a
        CUDA graph capture: bind first, or run one call eagerly."""
        torch = torch_module("bind_device takes a CUDA device through torch")
        index = torch.device(device).index if not isinstance(device, int) else device
        if index is None:
            index = torch.cuda.current_device()
        handle = self._live()
        self._call(self._lib.r2cclCommBindDevice(handle, int(index)), "CommBindDevice", handle)
        self._device = index

    # ---- point to point

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        checked(tensor, "tensor")
        self._run(
            self._lib.r2cclSend, "Send", tensor, _ptr(tensor), tensor.numel(),
            dtype_code(tensor.dtype, "tensor"), int(peer),
        )

    def recv(self, tensor: torch.Tensor, peer: int) -> torch.Tensor:
        checked(tensor, "tensor")
        self._run(
            self._lib.r2cclRecv, "Recv", tensor, _ptr(tensor), tensor.numel(),
            dtype_code(tensor.dtype, "tensor"), int(peer),
        )
        return tensor

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        """Sends and receives inside run together when the block ends (r2cclGroupStart/End), so
        that both directions of an exchange are posted before either waits. Tensors must stay
        alive until then."""
        self._call(self._lib.r2cclGroupStart(), "GroupStart", None)
        try:
            yield
        finally:
            self._call(self._lib.r2cclGroupEnd(), "GroupEnd", self._handle)

    # ---- the communicator itself

    def split(self, color: int, key: int | None = None) -> Communicator | None:
        """Ranks with the same color form a new communicator ordered by (key, rank); a negative
        color joins none (None). Every rank calls it."""
        handle = self._live()
        out = ctypes.c_void_p()
        self._call(
            self._lib.r2cclCommSplit(handle, int(color), self.rank if key is None else int(key), ctypes.byref(out), None),
            "CommSplit",
            handle,
        )
        if not out.value:
            return None
        made = Communicator.__new__(Communicator)
        made._lib, made._handle, made._lock = self._lib, out.value, threading.Lock()
        made._device = None
        made.rank = made._query(self._lib.r2cclCommUserRank, "CommUserRank")
        made.world_size = made._query(self._lib.r2cclCommCount, "CommCount")
        return made

    def register(self, tensor: torch.Tensor) -> int:
        """Registers a tensor used again and again (ncclCommRegister); returns its handle."""
        checked(tensor, "tensor")
        out = ctypes.c_void_p()
        handle = self._live()
        self._call(
            self._lib.r2cclCommRegister(handle, _ptr(tensor), tensor.numel() * tensor.element_size(), ctypes.byref(out)),
            "CommRegister",
            handle,
        )
        return out.value or 0

    def deregister(self, registration: int) -> None:
        handle = self._live()
        self._call(self._lib.r2cclCommDeregister(handle, ctypes.c_void_p(registration)), "CommDeregister", handle)

    def invalidate_cache(self, tensor: torch.Tensor) -> None:
        """Drops the registrations the communicator keeps for the tensor's memory (host tensors
        over 64 KiB passed to calls keep theirs, R2CCL_REG_CACHE). Needed only with
        R2CCL_REG_CACHE=on under verbs, before the memory is freed; harmless otherwise."""
        checked(tensor, "tensor")
        handle = self._live()
        self._call(
            self._lib.r2cclCommInvalidateCache(handle, _ptr(tensor), tensor.numel() * tensor.element_size()),
            "CommInvalidateCache",
            handle,
        )

    def async_error(self) -> R2cclError | None:
        """The first asynchronous error (a peer left, no rail survived, an abort), or None."""
        handle = self._live()
        code = ctypes.c_int(0)
        self._call(self._lib.r2cclCommGetAsyncError(handle, ctypes.byref(code)), "CommGetAsyncError", handle)
        if code.value == _lib.SUCCESS:
            return None
        text = (self._lib.r2cclGetLastError(handle) or b"").decode(errors="replace")
        return R2cclError(f"r2ccl: asynchronous error: {text}", code.value)

    def abort(self) -> None:
        """Fails what is in flight (from any thread) and frees the communicator."""
        with self._lock:
            handle, self._handle = self._handle, None
        if handle is not None:
            self._call(self._lib.r2cclCommAbort(handle), "CommAbort", None)

    def close(self) -> None:
        """Frees the communicator; later calls raise R2cclError. Closing twice is harmless."""
        with self._lock:
            handle, self._handle = self._handle, None
        if handle is not None:
            self._call(self._lib.r2cclCommDestroy(handle), "CommDestroy", None)

    @property
    def closed(self) -> bool:
        return self._handle is None

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"rank {self.rank} of {self.world_size}"
        return f"<r2ccl.Communicator {state}>"

