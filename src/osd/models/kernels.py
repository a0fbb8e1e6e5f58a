"""Our compiled CPU kernels (rows_linear.cpp), built on first use and cached; optional.

`rows_linear()` / `rows_linear_int8()` return the compiled functions, or None where they cannot be had (no
C++ compiler or ninja, a CPU without AVX2, or OSD_NO_KERNELS=1): callers then fall back to torch's own
kernels, which give the same results up to float rounding, only slower. The build (~45 s) happens once per machine and torch
version, in torch's extension cache (~/.cache/torch_extensions); scripts/setup.sh triggers it.
"""
from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

MAX_ROWS = 8  # rows_linear handles 1..MAX_ROWS rows
MAX_ROWS_INT8 = 4  # rows_linear_int8 handles 1..MAX_ROWS_INT8 rows

_lock = threading.Lock()
_state: dict = {}


def cpu_has_avx2() -> bool:
    import torch

    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _module():
    with _lock:
        if "module" not in _state:
            _state["module"], _state["error"] = _build()
        return _state["module"]


def rows_linear():
    """The compiled `rows_linear(x (M, K) f32, w (N, K) f32, bias (N,) | None) -> (M, N)`, or None."""
    module = _module()
    return module.rows_linear if module is not None else None


def rows_linear_int8():
    """The compiled `rows_linear_int8(x (M, K) f32, w (N, K) int8, scale (N,) f32, bias | None) -> (M, N)`, or None."""
    module = _module()
    return module.rows_linear_int8 if module is not None else None


def build_error() -> str | None:
    """Why the kernel is unavailable (after rows_linear() returned None)."""
    return _state.get("error")


def _build():
    if os.environ.get("OSD_NO_KERNELS"):
        return None, "disabled by OSD_NO_KERNELS"
    if not cpu_has_avx2():
        return None, "this CPU has no AVX2"
    try:
        from torch.utils.cpp_extension import load

        source = Path(__file__).with_name("rows_linear.cpp")
        print("[osd] loading the rows_linear CPU kernels (compiled once per machine, ~45 s) ...", file=sys.stderr, flush=True)
        module = load("osd_rows_linear", [str(source)], extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
                      extra_ldflags=["-fopenmp"], verbose=False)
        return module, None
    except Exception as e:  # no compiler / ninja / headers: torch's kernels serve instead
        print(f"[osd] rows_linear kernel unavailable ({type(e).__name__}: {e}); using torch's kernels", file=sys.stderr)
        return None, f"{type(e).__name__}: {e}"
