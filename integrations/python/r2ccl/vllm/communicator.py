"""The CPU device communicator vLLM builds for its tensor-parallel group when R2CCL_VLLM=1."""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup
from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

from .ops import R2cclOps


class R2cclCpuCommunicator(R2cclOps, CpuCommunicator):
    """vLLM's CpuCommunicator, with the tensor-parallel collectives and send/recv over r2ccl (its
    other paths, such as send_tensor_dict, stay vLLM's)."""

    def __init__(
        self,
        cpu_group: ProcessGroup,
        device: torch.device | None = None,
        device_group: ProcessGroup | None = None,
        unique_name: str = "",
        use_all2all: bool = False,
    ):
        super().__init__(cpu_group, device, device_group, unique_name, use_all2all=use_all2all)
        self._start_r2ccl()
