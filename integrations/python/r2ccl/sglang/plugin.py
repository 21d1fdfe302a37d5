"""The `sglang.srt.plugins` entry point. SGLang calls register() in every process it starts (the
scheduler of each TP rank included) before it builds its process groups; with R2CCL_SGLANG=1 it
installs hooks on GroupCoordinator, so that the tensor-parallel group's all-reduce, all-gather
and reduce-scatter go over r2ccl. SGLang's GroupCoordinator has no communicator
slot: the hooks wrap the methods its collectives and its custom ops (torch.ops.sglang.*) call.
Tensors r2ccl does not take (on a GPU where this libr2ccl has no CUDA; of a dtype it does not
reduce) and every other group keep SGLang's own path."""

from __future__ import annotations

import os

TARGET = "sglang.srt.distributed.parallel_state.GroupCoordinator."


def enabled() -> bool:
    return os.environ.get("R2CCL_SGLANG", "0") == "1"


def register() -> None:
    if not enabled():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from . import hooks

    HookRegistry.register(TARGET + "__init__", hooks.after_init, HookType.AFTER)
    HookRegistry.register(TARGET + "destroy", hooks.before_destroy, HookType.BEFORE)
    for method, hook in hooks.AROUND.items():
        HookRegistry.register(TARGET + method, hook, HookType.AROUND)
