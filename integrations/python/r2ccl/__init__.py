"""r2ccl from Python: `Communicator` (collectives and send/recv of torch tensors) and `KvEngine`
(KV-cache blocks between prefill and decode), over libr2ccl.so through ctypes.

The library is loaded on first use, and torch is imported by the first call that takes a tensor:
importing r2ccl (as vLLM's plugin loader does in every process) costs nothing until a
communicator or engine is made, and needs neither PyTorch nor the library."""

from ._errors import R2cclError
from .communicator import Communicator, get_unique_id
from .kv import KvEngine, Notification, Span

__all__ = ["Communicator", "KvEngine", "Notification", "R2cclError", "Span", "get_unique_id", "library_version"]



def library_version() -> tuple[int, int, int]:
    """The loaded libr2ccl.so's version (major, minor, patch)."""
    from . import _lib

    return _lib.library().version


def _package_version() -> str:
    """This package's version, from the one place that sets it, CMakeLists.txt's
    `project(r2ccl VERSION ...)`: installed, the metadata pip wrote from it (scikit-build-core reads
    the same line); from the source tree, that line itself; else the loaded library's version."""
    import importlib.metadata
    import pathlib
    import re

    here = pathlib.Path(__file__).resolve().parent
    try:
        dist = importlib.metadata.distribution("r2ccl")
    except importlib.metadata.PackageNotFoundError:
        dist = None
    # The metadata counts only where it describes this copy of the package (not an installed
    # r2ccl that a source tree on sys.path shadows).
    if dist is not None and pathlib.Path(dist.locate_file("r2ccl")).resolve() == here:
        return dist.version
    cmake = here.parents[2] / "CMakeLists.txt"
    if cmake.is_file():
        found = re.search(r"project\(r2ccl VERSION (?P<value>[0-9.]+)", cmake.read_text())
        if found:
            return found["value"]
    return ".".join(map(str, library_version()))


def __getattr__(name: str) -> str:
    # __version__ is worked out on first use, so that importing r2ccl reads no metadata.
    if name == "__version__":
        global __version__
        __version__ = _package_version()
        return __version__
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
