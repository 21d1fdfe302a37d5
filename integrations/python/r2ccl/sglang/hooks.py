"""The hooks r2ccl's SGLang plugin installs on GroupCoordinator (see plugin.py). Each AROUND hook
takes SGLang's original method first and falls back to it for what r2ccl does not carry."""

from __future__ import annotations

import logging

import torch

from .. import _lib
from .._tensors import agree_on_cuda, engine_nccl_takes, movable
from ..communicator import Communicator

logger = logging.getLogger("sglang.r2ccl")
ATTR = "_r2ccl"
ENGINE_NCCL = "_r2ccl_engine_nccl"


def _comm(self, *tensors: torch.Tensor) -> Communicator | None:
    """The group's r2ccl communicator when it carries these tensors, else None."""
    comm = getattr(self, ATTR, None)
    return comm if comm is not None and all(movable(t) for t in tensors) else None


def _reducer(self, t: torch.Tensor) -> Communicator | None:
    """The communicator for an all-reduce of `t`, else None: also None where the group's NCCL
    communicator (SGLang's pynccl) takes it (see ENGINE_NCCL_FROM)."""
    if getattr(self, ENGINE_NCCL, False) and engine_nccl_takes(t):
        return None
    return _comm(self, t)


def after_init(result, self, *args, **kwargs):
    """The tensor-parallel group gets an r2ccl communicator, bootstrapped over its gloo group; on
    a CUDA device its GPU side is set up there (before SGLang captures CUDA graphs), and where
    some rank's libr2ccl has no CUDA r2ccl stays out (it would carry nothing of the group's).
    Where the group has SGLang's NCCL communicator (pynccl_comm), r2ccl opens none of its own
    unless R2CCL_GPU_NCCL is set (about 770 MiB of GPU memory per GPU), and all-reduces from
    64 MiB stay SGLang's."""
    setattr(self, ATTR, None)
    setattr(self, ENGINE_NCCL, False)
    if self.unique_name.startswith("tp") and self.world_size > 1:
        device = getattr(self, "device", None)
        on_cuda = device is not None and torch.device(device).type == "cuda"
        cuda, engine_nccl = agree_on_cuda(
            on_cuda, getattr(self, "pynccl_comm", None) is not None, self.cpu_group
        )
        if on_cuda and not cuda:
            logger.warning(
                "r2ccl: %s stays on SGLang's communicator: libr2ccl (here %s, CUDA %s) has no "
                "CUDA on every rank, so it could carry none of the group's CUDA tensors",
                self.unique_name, _lib.library().path, _lib.library().cuda,
            )
            return result
        comm = Communicator(
            self.cpu_group, device=device if cuda else None, own_nccl=False if engine_nccl else None
        )
        setattr(self, ATTR, comm)
        setattr(self, ENGINE_NCCL, engine_nccl)
        logger.info("r2ccl: %s is rank %d of %d", self.unique_name, comm.rank, comm.world_size)
    return result


def before_destroy(self, *args, **kwargs):
    comm = getattr(self, ATTR, None)
    if comm is not None:
        comm.close()
        setattr(self, ATTR, None)


def all_reduce(original, self, input_: torch.Tensor) -> torch.Tensor:
    # SGLang reduces host tensors in place and returns its input; so does r2ccl here, outside
    # torch.compile (where SGLang's custom ops below are used instead).
    comm = _reducer(self, input_)
    if comm is None or not input_.is_contiguous() or torch.compiler.is_compiling():
        return original(self, input_)
    return comm.all_reduce(input_, output=input_)


def all_reduce_in_place(original, self, input_: torch.Tensor) -> None:
    comm = _reducer(self, input_)
    if comm is None or not input_.is_contiguous():
        return original(self, input_)
    comm.all_reduce(input_, output=input_)
    return None


def all_reduce_out_place(
    original, self, input_: torch.Tensor, outplace_all_reduce_method: str
) -> torch.Tensor:
    comm = _reducer(self, input_)
    if comm is None:
        return original(self, input_, outplace_all_reduce_method)
    return comm.all_reduce(input_.contiguous())


def all_gather_into_tensor(original, self, output: torch.Tensor, input: torch.Tensor):
    comm = _comm(self, output, input)
    if comm is None or not output.is_contiguous():
        return original(self, output, input)
    comm.all_gather(input.contiguous(), output=output)
    return None


def reduce_scatter_tensor(original, self, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    comm = _comm(self, output, input)
    if comm is None or not output.is_contiguous():
        return original(self, output, input)
    comm.reduce_scatter(input.contiguous(), output=output)
    return output


AROUND = {
    "all_reduce": all_reduce,
    "_all_reduce_in_place": all_reduce_in_place,
    "_all_reduce_out_place": all_reduce_out_place,
    "_all_gather_into_tensor": all_gather_into_tensor,
    "_reduce_scatter_tensor": reduce_scatter_tensor,
}
