"""--draft-quantize auto: the draft's serving copy chosen by timing the candidates on this machine.

A draft that osd's Q4 kernel runs (models/q4_draft.py `qualifies`: qwen2, llama, qwen3, gemma3) has two fast serving
copies (models/serving_draft.py): int8 (on the glue runner for a Qwen2, transformers' forward otherwise) and 4-bit on
the Q4 kernel (models/q4_draft.py). Which one costs less a draft token depends on the draft and on the
CPU: on the Intel machine the shipped cheap draft's Q4 copy cost c = 0.023 target tokens against 0.051 for int8, the
whole bundled 0.5B's 0.39 against 1.16 (BENCHMARKS.md); the AMD machine has measured neither. So `auto` builds both
at startup, times single-token forwards of each after the same prefix, interleaved round by round (a noisy neighbour
hits both alike), and serves the faster; the learner's later publishes build that kind (System.models names it).
A draft the Q4 kernel cannot run, or a machine where it does not build: int8, untimed.
"""
from __future__ import annotations

import statistics
import time
from typing import NamedTuple

from osd.errors import BackendUnavailable, KernelUnavailable
from osd.models.cached import CachedModel
from osd.models.serving_draft import make_serving_draft, resolve_quantize
from osd.propose.draft_model import serving_runner

CANDIDATES = ("q4", "int8")
PREFIX = 32  # tokens fed before the timed forwards (a short context, as early in a request)
ROUNDS = 12  # timed single-token forwards per copy (the median decides)


class CopyChoice(NamedTuple):
    quantize: str  # the copy chosen
    serving: object  # its serving model, ready to publish
    vocab_ids: object  # its vocabulary map (None: the full vocabulary)
    seconds: dict  # copy -> median seconds of one single-token forward ({} when untimed)


def forward_seconds(runners: dict, vocab_size: int, rounds: int = ROUNDS) -> dict:
    """name -> median seconds of one single-token forward after a PREFIX-token context, the runners taking turns."""
    prefix = [(100 + i) % vocab_size for i in range(PREFIX)]
    for runner in runners.values():
        runner.reset()
        runner.feed(prefix)
        runner.feed([prefix[0]])  # one untimed forward (first-call costs)
    times = {name: [] for name in runners}
    for r in range(rounds):
        for name in (list(runners) if r % 2 == 0 else list(runners)[::-1]):
            runners[name].rollback(PREFIX)
            t0 = time.perf_counter()
            runners[name].feed([prefix[r % PREFIX]])
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def choose_copy(master, draft_vocab: int = 0, keep_ids: list[int] = (), allow_kernel_fallback: bool = False) -> CopyChoice:
    """The serving copy `auto` means for `master` on this machine (see the module docstring)."""
    if resolve_quantize("auto", master) != "q4":
        return CopyChoice("int8", *make_serving_draft(master, "int8", draft_vocab, keep_ids, allow_kernel_fallback), {})
    copies, failed = {}, None
    for q in CANDIDATES:  # a copy whose kernels cannot build here is not a candidate
        try:
            copies[q] = make_serving_draft(master, q, draft_vocab, keep_ids, allow_kernel_fallback)
        except (BackendUnavailable, KernelUnavailable) as e:
            failed = e
    if len(copies) < 2:
        if not copies:
            raise failed
        (only, built), = copies.items()
        return CopyChoice(only, *built, {})
    runners = {q: serving_runner(serving) or CachedModel(serving) for q, (serving, _) in copies.items()}
    seconds = forward_seconds(runners, int(master.config.vocab_size))
    best = min(CANDIDATES, key=lambda q: seconds[q])  # a tie: the first, q4
    return CopyChoice(best, *copies[best], seconds)


def serving_copy(master, quantize: str, draft_vocab: int = 0, keep_ids: list[int] = (),
                 allow_kernel_fallback: bool = False) -> CopyChoice:
    """The serving copy --draft-quantize names: auto -> choose_copy (timed here); any other, built as named, untimed.
    What serving publishes first (build.py) and what `osd eval` measures (distill/run.py)."""
    if quantize == "auto":
        return choose_copy(master, draft_vocab, keep_ids, allow_kernel_fallback)
    return CopyChoice(quantize, *make_serving_draft(master, quantize, draft_vocab, keep_ids, allow_kernel_fallback), {})
