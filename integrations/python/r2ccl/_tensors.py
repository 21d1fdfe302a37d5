"""What a tensor must be before its memory is handed to libr2ccl.so, and PyTorch itself: imported
on first use (by the first call that takes a tensor), so that r2ccl imports, and its KV engine's
and communicator's calls without tensors work, where torch is not installed."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from . import _lib

if TYPE_CHECKING:
    import torch

_torch = None


def torch_module(needed_by: str):
    """The torch module, imported on first use. Without PyTorch: ModuleNotFoundError (an
    ImportError) that says `needed_by` ("input must be a torch.Tensor", ...), that PyTorch is
    missing and how to install it. A torch that is installed but fails to import raises its own
    error."""
    global _torch
    if _torch is None:
        try:
            import torch
        except ModuleNotFoundError as e:
            if e.name != "torch":
                raise
            raise ModuleNotFoundError(
                f"r2ccl: {needed_by}, but PyTorch (torch) is not installed for {sys.executable}: "
                "install it with `pip install torch` (or install r2ccl with its extra, r2ccl[torch])",
                name="torch",
            ) from None
        _torch = torch
    return _torch


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def on_device(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def movable(t: torch.Tensor) -> bool:
    """Whether r2ccl can move `t` at all (its device and dtype): host tensors, and CUDA tensors
    where libr2ccl was built with CUDA; the engines' plugins leave the others to the engine's own
    path."""
    if _dtype_name(t.dtype) not in _lib.DTYPES:
        return False
    return t.device.type == "cpu" or (on_device(t) and _lib.library().cuda)


# An engine whose class has an NCCL communicator for the group makes r2ccl's without one
# (Communicator(own_nccl=False)); its all-reduces of CUDA tensors from this size then take the
# engine's path, where NCCL is faster than r2ccl's kernels (the size from which r2ccl's own NCCL
# communicator would have taken them).
ENGINE_NCCL_FROM = 64 << 20


def agree_on_cuda(on_cuda: bool, engine_has_nccl: bool, group) -> tuple[bool, bool]:
    """For an engine's communicator of `group` (a CPU process group; every rank calls it), on a
    CUDA device or not (alike on every rank: the engine's platform): whether r2ccl takes the
    group's CUDA tensors (every rank's libr2ccl has CUDA; else r2ccl carries nothing of the
    group's and stays out), and whether it is made without NCCL (own_nccl=False), leaving the
    calls NCCL would have taken to the engine (the engine has an NCCL communicator for the group
    and no rank set R2CCL_GPU_NCCL). Agreed over `group` (the least of every rank's), so that
    every rank sends a call the same way even where their libraries or environments differ.
    Off CUDA: (False, False), with nothing to agree."""
    if not on_cuda:
        return False, False
    torch = torch_module("agree_on_cuda agrees over a process group")
    flags = torch.tensor(
        [1 if _lib.library().cuda else 0, 0 if "R2CCL_GPU_NCCL" in os.environ else 1],
        dtype=torch.int32,
    )
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MIN, group=group)
    cuda = bool(flags[0].item())
    return cuda, cuda and engine_has_nccl and bool(flags[1].item())


def engine_nccl_takes(t: torch.Tensor) -> bool:
    """Whether an all-reduce of `t` is the engine's NCCL's (see ENGINE_NCCL_FROM)."""
    return t.device.type == "cuda" and t.numel() * t.element_size() >= ENGINE_NCCL_FROM


def dtype_code(dtype: torch.dtype, what: str) -> int:
    name = _dtype_name(dtype)
    if name not in _lib.DTYPES:
        raise TypeError(
            f"r2ccl: {what} has dtype {dtype}, which r2ccl does not move "
            f"(supported: {', '.join('torch.' + n for n in _lib.DTYPES)})"
        )
    return _lib.DTYPES[name]


def checked(t: object, what: str) -> torch.Tensor:
    """`t` as a tensor r2ccl can use: a torch.Tensor in host memory (or CUDA memory, where
    libr2ccl has CUDA), contiguous, of a supported dtype. Anything else raises TypeError or
    ValueError naming `what` and what was wrong."""
    torch = _torch or torch_module(f"{what} must be a torch.Tensor (got {type(t).__name__})")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"r2ccl: {what} must be a torch.Tensor, not {type(t).__name__}")
    if on_device(t):
        if not _lib.library().cuda:
            raise ValueError(
                f"r2ccl: {what} is on {t.device}, but {_lib.library().path} moves host (CPU) "
                "tensors only (built without CUDA, or no CUDA device can be used)"
            )
    elif t.device.type != "cpu":
        raise ValueError(f"r2ccl: {what} is on {t.device}; r2ccl moves CPU and CUDA tensors")
    if not t.is_contiguous():
        raise ValueError(
            f"r2ccl: {what} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); "
            "pass tensor.contiguous()"
        )
    dtype_code(t.dtype, what)
    return t


def same_dtype(a: torch.Tensor, b: torch.Tensor, what_a: str, what_b: str) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"r2ccl: {what_b} has dtype {b.dtype} but {what_a} has {a.dtype}")
    if a.device != b.device:
        raise ValueError(f"r2ccl: {what_b} is on {b.device} but {what_a} is on {a.device}")


def stream_of(t: torch.Tensor) -> int | None:
    """The stream a call on `t` is queued on: None (NULL) for host memory, else the current CUDA
    stream of its device (the one a CUDA graph capture records)."""
    if not on_device(t):
        return None
    torch = _torch or torch_module("a CUDA tensor's stream")
    return torch.cuda.current_stream(t.device).cuda_stream


def numel_is(t: torch.Tensor, n: int, what: str, why: str) -> None:
    if t.numel() != n:
        raise ValueError(f"r2ccl: {what} has {t.numel()} elements; {why} needs {n}")
