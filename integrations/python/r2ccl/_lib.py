"""ctypes bindings of libr2ccl.so (integrations/c/include/r2ccl.h), loaded the way vLLM's pynccl
loads NCCL: no compiled extension, the C ABI only."""

from __future__ import annotations

import ctypes
import os
import pathlib
import threading

# The ABI these bindings follow: R2CCL_MAJOR.R2CCL_MINOR of r2ccl.h (the SONAME's version).
ABI = (0, 2)
SONAME = f"libr2ccl.so.{ABI[0]}.{ABI[1]}"

# r2cclResult_t
SUCCESS = 0
IN_PROGRESS = 7
RESULT_NAMES = {
    0: "r2cclSuccess",
    1: "r2cclUnhandledError",
    2: "r2cclSystemError",
    3: "r2cclInternalError",
    4: "r2cclInvalidArgument",
    5: "r2cclInvalidUsage",
    6: "r2cclRemoteError",
    7: "r2cclInProgress",
    8: "r2cclTimeout",
    9: "r2cclTryAgain",
}

# r2cclDataType_t and r2cclRedOp_t carry NCCL's numbers.
DTYPES = {
    "uint8": 1,
    "int32": 2,
    "int64": 4,
    "float16": 6,
    "float32": 7,
    "float64": 8,
    "bfloat16": 9,
}
OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}

# r2cclKvState_t
KV_STATES = {0: "pending", 1: "in_flight", 2: "done", 3: "failed", 4: "cancelled"}
KV_MAX_PAYLOAD = 4096


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


class KvPlace(ctypes.Structure):
    _fields_ = [("buffer", ctypes.c_uint32), ("offset", ctypes.c_uint64), ("stride", ctypes.c_uint64)]


# The header the KV structs begin with (r2ccl.h: R2CCL_STRUCT_MAGIC, R2CCL_STRUCT_VERSION).
STRUCT_MAGIC = 0x72326363
STRUCT_VERSION = 1
_HEADER = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint)]


class _Headed(ctypes.Structure):
    """A struct that begins with its size, magic and version, filled in as its C initializer does;
    the other fields follow in the arguments."""

    def __init__(self, *args, **kwargs):
        super().__init__(ctypes.sizeof(type(self)), STRUCT_MAGIC, STRUCT_VERSION, *args, **kwargs)


class KvLayout(_Headed):
    _fields_ = _HEADER + [
        ("layers", ctypes.c_uint32),
        ("blocks", ctypes.c_uint32),
        ("blockBytes", ctypes.c_uint64),
        ("parts", ctypes.c_uint32),
        ("places", ctypes.POINTER(KvPlace)),
    ]


class KvSpan(_Headed):
    _fields_ = _HEADER + [
        ("firstLayer", ctypes.c_uint32),
        ("lastLayer", ctypes.c_uint32),
        ("srcBlocks", ctypes.POINTER(ctypes.c_uint32)),
        ("dstBlocks", ctypes.POINTER(ctypes.c_uint32)),
        ("nblocks", ctypes.c_size_t),
    ]


class KvNotification(_Headed):
    _fields_ = _HEADER + [
        ("request", ctypes.c_uint64),
        ("peer", ctypes.c_int),
        ("state", ctypes.c_int),
        ("verified", ctypes.c_int),
        ("payloadBytes", ctypes.c_size_t),
        ("invalidBlocks", ctypes.c_size_t),
        ("reason", ctypes.c_char * 256),
    ]


_c = ctypes
_res = _c.c_int
_p = _c.c_void_p
_size = _c.c_size_t
_comm = _c.c_void_p
_engine = _c.c_void_p

# name: (restype, argtypes)
_FUNCTIONS = {
    "r2cclGetVersion": (_res, [_c.POINTER(_c.c_int)]),
    "r2cclGetErrorString": (_c.c_char_p, [_res]),
    "r2cclGetLastError": (_c.c_char_p, [_comm]),
    "r2cclGetUniqueId": (_res, [_c.POINTER(UniqueId)]),
    "r2cclCommInitRank": (_res, [_c.POINTER(_comm), _c.c_int, UniqueId, _c.c_int]),
    "r2cclCommInitFromEnv": (_res, [_c.POINTER(_comm)]),
    "r2cclCommSplit": (_res, [_comm, _c.c_int, _c.c_int, _c.POINTER(_comm), _p]),
    "r2cclCommFinalize": (_res, [_comm]),
    "r2cclCommDestroy": (_res, [_comm]),
    "r2cclCommAbort": (_res, [_comm]),
    "r2cclCommGetAsyncError": (_res, [_comm, _c.POINTER(_res)]),
    "r2cclCommCount": (_res, [_comm, _c.POINTER(_c.c_int)]),
    "r2cclCommUserRank": (_res, [_comm, _c.POINTER(_c.c_int)]),
    "r2cclGetCudaSupport": (_res, [_c.POINTER(_c.c_int)]),
    "r2cclCommBindDevice": (_res, [_comm, _c.c_int]),
    "r2cclCommRegister": (_res, [_comm, _p, _size, _c.POINTER(_p)]),
    "r2cclCommDeregister": (_res, [_comm, _p]),
    "r2cclCommInvalidateCache": (_res, [_comm, _p, _size]),
    "r2cclAllReduce": (_res, [_p, _p, _size, _c.c_int, _c.c_int, _comm, _p]),
    "r2cclBroadcast": (_res, [_p, _p, _size, _c.c_int, _c.c_int, _comm, _p]),
    "r2cclReduce": (_res, [_p, _p, _size, _c.c_int, _c.c_int, _c.c_int, _comm, _p]),
    "r2cclAllGather": (_res, [_p, _p, _size, _c.c_int, _comm, _p]),
    "r2cclReduceScatter": (_res, [_p, _p, _size, _c.c_int, _c.c_int, _comm, _p]),
    "r2cclBarrier": (_res, [_comm, _p]),
    "r2cclSend": (_res, [_p, _size, _c.c_int, _c.c_int, _comm, _p]),
    "r2cclRecv": (_res, [_p, _size, _c.c_int, _c.c_int, _comm, _p]),
    "r2cclGroupStart": (_res, []),
    "r2cclGroupEnd": (_res, []),
    "r2cclKvEngineCreate": (_res, [_c.POINTER(_engine), _c.c_char_p]),
    "r2cclKvEngineDestroy": (_res, [_engine]),
    "r2cclKvGetLastError": (_c.c_char_p, [_engine]),
    "r2cclKvRegisterPool": (
        _res,
        [_engine, _c.POINTER(_p), _c.POINTER(_size), _c.c_int, _c.POINTER(KvLayout), _c.POINTER(_c.c_uint32)],
    ),
    "r2cclKvUnregisterPool": (_res, [_engine, _c.c_uint32]),
    "r2cclKvGetMetadata": (_res, [_engine, _p, _c.POINTER(_size)]),
    "r2cclKvLoadRemote": (_res, [_engine, _p, _size, _c.POINTER(_c.c_int)]),
    "r2cclKvDisconnect": (_res, [_engine, _c.c_int]),
    "r2cclKvSubmit": (
        _res,
        [_engine, _c.c_uint64, _c.c_int, _c.c_uint32, _c.c_uint32, _c.POINTER(KvSpan), _size, _p, _size],
    ),
    "r2cclKvBegin": (_res, [_engine, _c.c_uint64, _c.c_int, _c.c_uint32, _c.c_uint32]),
    "r2cclKvAdd": (_res, [_engine, _c.c_uint64, _c.POINTER(KvSpan)]),
    "r2cclKvSeal": (_res, [_engine, _c.c_uint64, _p, _size]),
    "r2cclKvPull": (
        _res,
        [_engine, _c.c_uint64, _c.c_int, _c.c_uint32, _c.c_uint32, _c.POINTER(KvSpan), _size],
    ),
    "r2cclKvPoll": (_res, [_engine, _c.c_uint64, _c.POINTER(_c.c_int)]),
    "r2cclKvWait": (_res, [_engine, _c.c_uint64, _c.c_int, _c.POINTER(_c.c_int)]),
    "r2cclKvCancel": (_res, [_engine, _c.c_uint64]),
    "r2cclKvGetNotification": (
        _res,
        [_engine, _c.POINTER(KvNotification), _p, _size, _c.POINTER(_c.c_int)],
    ),
    "r2cclKvGetInvalidBlocks": (
        _res,
        [_engine, _c.c_int, _c.c_uint64, _c.POINTER(_c.c_uint32), _size, _c.POINTER(_size)],
    ),
}


def _candidates() -> list[str]:
    """Where libr2ccl.so is looked for, in order: R2CCL_LIBRARY, the copy bundled in this package
    (pip install), then the system's loader path."""
    found = []
    if os.environ.get("R2CCL_LIBRARY"):
        found.append(os.environ["R2CCL_LIBRARY"])
    here = pathlib.Path(__file__).resolve().parent
    for d in (here / "lib", here / "lib64"):
        if (d / SONAME).exists():
            found.append(str(d / SONAME))
    found.append(SONAME)
    return found


class Library:
    """libr2ccl.so with every function's prototype declared."""

    def __init__(self) -> None:
        errors = []
        for path in _candidates():
            try:
                self.dll = ctypes.CDLL(path)
                self.path = path
                break
            except OSError as e:
                errors.append(f"{path}: {e}")
        else:
            raise ImportError(
                "r2ccl: libr2ccl.so was not found; tried " + "; ".join(errors)
                + " (set R2CCL_LIBRARY to its path, or pip install r2ccl, which bundles it)"
            )
        for name, (restype, argtypes) in _FUNCTIONS.items():
            fn = getattr(self.dll, name)
            fn.restype = restype
            fn.argtypes = argtypes
            setattr(self, name, fn)
        v = ctypes.c_int(0)
        self.r2cclGetVersion(ctypes.byref(v))
        self.version = (v.value // 10000, v.value // 100 % 100, v.value % 100)
        cuda = ctypes.c_int(0)
        self.r2cclGetCudaSupport(ctypes.byref(cuda))
        # Whether this library moves CUDA tensors (built with CUDA, and a device can be used).
        self.cuda = bool(cuda.value)
        if self.version[:2] != ABI:
            raise ImportError(
                f"r2ccl: {self.path} is version {'.'.join(map(str, self.version))}; these "
                f"bindings need {ABI[0]}.{ABI[1]}.x"
            )


_library: Library | None = None
_library_lock = threading.Lock()


def library() -> Library:
    """The loaded library (loaded on first use, so that importing r2ccl stays cheap; once, whatever
    the threads)."""
    global _library
    if _library is None:
        with _library_lock:
            if _library is None:
                _library = Library()
    return _library
