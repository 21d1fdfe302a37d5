"""What a tensor must be before its memory is handed to libr2ccl.so."""

from __future__ import annotations

import torch

from . import _lib


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def movable(t: torch.Tensor) -> bool:
    """Whether r2ccl can move `t` at all (its device and dtype); the engines' plugins leave the
    others to the engine's own path."""
    return t.device.type == "cpu" and _dtype_name(t.dtype) in _lib.DTYPES


def dtype_code(dtype: torch.dtype, what: str) -> int:
    name = _dtype_name(dtype)
    if name not in _lib.DTYPES:
        raise TypeError(
            f"r2ccl: {what} has dtype {dtype}, which r2ccl does not move "
            f"(supported: {', '.join('torch.' + n for n in _lib.DTYPES)})"
        )
    return _lib.DTYPES[name]


def checked(t: object, what: str) -> torch.Tensor:
    """`t` as a tensor r2ccl can use: a torch.Tensor in host memory, contiguous, of a supported
    dtype. Anything else raises TypeError or ValueError naming `what` and what was wrong."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"r2ccl: {what} must be a torch.Tensor, not {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(
            f"r2ccl: {what} is on {t.device}; this build of r2ccl moves host (CPU) tensors only"
        )
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


def numel_is(t: torch.Tensor, n: int, what: str, why: str) -> None:
    if t.numel() != n:
        raise ValueError(f"r2ccl: {what} has {t.numel()} elements; {why} needs {n}")
