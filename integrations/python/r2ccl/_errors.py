"""The exception every failed r2ccl call raises, and the checks of what Python hands to C."""

from __future__ import annotations

from collections.abc import Callable

from . import _lib


class R2cclError(RuntimeError):
    """A call into libr2ccl.so failed. `code` is its r2cclResult_t (None for a closed object),
    `code_name` the enumerator's name; the message is the library's own words."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.code_name = _lib.RESULT_NAMES.get(code, "") if code is not None else ""


def raise_for(result: int, what: str, last_error: Callable[[], bytes | None]) -> None:
    """Raises for a failed result; `last_error` (the library's text) is asked only then."""
    if result == _lib.SUCCESS:
        return
    text = (last_error() or b"").decode(errors="replace") or "no detail"
    name = _lib.RESULT_NAMES.get(result, f"result {result}")
    raise R2cclError(f"r2ccl: {what} failed ({name}): {text}", result)
