"""Run small fits with OpenBLAS on one thread.

scipy's L-BFGS-B calls BLAS on 5-vectors thousands of times; with OpenBLAS's thread pool on a machine
whose cores are busy (a sweep training next door, CI), each call can wait on sleeping worker threads and a
fit gets ~50x slower (measured: 0.65 s instead of 0.013 s per start). One thread is always fastest at these
sizes. ``threadpoolctl`` does this in general but is not a dependency, so this module calls the
``*openblas_set_num_threads*`` entry points of the OpenBLAS libraries already loaded (found through
/proc/self/maps on Linux) and restores their previous counts afterwards. Anywhere that fails it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import re
from collections.abc import Callable, Iterator
from functools import cache
from typing import TypeVar

_SUFFIXES = ("", "64_", "_64_")
F = TypeVar("F", bound=Callable)


@cache
def _openblas_controls() -> tuple[tuple[object, object], ...]:
    """(get, set) ctypes functions of every loaded OpenBLAS; cached per process after the first fit."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted(set(re.findall(r"(/\S*openblas\S*\.so\S*)", f.read())))
    except OSError:
        return ()
    controls = []
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix in ("scipy_openblas_", "openblas_"):
            found = None
            for sfx in _SUFFIXES:
                get = getattr(lib, f"{prefix}get_num_threads{sfx}", None)
                set_ = getattr(lib, f"{prefix}set_num_threads{sfx}", None)
                if get is not None and set_ is not None:
                    get.restype, get.argtypes = ctypes.c_int, []
                    set_.restype, set_.argtypes = None, [ctypes.c_int]
                    found = (get, set_)
                    break
            if found:
                controls.append(found)
                break
    return tuple(controls)


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Limit every loaded OpenBLAS to one thread inside the block (no-op where that is not possible)."""
    saved = []
    for get, set_ in _openblas_controls():
        try:
            saved.append((set_, int(get())))
            set_(1)
        except Exception:  # noqa: BLE001 - a foreign library; never let thread tuning break a fit
            continue
    try:
        yield
    finally:
        for set_, n in saved:
            with contextlib.suppress(Exception):
                set_(n)


def single_threaded(fn: F) -> F:
    """Decorator form of ``single_thread``."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with single_thread():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
