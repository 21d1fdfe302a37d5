"""The CUDA device communicator vLLM builds when R2CCL_VLLM=1 on a CUDA platform. It subclasses
vLLM's CudaCommunicator (vLLM's graph_capture asserts that): the tensor-parallel group's host and
CUDA tensors go over r2ccl (on NVLink among the node's GPUs, on the current stream, inside vLLM's
CUDA graphs); the rest takes vLLM's own path, and so does everything where some rank's libr2ccl
has no CUDA. vLLM's class has an NCCL communicator for the group, so r2ccl's GPU side opens none
of its own (unless R2CCL_GPU_NCCL is set): point to point on CUDA tensors and all-reduces from
64 MiB go over vLLM's."""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup
from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

from .ops import R2cclOps


class R2cclCudaCommunicator(R2cclOps, CudaCommunicator):
    def __init__(
        self,
        cpu_group: ProcessGroup,
        device: torch.device | None = None,
        device_group: ProcessGroup | None = None,
        unique_name: str = "",
        global_ranks: list[int] | None = None,
        global_world_size: int | None = None,
        tcp_store_group=None,
        use_all2all: bool = False,
    ):
        super().__init__(
            cpu_group, device, device_group, unique_name, global_ranks, global_world_size,
            tcp_store_group, use_all2all,
        )
        self._start_r2ccl(self.device, engine_nccl=True)
