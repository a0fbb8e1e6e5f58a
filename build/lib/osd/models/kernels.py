"""Our compiled CPU kernels (rows_linear.cpp): row-invariant linears (fp32, int8 weights), attention and SiLU.

Built on first use (~45 s, once per machine and torch version, in torch's extension cache; scripts/setup.sh
triggers it). They are what makes greedy output independent of how many rows a step verifies (see the
contract at the top of rows_linear.cpp), and the int8 draft's accuracy: a missing kernel is therefore an
error, `KernelUnavailable`, naming the build error and the fix. Only a caller that explicitly allows the
fallback (`ModelConfig.allow_kernel_fallback`, `--allow-kernel-fallback`) gets None and uses torch's kernels
instead; `status()` then says so, for the server's metrics. With the fallback, a position's logits may differ
in the last bits with the number of rows verified together, and torch's dynamic int8 draft accepts fewer
tokens. OSD_NO_KERNELS=1 skips the build (to test the fallback).
"""
from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

from osd.errors import KernelUnavailable

_lock = threading.Lock()
_state: dict = {}
_fallbacks: set[str] = set()  # what ran on torch's kernels instead of ours (allowed fallbacks only)

FIX = ("install a C++ compiler and ninja (`apt-get install g++ ninja-build` or `pip install ninja`; scripts/setup.sh "
       "builds the kernels), or allow torch's kernels with --allow-kernel-fallback (ModelConfig.allow_kernel_fallback): "
       "slower, greedy output no longer independent of the number of rows verified, and the int8 draft accepts fewer tokens")


def cpu_has_avx2() -> bool:
    import torch

    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def load(allow_fallback: bool = False, use: str = "kernels"):
    """The compiled module. Where it cannot be built: KernelUnavailable, or None if `allow_fallback`
    (then `use`, what runs on torch's kernels instead, is recorded for status())."""
    with _lock:
        _ensure_built()
        if _state["module"] is None:
            if not allow_fallback:
                raise KernelUnavailable(f"osd's compiled CPU kernels are unavailable ({_state['error']}); {FIX}")
            _fallbacks.add(use)
        return _state["module"]


def rows_linear(allow_fallback: bool = False, use: str = "fp32 linears"):
    """The compiled `rows_linear(x (M, K) f32, w (N, K) f32, bias (N,) | None) -> (M, N)` (see load())."""
    module = load(allow_fallback, use)
    return module.rows_linear if module is not None else None


def rows_linear_int8(allow_fallback: bool = False, use: str = "int8 linears"):
    """The compiled `rows_linear_int8(x (M, K) f32, w (N, K) int8, scale (N,) f32, bias | None) -> (M, N)`."""
    module = load(allow_fallback, use)
    return module.rows_linear_int8 if module is not None else None


def vnni_available() -> bool:
    """Whether the int8 x int8 AVX-512 VNNI path of rows_linear_int8 runs here (cpuinfo flags and the CPU's own
    answer; False without the compiled kernels)."""
    flags = cpu_flags()
    if not {"avx512f", "avx512vl", "avx512bw", "avx512_vnni"} <= flags:
        return False
    with _lock:
        _ensure_built()
    return _state["module"] is not None and bool(_state["module"].has_vnni())


def status() -> dict:
    """For metrics: {"compiled": bool | None (not tried yet), "error": str | None, "fallback": [uses], "avx512_vnni": bool}.
    A non-empty "fallback" means some model runs on torch's kernels because a fallback was allowed."""
    return {"compiled": None if "module" not in _state else _state["module"] is not None, "error": _state.get("error"),
            "fallback": sorted(_fallbacks), "avx512_vnni": "avx512_vnni" in cpu_flags()}


def _reset_for_tests() -> None:
    with _lock:
        _state.clear()
        _fallbacks.clear()


def _ensure_built() -> None:
    if "module" not in _state:
        _state["module"], _state["error"] = _build()


STALE_LOCK_SECONDS = 900.0  # a build takes ~1 min; a lock this old belongs to a build that was killed


def clear_stale_lock(build_dir: Path, max_age_s: float = STALE_LOCK_SECONDS) -> bool:
    """torch's build lock is a bare file with no owner: a build killed midway leaves it, and every later load of that
    extension waits on it forever. Remove a lock older than any build takes, and say so. -> whether one was removed."""
    lock = Path(build_dir) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < max_age_s:
        return False
    lock.unlink(missing_ok=True)
    print(f"[osd] removed a stale build lock ({age / 60:.0f} min old, left by a killed build): {lock}", file=sys.stderr,
          flush=True)
    return True


def compile_extension(name: str, source: str, what: str, minutes: str, cflags: list[str]):
    """Build (once per machine, cached by torch) one of osd's C++ files next to this module, with OpenMP.

    -> (module, None), or (None, why) where it cannot be had (OSD_NO_KERNELS, no AVX2, no compiler / ninja /
    headers); the caller decides what that means (an error, or an allowed fallback).
    """
    if os.environ.get("OSD_NO_KERNELS"):
        return None, "disabled by OSD_NO_KERNELS"
    if not cpu_has_avx2():
        return None, "this CPU has no AVX2"
    try:
        from torch.utils import cpp_extension
        from torch.utils.cpp_extension import load as load_extension

        build_directory = getattr(cpp_extension, "_get_build_directory", None)  # where torch keeps `name`'s lock
        if build_directory is not None:
            clear_stale_lock(Path(build_directory(name, False)))
        print(f"[osd] loading {what} (compiled once per machine, {minutes}) ...", file=sys.stderr, flush=True)
        # -fopenmp: at::parallel_for splits work across threads only when compiled with OpenMP
        module = load_extension(name, [str(Path(__file__).with_name(source))], verbose=False,
                                extra_cflags=["-O3", *cflags, "-fopenmp"], extra_ldflags=["-fopenmp"])
        return module, None
    except Exception as e:  # no compiler / ninja / headers
        return None, f"{type(e).__name__}: {e}"


def _build():
    return compile_extension("osd_rows_linear", "rows_linear.cpp", "the rows_linear CPU kernels", "~45 s",
                             ["-mavx2", "-mfma", "-ffp-contract=off"])
