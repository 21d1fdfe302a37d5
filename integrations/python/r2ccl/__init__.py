"""r2ccl from Python: `Communicator` (collectives and send/recv of torch tensors) and `KvEngine`
(KV-cache blocks between prefill and decode), over libr2ccl.so through ctypes.

The library is loaded on first use: importing r2ccl (as vLLM's plugin loader does in every
process) costs nothing until a communicator or engine is made."""

from ._errors import R2cclError
from .communicator import Communicator, get_unique_id
from .kv import KvEngine, Notification, Span

__all__ = ["Communicator", "KvEngine", "Notification", "R2cclError", "Span", "get_unique_id", "library_version"]



def library_version() -> tuple[int, int, int]:
    """The loaded libr2ccl.so's version (major, minor, patch)."""
    from . import _lib

    return _lib.library().version
