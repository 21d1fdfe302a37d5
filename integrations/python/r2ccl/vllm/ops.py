"""vLLM's DeviceCommunicatorBase operations over an r2ccl.Communicator, shared by the CPU and the
CUDA communicator. Every collective is out of place and never writes its input, as vLLM's custom
ops require under torch.compile. Tensors r2ccl cannot move here (on a device this build does not
serve, or of a dtype it does not reduce) take the vLLM class's own path."""

from __future__ import annotations

import logging

import torch

from .. import _lib
from .._tensors import agree_on_cuda, engine_nccl_takes, movable
from ..communicator import Communicator

# Under "vllm", so that vLLM's logging configuration shows it.
logger = logging.getLogger("vllm.r2ccl")


class R2cclOps:
    """Mixed in before a vLLM communicator class; needs its cpu_group, world_size,
    rank_in_group and unique_name."""

    r2ccl: Communicator | None = None
    # True where the engine's class has an NCCL communicator of its own for the group and r2ccl's
    # GPU side was made without one: what only NCCL would have carried goes the engine's way.
    engine_nccl: bool = False

    def _start_r2ccl(self, device: torch.device | None = None, engine_nccl: bool = False) -> None:
        """`device`: the GPU whose CUDA tensors r2ccl moves (its GPU side set up now, before
        vLLM captures CUDA graphs); None for host tensors only. On a GPU r2ccl stays out where
        some rank's libr2ccl has no CUDA (it would carry nothing of the group's). `engine_nccl`:
        the engine's class has an NCCL communicator for the group; then, unless R2CCL_GPU_NCCL is
        set, r2ccl opens no second one (about 770 MiB of GPU memory per GPU), and device point to
        point and all-reduces from 64 MiB (ENGINE_NCCL_FROM) take the engine's path."""
        # The tensor-parallel group's collectives are the ones r2ccl carries; vLLM's other groups
        # keep their communicator.
        self.r2ccl = None
        self.engine_nccl = False
        if self.world_size > 1 and self.unique_name.startswith("tp"):
            cuda, self.engine_nccl = agree_on_cuda(device is not None, engine_nccl, self.cpu_group)
            if device is not None and not cuda:
                logger.warning(
                    "r2ccl: %s stays on vLLM's communicator: libr2ccl (here %s, CUDA %s) has no "
                    "CUDA on every rank, so it could carry none of the group's CUDA tensors",
                    self.unique_name, _lib.library().path, _lib.library().cuda,
                )
                return
            self.r2ccl = Communicator(
                self.cpu_group, device=device, own_nccl=False if self.engine_nccl else None
            )
            logger.info(
                "r2ccl: %s is rank %d of %d over libr2ccl %s%s",
                self.unique_name, self.r2ccl.rank, self.r2ccl.world_size, _lib.library().path,
                "; device point to point and all-reduces from 64 MiB take vLLM's NCCL"
                if self.engine_nccl else "",
            )

    def _takes(self, *tensors: torch.Tensor) -> bool:
        return self.r2ccl is not None and all(movable(t) for t in tensors)

    def _takes_p2p(self, *tensors: torch.Tensor) -> bool:
        """Point to point: r2ccl's where it has NCCL for device memory or the tensors are host
        memory."""
        return self._takes(*tensors) and not (
            self.engine_nccl and any(t.is_cuda for t in tensors)
        )

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        if not self._takes(input_) or (self.engine_nccl and engine_nccl_takes(input_)):
            return super().all_reduce(input_)
        return self.r2ccl.all_reduce(input_.contiguous())

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if not self._takes(input_):
            return super().all_gather(input_, dim)
        if dim < 0:
            dim += input_.dim()
        size = input_.size()
        out = self.r2ccl.all_gather(input_.contiguous().reshape(-1))
        # Rank-major blocks, moved into dimension `dim` (vLLM's concat-style all-gather).
        out = out.reshape((self.world_size,) + size).movedim(0, dim)
        return out.reshape(size[:dim] + (self.world_size * size[dim],) + size[dim + 1 :])

    def all_gatherv(
        self,
        input_: torch.Tensor | list[torch.Tensor],
        dim: int = 0,
        sizes: list[int] | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        inputs = [input_] if isinstance(input_, torch.Tensor) else list(input_)
        if not self._takes(*inputs):
            return super().all_gatherv(input_, dim, sizes)
        if dim != 0:
            raise NotImplementedError("r2ccl: only dim 0 all_gatherv is supported")
        outs = [self._all_gatherv_one(t.contiguous(), sizes) for t in inputs]
        return outs[0] if isinstance(input_, torch.Tensor) else outs

    def _all_gatherv_one(self, t: torch.Tensor, sizes: list[int] | None) -> torch.Tensor:
        if sizes is None:
            return self.r2ccl.all_gather(t)
        if len(sizes) != self.world_size or t.shape[0] != sizes[self.rank_in_group]:
            raise ValueError(
                f"r2ccl: all_gatherv sizes {sizes} do not fit {self.world_size} ranks with "
                f"{t.shape[0]} rows on rank {self.rank_in_group}"
            )
        out = torch.empty((sum(sizes),) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        start = 0
        # Each rank's rows broadcast from it, in rank order.
        for root, rows in enumerate(sizes):
            part = out[start : start + rows]
            if root == self.rank_in_group:
                part.copy_(t)
            self.r2ccl.broadcast(part, root)
            start += rows
        return out

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if not self._takes(input_):
            return super().reduce_scatter(input_, dim)
        if dim < 0:
            dim += input_.dim()
        moved = input_.movedim(0, dim).contiguous()
        if moved.shape[0] % self.world_size != 0:
            raise ValueError(
                f"r2ccl: reduce_scatter of {moved.shape[0]} rows over {self.world_size} ranks"
            )
        out = self.r2ccl.reduce_scatter(moved)
        return out.movedim(0, dim).contiguous()

    def reduce_scatterv(
        self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None
    ) -> torch.Tensor:
        if not self._takes(input_):
            return super().reduce_scatterv(input_, dim, sizes)
        if sizes is None or all(s == sizes[0] for s in sizes):
            return self.reduce_scatter(input_, dim)
        if dim < 0:
            dim += input_.dim()
        moved = input_.movedim(0, dim).contiguous()
        if len(sizes) != self.world_size or moved.shape[0] != sum(sizes):
            raise ValueError(
                f"r2ccl: reduce_scatterv sizes {sizes} do not fit {self.world_size} ranks and "
                f"{moved.shape[0]} rows"
            )
        mine = None
        start = 0
        # Each rank's rows reduced to it, in rank order.
        for root, rows in enumerate(sizes):
            part = moved[start : start + rows]
            out = self.r2ccl.reduce(part, op="sum", root=root)
            if root == self.rank_in_group:
                mine = out
            start += rows
        return mine.movedim(0, dim).contiguous()

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        if not self._takes_p2p(input_):
            return super().gather(input_, dst, dim)
        if dim < 0:
            dim += input_.dim()
        t = input_.contiguous()
        if self.rank_in_group != dst:
            self.r2ccl.send(t, dst)
            return None
        parts = []
        for r in range(self.world_size):
            parts.append(t.clone() if r == dst else self.r2ccl.recv(torch.empty_like(t), r))
        return torch.cat(parts, dim=dim)

    def send(self, tensor: torch.Tensor, dst: int | None = None) -> None:
        if not self._takes_p2p(tensor):
            return super().send(tensor, dst)
        if dst is None:
            dst = (self.rank_in_group + 1) % self.world_size
        self.r2ccl.send(tensor.contiguous(), dst)

    def recv(self, size: torch.Size, dtype: torch.dtype, src: int | None = None) -> torch.Tensor:
        tensor = torch.empty(size, dtype=dtype, device=self.device)
        if not self._takes_p2p(tensor):
            return super().recv(size, dtype, src)
        if src is None:
            src = (self.rank_in_group - 1) % self.world_size
        return self.r2ccl.recv(tensor, src)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.world_size == 1 or not self._takes(tensor) or not tensor.is_contiguous():
            return super().broadcast(tensor, src)
        return self.r2ccl.broadcast(tensor, src)

    def batch_isend_irecv(self, p2p_ops: list) -> None:
        if not self._takes_p2p(*[op.tensor for op in p2p_ops]):
            return super().batch_isend_irecv(p2p_ops)
        with self.r2ccl.group():
            for op in p2p_ops:
                if op.op is torch.distributed.isend:
                    self.r2ccl.send(op.tensor, op.group_peer)
                elif op.op is torch.distributed.irecv:
                    self.r2ccl.recv(op.tensor, op.group_peer)
                else:
                    raise ValueError(f"r2ccl: batch_isend_irecv takes isend and irecv, not {op.op}")

    def destroy(self) -> None:
        if self.r2ccl is not None:
            self.r2ccl.close()
            self.r2ccl = None
        super().destroy()
