"""`osd replay --fast`: the greedy fast path, for streams of hundreds to thousands of requests.

Exact for greedy decoding (see distill/evaluate.py): the target's greedy output for every request comes
from the teacher cache (filled once, batched), and one teacher-forced draft forward per request and per
draft variant gives every speculative step's accepted count. The online draft learns from exactly the
signal the engine would give it (the target's distribution at each rejected position) through the same
OnlineLearner, and is measured on each request *before* it learns from it.

Side by side, on the same requests: the original draft (static), a draft distilled offline on the first
10% of the stream, and one distilled on the whole stream (the upper bound), all with the same
trainable set. With train_layers = N the lower layers are shared and frozen, so their outputs are
computed once per request and reused by every variant and every training step.
"""
from __future__ import annotations

import copy
import random
import time
from dataclasses import asdict, dataclass

from osd.config import ModelConfig
from osd.distill.cache import DecodeSettings
from osd.distill.evaluate import greedy_steps, position_stats, sample_item
from osd.distill.target_outputs import dataset_samples
from osd.distill.trainer import DistillConfig, DistillTrainer
from osd.learn.buffer import ReplayItem
from osd.learn.guard import paired_flips
from osd.learn.online import LearnConfig, OnlineLearner
from osd.learn.trainable import split_index
from osd.models.loading import load_model


@dataclass
class _Published:
    version: int


def drift_order(lengths: list[int], overlap: float, seed: int = 0) -> list[int]:
    """Segment index of each request: segments follow each other, blending over `overlap` segment-lengths
    (0 = sharp switches); each segment's own records stay in file order."""
    rng, keyed = random.Random(seed), []
    for j, n in enumerate(lengths):
        keys = sorted(j + overlap * (rng.random() - 0.5) + i / max(1, n) for i in range(n))
        keyed += [(k, j) for k in keys]
    return [j for _, j in sorted(keyed)]


def learn_item(sample, eval_item, matches: list[bool], k: int, mode: str, request_id: str, version: int,
               max_new_tokens: int | None = None) -> ReplayItem | None:
    """What the engine would have buffered for this request: target rows at rejected (or all proposed) positions."""
    rows = []
    for start, accepted, proposed in greedy_steps(matches, k, max_new_tokens):
        rejected = accepted < proposed and start + accepted < len(matches)
        if mode == "mismatch":
            rows += [start + accepted] if rejected else []
        else:  # every proposal on the output trajectory: the accepted ones and the first rejected one
            rows += list(range(start, start + accepted + int(rejected)))
    if not rows:
        return None
    n = len(sample.prompt_ids)
    tokens = sample.tokens[: n + max(rows)]
    features = eval_item.features[: len(tokens)] if eval_item.features is not None else None
    return ReplayItem(tokens, [n + r for r in rows], sample.target.select(rows), request_id, version, 0.0, features)


def frozen_trunk_copy(model, split: int):
    """A copy whose frozen lower layers (and embeddings / LM head) are shared with `model`, not duplicated."""
    shared = [model.model.embed_tokens, model.lm_head, model.model.rotary_emb, *model.model.layers[:split]]
    memo = {id(p): p for m in shared for p in list(m.parameters()) + list(m.buffers())}
    memo.update({id(m): m for m in shared})
    return copy.deepcopy(model, memo)


def run_fast_replay(models: ModelConfig, learn: LearnConfig, stream: str, split: str, per_segment: int,
                    settings: DecodeSettings, k: int = 4, baselines: bool = True, baseline_epochs: int = 2,
                    baseline_lr: float = 1e-5, overlap: float = 0.0, probe: int = 20, batch_size_generate: int = 16,
                    cache_dir=None, progress=None, heldout: int = 0, heldout_split: str = "test", on_row=None) -> dict:
    """heldout > 0: at the end, every variant is also measured on that many requests of each dataset that no
    draft has seen (`heldout_split`; past the streamed ones when it is the stream's own split).
    on_row(row): called with each request's row as soon as it is measured (a long run keeps what it measured)."""
    names = [n.strip() for n in stream.split(",")]
    segments = [dataset_samples(models, n, split, per_segment, settings, 0, batch_size_generate, cache_dir, progress)[0]
                for n in names]
    unseen = {n: dataset_samples(models, n, heldout_split, heldout, settings, per_segment if heldout_split == split else 0,
                                 batch_size_generate, cache_dir, progress)[0] for n in names} if heldout > 0 else None
    order = drift_order([len(s) for s in segments], overlap)
    cursor = [0] * len(segments)
    samples, domains = [], []
    for j in order:
        samples.append(segments[j][cursor[j]])
        domains.append(names[j])
        cursor[j] += 1
    base = load_model(models.draft, models.draft_dtype)
    result = fast_replay(samples, domains, base, learn, k, baselines, baseline_epochs, baseline_lr, probe,
                         settings.max_new_tokens, progress, unseen, on_row)
    return {"config": {"models": asdict(models), "learn": asdict(learn), "teacher": asdict(settings), "stream": stream,
                       "split": split, "per_segment": per_segment, "k": k, "overlap": overlap, "heldout": heldout,
                       "heldout_split": heldout_split,
                       "baseline_epochs": baseline_epochs, "baseline_lr": baseline_lr, "mode": "fast (greedy, exact)"},
            **result}


def fast_replay(samples: list, domains: list[str], base, learn: LearnConfig, k: int = 4, baselines: bool = True,
                baseline_epochs: int = 2, baseline_lr: float = 1e-5, probe: int = 20, max_new_tokens: int | None = None,
                progress=None, heldout: dict[str, list] | None = None, on_row=None) -> dict:
    """The replay itself over target samples in stream order; `base` is the original draft (left unchanged).
    heldout: domain -> target samples no draft trains on, measured once at the end of the stream."""
    items = [sample_item(s) for s in samples]  # frozen-trunk features are cached on these
    layer_split = split_index(base, learn.train_layers)
    variants = {"original": base}
    timings = {}
    if baselines:
        cache = {(tuple(s.prompt_ids), tuple(s.response_ids)): it for s, it in zip(samples, items)}
        for name, share in (("offline_10pct", 0.1), ("offline_100pct", 1.0)):
            start = time.perf_counter()
            draft = frozen_trunk_copy(base, layer_split)
            cfg = DistillConfig(epochs=baseline_epochs, lr=baseline_lr, batch_size=learn.batch_size, trainable=learn.trainable,
                                train_layers=learn.train_layers, lora_rank=learn.lora_rank, loss=learn.loss, beta=learn.beta)
            part = samples[: max(1, int(len(samples) * share))]
            DistillTrainer(draft, cfg).fit(lambda epoch: part, progress and (lambda **kw: progress(**{**kw, "desc": name})), cache)
            variants[name] = draft
            timings[f"{name}_train_seconds"] = time.perf_counter() - start
    online = frozen_trunk_copy(base, layer_split)
    versions = [0]

    def publish(master, version=None):
        versions[0] = versions[0] + 1 if version is None else version
        return _Published(versions[0])

    learner = OnlineLearner(online, publish, learn)
    variants["online"] = online
    rows, probes = [], {}
    iterator = progress(range(len(samples)), desc="replay", unit="req") if progress else range(len(samples))
    start = time.perf_counter()
    for i in iterator:
        row = {"i": i, "domain": domains[i], "draft_version": learner.version, "positions": len(samples[i].response_ids)}
        for name, model in variants.items():
            stats = position_stats(model, [items[i]], [samples[i]], layer_split)[0]
            steps = greedy_steps(stats["matches"], k, max_new_tokens)
            row[f"{name}_alpha"] = sum(stats["matches"]) / max(1, len(stats["matches"]))
            row[f"{name}_tokens_per_step"] = len(stats["matches"]) / max(1, len(steps))
            if name == "online":  # what the engine would buffer: the training signal, and every position for the guard
                made = {mode: learn_item(samples[i], items[i], stats["matches"], k, mode, f"req-{i}", learner.version,
                                         max_new_tokens) for mode in {learn.mode, "all"}}
                learner.observe_item(made[learn.mode], made["all"])
        learner.after_request()
        rows.append(row)
        if on_row:
            on_row(row)
        if i + 1 == len(samples) or domains[i + 1] != domains[i]:  # end of a segment: remember its probe
            probes.setdefault(domains[i], [j for j in range(i + 1) if domains[j] == domains[i]][-probe:])
        if hasattr(iterator, "set_postfix"):
            iterator.set_postfix(alpha=f"{row['online_alpha']:.2f}", v=learner.version)
    timings["replay_seconds"] = time.perf_counter() - start
    end_of_stream = {}
    for domain, idx in probes.items():  # is an earlier domain forgotten? alpha of each variant on its probe, at the end
        end_of_stream[domain] = {name: _mean_alpha(model, [items[j] for j in idx], [samples[j] for j in idx], layer_split)
                                 for name, model in variants.items()}
    on_heldout, paired = {}, {}
    for domain, unseen in (heldout or {}).items():
        matches = {name: _matches(model, [sample_item(s) for s in unseen], unseen, layer_split)
                   for name, model in variants.items()}
        on_heldout[domain] = {name: sum(m) / max(1, len(m)) for name, m in matches.items()}
        if "offline_100pct" in matches:
            paired[domain] = paired_difference(matches["offline_100pct"], matches["online"])
    return {"requests": rows, "variants": list(variants), "end_of_stream_alpha_on_segment_probes": end_of_stream,
            "end_of_stream_alpha_on_heldout": on_heldout, "heldout_online_vs_offline_100pct": paired,
            "learner": learner.stats(), "updates": learner.history, "timings": timings}


def paired_difference(base: list[bool], other: list[bool]) -> dict:
    """Positions `other` gets right and `base` wrong (gained) and the reverse (lost), and the sign-test z
    (the guard's paired count, learn/guard.py)."""
    lost, gained = paired_flips(base, other)
    return {"gained": gained, "lost": lost, "z": (gained - lost) / (gained + lost) ** 0.5 if gained + lost else 0.0}


def _matches(model, items, samples, layer_split) -> list[bool]:
    return [m for s in position_stats(model, items, samples, layer_split) for m in s["matches"]]


def _mean_alpha(model, items, samples, layer_split) -> float:
    matches = _matches(model, items, samples, layer_split)
    return sum(matches) / max(1, len(matches))
