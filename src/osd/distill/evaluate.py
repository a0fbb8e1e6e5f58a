"""Acceptance of a draft against cached target outputs, without running the target again.

Greedy is exact: the target's greedy response is fixed, and a speculative step accepts draft proposals
while they equal it. One teacher-forced draft forward over prompt + response gives the draft's argmax at
every position; the first mismatch in a step ends it (later proposals would be rejected anyway), so
`greedy_steps` reproduces every step's accepted count. For sampling (T = 1) the expected acceptance of
one proposal is sum_x min(p, q) = 1 - TV(p, q) (PAPER.md section 2), from the stored top-K + tail.
Implied speedups take c and verify costs from an `osd bench speed` result: the one given, else the newest by the
date recorded inside it (newest_calibration).
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import torch

from osd.distill.cache import TargetSample
from osd.errors import InvalidArgument
from osd.learn.batch import draft_logits_at
from osd.learn.buffer import ReplayItem
from osd.learn.compact import CompactDist
from osd.learn.losses import mapped_bucket_log_probs, tv_distance
from osd.models.vocab_map import target_to_draft, vocab_ids_of
from osd.speed_model import expected_speedup


def greedy_steps(matches: list[bool], k: int, max_new_tokens: int | None = None) -> list[tuple[int, int, int]]:
    """(start, accepted, proposed) of each greedy speculative step over a fixed response.

    Like the engine, a step never proposes past max_new_tokens - 1 (the last token is the target's own).
    """
    steps, i = [], 0
    while i < len(matches):
        proposed = k if max_new_tokens is None else max(0, min(k, max_new_tokens - i - 1))
        accepted = 0
        while accepted < proposed and i + accepted < len(matches) and matches[i + accepted]:
            accepted += 1
        steps.append((i, accepted, proposed))
        i += accepted + 1  # accepted tokens plus the target's own token (correction or bonus)
    return steps


CONFIDENCE_EDGES = (0.5, 0.9)
DRAFT_CONFIDENCE_EDGES = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95)  # where the serving scheduler's confidence bins matter


def agreement_by_confidence(target_top1: list[float], matches: list[bool], edges=CONFIDENCE_EDGES) -> list[dict]:
    """Greedy agreement in buckets of a top-1 probability: the target's own (is the draft wrong where the target is
    sure of its token, or where it hesitates?) or the draft's (does the draft know where it is right? what the
    scheduler's drafting ahead reads, schedule/confidence.py). Per bucket [lo, hi): share of positions and agreement."""
    bounds = [0.0, *edges, 1.0]
    out = []
    for lo, hi in zip(bounds, bounds[1:]):
        last = hi == bounds[-1]
        picked = [m for p, m in zip(target_top1, matches) if lo <= p < hi or (last and p >= hi)]
        out.append({"bucket": f"[{lo}, {hi}{']' if last else ')'}", "share": len(picked) / max(1, len(matches)),
                    "agreement": sum(picked) / len(picked) if picked else None})
    return out


def sample_item(sample: TargetSample) -> ReplayItem:
    """Every response position of a sample, as one item (context = prompt + response minus its last token)."""
    n = len(sample.prompt_ids)
    return ReplayItem(sample.tokens[:-1], [n + j for j in range(len(sample.response_ids))], sample.target,
                      "sample", 0, 0.0)


@torch.no_grad()
def position_stats(draft, items: list[ReplayItem], samples: list[TargetSample], split: int = 0,
                   batch_size: int = 8) -> list[dict]:
    """Per sample: greedy matches (draft argmax == target token), 1 - TV and the target's top-1 probability at
    each response position (the master draft in torch, teacher-forced, `batch_size` samples a forward)."""
    out, vocab_ids = [], vocab_ids_of(draft)
    lut = None if vocab_ids is None else target_to_draft(vocab_ids, int(draft.config.vocab_size))
    for s in range(0, len(items), batch_size):
        chunk = items[s : s + batch_size]
        logits = draft_logits_at(draft, chunk, split)  # (N, V'): over the draft's own head
        out += _stats(logits, chunk, samples[s : s + batch_size], vocab_ids, lut)
    return out


@torch.no_grad()
def serving_stats(runner, vocab_ids: torch.Tensor | None, vocab_size: int, samples: list[TargetSample]) -> list[dict]:
    """position_stats of a serving copy through its runner (the forwards that serve: a Q4 or int8 copy's kernels),
    each sample's prompt and response fed in one call, the logits kept at every response position."""
    out, lut = [], None if vocab_ids is None else target_to_draft(vocab_ids, vocab_size)
    for sample in samples:
        item = sample_item(sample)
        runner.reset()
        logits = runner.feed(item.tokens, n_logits=len(item.positions))  # positions P-1 predict tokens P
        out += _stats(logits, [item], [sample], vocab_ids, lut)
    return out


def _stats(logits: torch.Tensor, items: list[ReplayItem], samples: list[TargetSample],
           vocab_ids: torch.Tensor | None = None, lut: torch.Tensor | None = None) -> list[dict]:
    """(sum of positions, V') draft logits over its head -> position_stats' rows, one per sample. vocab_ids, lut: a
    restricted head's map into the target's vocabulary and back (None: a full head), measured over the head's own
    columns (mapped_bucket_log_probs: the buckets of the logits expanded to the target's vocabulary, without it)."""
    target_logp, draft_logp = mapped_bucket_log_probs(logits, CompactDist.cat([it.target for it in items]), lut)
    draft_top1 = logits.float().softmax(-1).max(-1).values  # the draft's probability of its argmax
    predicted = logits.argmax(-1)  # the first maximum over the head: the expanded logits' argmax but at exact ties
    predicted = predicted if vocab_ids is None else vocab_ids[predicted]
    beta = 1 - tv_distance(target_logp, draft_logp)
    out, offset = [], 0
    for item, sample in zip(items, samples):
        n = len(item.positions)
        pred = predicted[offset : offset + n]
        out.append({"matches": (pred == torch.tensor(sample.response_ids)).tolist(),
                    "beta": beta[offset : offset + n].tolist(), "target_top1": item.target.probs[:, 0].tolist(),
                    "draft_top1": draft_top1[offset : offset + n].tolist()})
        offset += n
    return out


def summarize(stats: list[dict], k: int, calibration: dict | None = None, max_new_tokens: int | None = None) -> dict:
    """alpha (greedy agreement), accepted/proposed, tokens per step at k, 1 - TV, implied speedups."""
    matches = [m for s in stats for m in s["matches"]]
    steps = [step for s in stats for step in greedy_steps(s["matches"], k, max_new_tokens)]
    proposed = sum(p for _, _, p in steps)
    beta = [b for s in stats for b in s["beta"]]
    out = {"requests": len(stats), "positions": len(matches), "k": k,
           "alpha_greedy": sum(matches) / max(1, len(matches)),
           "acceptance_greedy": sum(a for _, a, _ in steps) / max(1, proposed),
           "tokens_per_step_greedy": len(matches) / max(1, len(steps)),
           "alpha_sampling_t1": sum(beta) / max(1, len(beta)),
           "by_target_confidence": agreement_by_confidence([p for s in stats for p in s["target_top1"]], matches),
           "by_draft_confidence": agreement_by_confidence([p for s in stats for p in s["draft_top1"]], matches,
                                                          DRAFT_CONFIDENCE_EDGES)}
    if calibration:
        c, v = calibration["c"], calibration["verify_cost"]
        for name, alpha in (("greedy", out["alpha_greedy"]), ("sampling_t1", out["alpha_sampling_t1"])):
            best = max(range(len(v)), key=lambda j: expected_speedup(alpha, j, c, v[j]))
            out[f"implied_speedup_{name}"] = expected_speedup(alpha, best, c, v[best])
            out[f"implied_best_k_{name}"] = best
    return out


CALIBRATION_KEYS = ("draft_quantize", "draft_vocab")  # settings a calibration must share with the models evaluated


def newest_calibration(path: str = "", models=None, root: str = "benchmarks") -> dict | None:
    """c and verify costs from an `osd bench speed` JSON (plus its "source" and "recorded_at").

    path: that file (it must hold a calibration; "none": no calibration). Else, among <root>/**/bench-speed-*.json
    whose draft settings match `models`, the one with the newest date recorded inside it ("timestamp", written by
    bench/record.py); file modification times are not used (a fresh clone gives every file the same one), and a
    file without a recorded date is only used when given. None when no file fits.
    """
    if path:
        return None if path == "none" else _calibration_in(Path(path))
    found = []
    for f in Path(root).glob("**/bench-speed-*.json"):  # benchmarks/speed/ and any other topic folder
        try:
            data = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        used = data.get("config", {}).get("models", {})
        same = models is None or all(used.get(k) == getattr(models, k) for k in CALIBRATION_KEYS)
        when = _recorded_at(data)
        if "calibration" in data and same and when is not None:
            found.append((when, f.name, f, data))
    if not found:
        return None
    _, _, f, data = max(found)
    return {**data["calibration"], "source": str(f), "recorded_at": data["timestamp"]}


def _recorded_at(data: dict):
    """The UTC datetime in a result's "timestamp" (bench/record.py's format), or None."""
    try:
        return datetime.strptime(str(data.get("timestamp")), "%Y-%m-%dT%H:%M:%SZ")
    except ValueError:
        return None


def _calibration_in(f) -> dict:
    try:
        data = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InvalidArgument(f"--calibration {f}: cannot read it as JSON ({type(e).__name__}: {e})") from e
    if not isinstance(data, dict) or "calibration" not in data:
        raise InvalidArgument(f"--calibration {f} holds no 'calibration' (an `osd bench speed` result has one)")
    return {**data["calibration"], "source": str(f), "recorded_at": data.get("timestamp")}
