"""The entry points vLLM loads in every process it starts (pyproject.toml). Both import nothing
heavy and do nothing unless R2CCL_VLLM=1."""

from __future__ import annotations

import os


def enabled() -> bool:
    return os.environ.get("R2CCL_VLLM", "0") == "1"


def platform() -> str | None:
    """vllm.platform_plugins: the platform vLLM would pick by itself (CUDA or CPU), with r2ccl's
    communicator; None (vLLM's own choice stands) when not enabled or on other platforms."""
    if not enabled():
        return None
    from vllm.platforms import cpu_platform_plugin, cuda_platform_plugin

    if cuda_platform_plugin() is not None:
        return "r2ccl.vllm.platforms.R2cclCudaPlatform"
    if cpu_platform_plugin() is not None:
        return "r2ccl.vllm.platforms.R2cclCpuPlatform"
    return None


def register() -> None:
    """vllm.general_plugins: with VLLM_TARGET_DEVICE=cpu vLLM loads no platform plugin, so
    CpuPlatform's communicator and custom-op choice are rebound here, at run time."""
    if not enabled() or os.environ.get("VLLM_TARGET_DEVICE") != "cpu":
        return
    from vllm.platforms.cpu import CpuPlatform

    from .platforms import R2cclCpuPlatform

    CpuPlatform.get_device_communicator_cls = R2cclCpuPlatform.get_device_communicator_cls
    CpuPlatform.use_custom_op_collectives = R2cclCpuPlatform.use_custom_op_collectives
