"""vLLM platforms that are vLLM's own, but for the communicator (named `platforms` so as not to
shadow the standard library's `platform` in vLLM's spawned workers)."""

from __future__ import annotations

from vllm.platforms.cpu import CpuPlatform

CPU_COMMUNICATOR = "r2ccl.vllm.communicator.R2cclCpuCommunicator"
CUDA_COMMUNICATOR = "r2ccl.vllm.cuda_communicator.R2cclCudaCommunicator"


class R2cclCpuPlatform(CpuPlatform):
    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return CPU_COMMUNICATOR

    @classmethod
    def use_custom_op_collectives(cls) -> bool:
        # Collectives go through vLLM's opaque custom ops, so torch.compile never traces into
        # the ctypes calls; r2ccl's collectives are out of place, as those ops require.
        return True


def _cuda_platform() -> type:
    from vllm.platforms.cuda import CudaPlatform

    class R2cclCudaPlatform(CudaPlatform):
        @classmethod
        def get_device_communicator_cls(cls) -> str:
            return CUDA_COMMUNICATOR

    R2cclCudaPlatform.__module__ = __name__
    R2cclCudaPlatform.__qualname__ = "R2cclCudaPlatform"
    return R2cclCudaPlatform


def __getattr__(name: str) -> type:
    # CudaPlatform is imported only where vLLM picks it: importing it on a CPU build would fail.
    if name == "R2cclCudaPlatform":
        cls = _cuda_platform()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
