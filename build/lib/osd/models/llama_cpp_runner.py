"""The quantized target backend: a GGUF served by llama.cpp (llama-cpp-python's low-level API).

Same interface as the torch runner (models/cached.py): `feed(tokens, n_logits) -> (n_logits, V)` float32
logits for the last positions, `rollback(length)`, `reset()`, `length`. One `llama_decode` verifies the
pending token plus k proposals with logits at every proposed position; rollback removes the sequence's
positions past `length` from llama.cpp's KV cache (llama_memory_seq_rm), so no prefix is re-encoded.

Greedy identity by construction: a position's logits must not depend on how many rows were verified
with it, or a near-tie could flip with the k the policy chose. llama.cpp switches kernels by batch size:
the "extra buffer types" repack Q4_K weights for a GEMM over groups of 4 rows (a GEMV for the rest), and
its tiled K-quant matmul takes over at 8 rows; each sums in another order. Measured bitwise on the bundled
target and tested on a tiny one (tests/models/test_llama_cpp_runner.py): with repacking (fastest decode)
1..3 rows give identical logits per row, without it 1..7. `max_rows` says which; the engine never
verifies more rows than that in one step, so target-only (1 row) and speculative steps agree bitwise.

Limitations: one sequence (the scheduler serves one request at a time on it: models/slots.py), CPU only, logits are
copied out per verified position.
"""
from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import numpy as np
import torch

from osd.errors import BackendUnavailable, ContextTooLong, ModelNotFound

INSTALL_HINT = ('pip install llama-cpp-python==0.3.36 (built from source; scripts/setup.sh does it with portable '
                'flags: CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF")')

_init_lock = threading.Lock()
_initialised = False


def llama_cpp_lib():
    """The low-level `llama_cpp` module, initialised once; a clear error where it is not installed."""
    global _initialised
    try:
        import llama_cpp
    except ImportError as e:
        raise BackendUnavailable(f"the llama.cpp target backend needs llama-cpp-python, which is not installed "
                                 f"({e}).\nInstall it with: {INSTALL_HINT}\nor choose --target-backend torch") from e
    with _init_lock:
        if not _initialised:
            if not os.environ.get("OSD_LLAMA_LOG"):
                llama_cpp.llama_log_set(_silent_log, ctypes.c_void_p(0))
            llama_cpp.llama_backend_init()
            _initialised = True
    return llama_cpp


def build_info() -> str:
    """llama.cpp's own account of the CPU features it was compiled for (e.g. "AVX2 = 1 | AVX512 = 0 ...")."""
    return llama_cpp_lib().llama_print_system_info().decode(errors="replace").strip()


def _quiet(level, text, user_data):  # llama.cpp's logger: keep stderr clean (OSD_LLAMA_LOG=1 shows it)
    return None


try:
    import llama_cpp as _lc

    _silent_log = _lc.llama_log_callback(_quiet)
except ImportError:  # the error is raised, with its hint, when the backend is asked for
    _silent_log = None


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


def release_file_pages(path: Path) -> int:
    """Drop this process's resident pages of the mapped GGUF; returns the bytes of mapping advised.

    With repacking, llama.cpp copies the Q4_K matrices into its own buffers after reading them from the mapped
    file, and the file's pages stay resident (~0.6 GB for the 1.5B) though they are never read again. Clean
    file pages: MADV_DONTNEED only unmaps them; the tensors still served from the mapping (embeddings, head)
    fault back in on their next use. Linux only; a no-op elsewhere or when the mapping cannot be found.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return 0
    target, advised = str(path.resolve()), 0
    for line in maps:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == target:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 4) == 0:  # 4 = MADV_DONTNEED
                advised += end - start
    return advised


IDENTITY_NOTE = ("greedy identity on the llama.cpp backend is best-effort: its safe row counts (3 / 7) were measured on a "
                 "tiny model at context 100, and on the bundled target (AVX-512 build, Intel Xeon) osd's speculative "
                 "output differed from its own target-only output on 1 of 24 prompts "
                 "(benchmarks/bench-speed-v2-learned-llama512.json); osd's Q4 kernel (--target-backend osd) is exact")


class LlamaCppRunner:
    """A GGUF causal LM on llama.cpp, holding the KV cache of one sequence."""

    def __init__(self, gguf_path: str | Path, n_ctx: int = 4096, threads: int = 0, n_batch: int = 512,
                 repack: bool = True):
        lib = self.lib = llama_cpp_lib()
        path = Path(gguf_path)
        if not path.is_file():
            raise ModelNotFound(f"GGUF file not found: {path}")
        self.path, self.threads = path, threads or default_threads()
        mparams = lib.llama_model_default_params()
        mparams.use_extra_bufts = repack  # repacked Q4_K: faster decode, batch-invariant up to 3 rows only
        self.max_rows = 3 if repack else 7  # rows per feed whose logits are bitwise those of 1-row feeds
        self.greedy_identity = "best-effort"  # IDENTITY_NOTE: measured, not guaranteed
        self._model = lib.llama_model_load_from_file(str(path).encode(), mparams)
        if not self._model:
            raise ModelNotFound(f"llama.cpp could not load {path} (not a GGUF model it supports? OSD_LLAMA_LOG=1 shows "
                                "llama.cpp's reason)")
        self.context_window = min(int(n_ctx), int(lib.llama_model_n_ctx_train(self._model)) or int(n_ctx))
        self.n_batch = min(int(n_batch), self.context_window)
        cparams = lib.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = self.context_window, self.n_batch, self.n_batch
        cparams.n_threads = cparams.n_threads_batch = self.threads
        cparams.no_perf = True
        self._ctx = lib.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            lib.llama_model_free(self._model)
            raise ModelNotFound(f"llama.cpp could not create a context for {path} (n_ctx={self.context_window})")
        self._memory = lib.llama_get_memory(self._ctx)
        vocab = lib.llama_model_get_vocab(self._model)
        self.vocab_size = int(lib.llama_vocab_n_tokens(vocab))
        self.eos_ids = {int(t) for t in (lib.llama_vocab_eos(vocab), lib.llama_vocab_eot(vocab)) if t >= 0}
        self.n_params = int(lib.llama_model_n_params(self._model))
        self._batch = lib.llama_batch_init(self.n_batch, 0, 1)
        self.length = 0  # tokens whose keys/values are in the cache
        if repack:
            release_file_pages(path)


    def reset(self) -> None:
        self.lib.llama_memory_clear(self._memory, True)
        self.length = 0

    @torch.inference_mode()
    def feed(self, token_ids: list[int], n_logits: int = 1) -> torch.Tensor:
        """Append tokens to the cache; return float32 logits (n_logits, V) for the last positions."""
        if self.length + len(token_ids) > self.context_window:
            raise ContextTooLong(f"{self.length + len(token_ids)} tokens exceed the llama.cpp context of "
                                 f"{self.context_window}")
        n_logits = min(n_logits, len(token_ids))
        first_logit = len(token_ids) - n_logits
        rows = []
        for start in range(0, len(token_ids), self.n_batch):
            chunk = token_ids[start : start + self.n_batch]
            want = [start + i >= first_logit for i in range(len(chunk))]
            self._decode(chunk, want)
            rows += [self._logits(i) for i, w in enumerate(want) if w]
        return torch.from_numpy(np.stack(rows)) if rows else torch.empty(0, self.vocab_size)  # (n_logits, V)

    def rollback(self, length: int) -> None:
        """Keep only the first `length` cached tokens."""
        if length < self.length:
            if not self.lib.llama_memory_seq_rm(self._memory, 0, length, -1):
                raise RuntimeError(f"llama.cpp could not remove positions >= {length} from the KV cache")
            self.length = length

    def _decode(self, chunk: list[int], want_logits: list[bool]) -> None:
        batch = self._batch
        batch.n_tokens = len(chunk)
        for i, (token, want) in enumerate(zip(chunk, want_logits)):
            batch.token[i] = token
            batch.pos[i] = self.length + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = want
        status = self.lib.llama_decode(self._ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status} (batch of {len(chunk)} at {self.length})")
        self.length += len(chunk)

    def _logits(self, i: int) -> np.ndarray:
        ptr = self.lib.llama_get_logits_ith(self._ctx, i)
        return np.ctypeslib.as_array(ptr, shape=(self.vocab_size,)).copy()  # (V,)

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            self.lib.llama_batch_free(self._batch)
            self.lib.llama_free(self._ctx)
            self.lib.llama_model_free(self._model)
            self._ctx = self._model = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
