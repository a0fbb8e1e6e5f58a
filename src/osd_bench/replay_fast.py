"""`osd replay --fast`: the greedy fast path, for streams of hundreds to thousands of requests.

The target's greedy output for every request comes from the teacher cache (filled once, batched), and one
teacher-forced draft forward per request and per draft gives every speculative step's accepted count
(distill/evaluate.py). The online draft learns from the signal the engine would give it (the target's
distribution at each rejected, or every proposed, position) through the same OnlineLearner (its guards
included), and is measured on each request *before* it learns from it.

On the same requests, side by side (bench/baselines.py): the never-trained draft (the control), the online
draft, and drafts distilled offline on the first 10% and on 100% of the stream with the same number of
optimizer steps as the online draft took (trained after the stream, once that count is known; they are
static, so measuring them afterwards equals measuring them in stream order). With heldout > 0 every draft
is also measured on requests none trained on, each paired with the control (gained / lost positions, z), and
the online draft on every dataset's held-out requests after each segment (forgetting, against the control).
The draft is whatever ModelConfig.draft names; nothing here assumes a model size.

Resumable (bench/replay_state.py): with a state path, a run cut short continues where it stopped and gives
the same rows as an uncut run.

Where the fast path is not exact (EXACTNESS, also printed in the report):
- With train_layers = N > 0 the frozen lower layers' outputs are computed once per request and cached in
  bfloat16 (learn/batch.py); every draft here runs its top layers on those rounded features, while a served
  draft runs its whole stack in its own dtype. Argmax ties can flip either way: alpha differs from live
  decoding by that rounding (a few positions per thousand, not a bias between drafts, which share it).
- It measures the fp32 master weights; a server proposes with the published serving copy (int8 dynamic
  quantisation by default, ModelConfig.draft_quantize), whose argmax can differ at near-ties.
- Greedy only, at a fixed k; updates are synchronous (each published before the next request); a background
  learner publishes later, so live curves lag these by the training time.
"""
from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass

import torch

from osd_bench.baselines import (ARRIVAL, EPOCHS_RECIPE, SHARES, draft_copy, frozen_trunk_copy, load_trainable_weights,  # noqa: F401
                                 offline_trainer, train_equal_steps, trainable_weights)
from osd_bench.replay_state import fingerprint, learner_state, load_state, restore_learner, save_state
from osd.config import ModelConfig
from osd.distill.cache import DecodeSettings
from osd.distill.evaluate import greedy_steps, position_stats, sample_item
from osd.distill.target_outputs import dataset_samples
from osd.errors import InvalidArgument
from osd.learn.buffer import ReplayItem
from osd.learn.guard import paired_flips, paired_z
from osd.learn.online import LearnConfig, OnlineLearner
from osd.learn.trainable import split_index
from osd.models.loading import load_model

TEACHER_FORCED = ("drafts measured teacher-forced as fp32 masters (a server proposes with its int8 serving copy by "
                  "default) on frozen-trunk features cached in bfloat16, so agreement can differ from live decoding at "
                  "argmax near-ties (shared by every draft, not a bias between them)")
EXACTNESS = "fast path: greedy, fixed k, synchronous updates; " + TEACHER_FORCED


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
    """What the engine would have buffered for this request (learn/buffer.py item_from_step): target rows at the
    rejected positions, or at every position of the output (each accepted proposal, then the rejected or bonus one)."""
    rows = []
    for start, accepted, proposed in greedy_steps(matches, k, max_new_tokens):
        rejected = accepted < proposed and start + accepted < len(matches)
        if mode == "mismatch":
            rows += [start + accepted] if rejected else []
        else:
            rows += list(range(start, min(start + accepted + 1, len(matches))))
    if not rows:
        return None
    n = len(sample.prompt_ids)
    tokens = sample.tokens[: n + max(rows)]
    features = eval_item.features[: len(tokens)] if eval_item.features is not None else None
    return ReplayItem(tokens, [n + r for r in rows], sample.target.select(rows), request_id, version, 0.0, features)


def stream_parts(stream: str, split: str) -> list[tuple[str, str]]:
    """'gsm8k,spider,finance:test' -> [(dataset, split)]: each dataset in the default split unless it names its own
    (finance and chat have only a test split; their held-out requests then come after the streamed ones)."""
    parts = []
    for entry in (e.strip() for e in stream.split(",")):
        name, _, own = entry.rpartition(":")
        parts.append((name, own) if name and own in ("train", "test") else (entry, split))
    return parts


def segment_probes(domains: list[str], probe: int) -> dict[str, list[int]]:
    """Per domain, the indices of its last `probe` requests up to the end of its first run (forgetting probes)."""
    probes = {}
    for i, d in enumerate(domains):
        if (i + 1 == len(domains) or domains[i + 1] != d) and d not in probes:
            probes[d] = [j for j in range(i + 1) if domains[j] == d][-probe:]
    return probes


def run_fast_replay(models: ModelConfig, learn: LearnConfig, stream: str, split: str, per_segment: int,
                    settings: DecodeSettings, k: int = 4, baselines: bool = True, baseline_epochs: int = 0,
                    baseline_lr: float = 1e-5, overlap: float = 0.0, probe: int = 20, batch_size_generate: int = 16,
                    cache_dir=None, progress=None, heldout: int = 0, heldout_split: str = "test", on_row=None,
                    state_path=None, save_every: int = 25, baseline_arrival: bool = False) -> dict:
    """heldout > 0: at the end, every draft is also measured on that many requests of each dataset that none
    trained on (`heldout_split`; past the streamed ones when it is the stream's own split).
    on_row(row): called with each request's row (control and online columns) as soon as it is measured; the
    baselines' columns join the rows once the stream is done. state_path: resumable (module docstring)."""
    parts = stream_parts(stream, split)
    names = [n for n, _ in parts]
    segments = [dataset_samples(models, n, s, per_segment, settings, 0, batch_size_generate, cache_dir, progress)[0]
                for n, s in parts]
    for (n, s), segment in zip(parts, segments):
        if not segment:
            raise InvalidArgument(f"no requests of {n} in split {s!r} (a dataset with one split: {n}:test)")
    unseen = {n: dataset_samples(models, n, heldout_split, heldout, settings, per_segment if heldout_split == s else 0,
                                 batch_size_generate, cache_dir, progress)[0] for n, s in parts} if heldout > 0 else None
    order = drift_order([len(s) for s in segments], overlap)
    cursor = [0] * len(segments)
    samples, domains = [], []
    for j in order:
        samples.append(segments[j][cursor[j]])
        domains.append(names[j])
        cursor[j] += 1
    base = load_model(models.draft, models.draft_dtype)
    result = fast_replay(samples, domains, base, learn, k, baselines, baseline_epochs, baseline_lr, probe,
                         settings.max_new_tokens, progress, unseen, on_row, state_path, save_every, baseline_arrival)
    return {"config": {"models": asdict(models), "learn": asdict(learn), "teacher": asdict(settings), "stream": stream,
                       "split": split, "per_segment": per_segment, "k": k, "overlap": overlap, "heldout": heldout,
                       "heldout_split": heldout_split, "baseline_steps": "equal to the online draft's optimizer steps",
                       "baseline_epochs": baseline_epochs, "baseline_lr": baseline_lr,
                       "baseline_arrival": baseline_arrival, "mode": "fast (greedy)",
                       "exactness": EXACTNESS},
            **result}


def fast_replay(samples: list, domains: list[str], base, learn: LearnConfig, k: int = 4, baselines: bool = True,
                baseline_epochs: int = 0, baseline_lr: float = 1e-5, probe: int = 20, max_new_tokens: int | None = None,
                progress=None, heldout: dict[str, list] | None = None, on_row=None, state_path=None,
                save_every: int = 25, baseline_arrival: bool = False, keep_online: bool = False) -> dict:
    """The replay itself over target samples in stream order; `base` is the original draft (left unchanged).
    keep_online: the result also holds the online draft itself under "online_draft" (not JSON: pop it before writing).

    heldout: domain -> target samples no draft trains on, measured once at the end of the stream.
    baseline_epochs > 0 adds the epochs recipe (at baseline_lr) as its own, labelled draft; baseline_arrival adds
    the equal-step draft trained in arrival order (bench/baselines.py)."""
    items = [sample_item(s) for s in samples]  # frozen-trunk features are cached on these
    split = split_index(base, learn.train_layers)
    # the stream's settings only: a run resumed with other baseline settings keeps its rows and online learner, and
    # trains again only the baselines whose recipe changed (_baselines)
    key = fingerprint(samples, domains, {"learn": asdict(learn), "k": k, "max_new_tokens": max_new_tokens})
    state = load_state(state_path, key) or {"fingerprint": key, "rows": [], "baselines": {}}
    learner = _online_learner(base, learn)
    if state["rows"]:
        restore_learner(learner, state["learner"])
        torch.set_rng_state(state["torch_rng"])
    save = (lambda: save_state(state_path, {**state, "learner": learner_state(learner), "torch_rng": torch.get_rng_state()})) \
        if state_path else (lambda: None)
    rows, timings = state["rows"], dict(state.get("timings", {}))
    unseen = {d: ([sample_item(s) for s in ss], ss) for d, ss in (heldout or {}).items()}
    control_heldout = {d: _matches(base, items_, ss, split) for d, (items_, ss) in unseen.items()}
    forgetting, checkpoints = state.setdefault("forgetting", []), segment_ends(domains)
    for row in rows if on_row else ():
        on_row(row)
    start = time.perf_counter()
    iterator = range(len(rows), len(samples))
    iterator = progress(iterator, desc="replay", unit="req", initial=len(rows), total=len(samples)) if progress else iterator
    for i in iterator:
        rows.append(_online_row(i, samples, domains, items, base, learner, k, split, max_new_tokens))
        if on_row:
            on_row(rows[-1])
        if hasattr(iterator, "set_postfix"):
            iterator.set_postfix(alpha=f"{rows[-1]['online_alpha']:.2f}", v=learner.version)
        if unseen and i + 1 in checkpoints:  # forgetting: every domain's held-out requests, online vs control
            forgetting.append(_heldout_point(i, domains, learner.master, unseen, control_heldout, split))
        if (i + 1) % max(1, save_every) == 0 or i + 1 == len(samples):
            state["timings"] = {**timings, "replay_seconds": timings.get("replay_seconds", 0.0) + time.perf_counter() - start}
            save()
    timings = dict(state.get("timings", timings))
    variants = {"original": base}
    if baselines:
        variants.update(_baselines(base, learn, items, learner.counters["optimizer_steps"], baseline_epochs, baseline_lr,
                                   state, save, progress, baseline_arrival))
        _add_baseline_columns(rows, variants, samples, items, k, split, max_new_tokens)
    variants["online"] = learner.master
    for name in set(state["baselines"]) - set(variants):  # a baseline of an earlier run on this state, not this one's
        for row in rows:
            for column in [c for c in row if c.startswith(f"{name}_")]:
                del row[column]
    end_of_stream = {d: {name: _mean_alpha(m, [items[j] for j in idx], [samples[j] for j in idx], split)
                         for name, m in variants.items()}  # is an earlier domain forgotten?
                     for d, idx in segment_probes(domains, probe).items()}
    on_heldout, vs_control, online_vs, matches = _heldout(variants, unseen, split)
    trained = {n: r for n, r in (state.get("baselines_report") or {}).items() if n in variants}  # this run's recipes
    return {"requests": rows, "variants": list(variants), "end_of_stream_alpha_on_segment_probes": end_of_stream,
            "end_of_stream_alpha_on_heldout": on_heldout, "heldout_vs_control": vs_control,
            "heldout_matches": matches, "heldout_after_each_segment": forgetting,
            "heldout_online_vs_offline_100pct": online_vs["offline_100pct"],
            **({"heldout_online_vs_offline_arrival": online_vs[ARRIVAL]} if ARRIVAL in variants else {}),
            "baselines": trained,
            "learner": learner.stats(), "updates": learner.history,
            "timings": {**timings, **{f"{n}_train_seconds": r["seconds"] for n, r in trained.items()}},
            **({"online_draft": learner.master} if keep_online else {})}


def _online_learner(base, learn: LearnConfig) -> OnlineLearner:
    with torch.random.fork_rng():  # LoRA adapters drawn the same way in a resumed run
        torch.manual_seed(learn.seed)
        online, held = draft_copy(base, learn), []
        publish = lambda master, version=None: _Published(held[0].version + 1 if version is None else version)
        held.append(OnlineLearner(online, publish, learn))  # versions count on from the learner's (a resumed one too)
        return held[0]


def _online_row(i, samples, domains, items, base, learner, k, split, max_new_tokens) -> dict:
    """Control and online draft on request i (the online one before it learns from it); then it learns."""
    row = {"i": i, "domain": domains[i], "draft_version": learner.version, "positions": len(samples[i].response_ids)}
    control = position_stats(base, [items[i]], [samples[i]], split)[0]["matches"]
    row.update(_alpha_columns("original", control, k, max_new_tokens))
    matches = position_stats(learner.master, [items[i]], [samples[i]], split)[0]["matches"]
    row.update(_alpha_columns("online", matches, k, max_new_tokens, control))
    learn = learner.config
    made = {mode: learn_item(samples[i], items[i], matches, k, mode, f"req-{i}", learner.version, max_new_tokens)
            for mode in {learn.mode, "all"}}  # the training signal, and every position for the guard
    learner.observe_item(made[learn.mode], made["all"])
    learner.after_request()
    return row


def _alpha_columns(name: str, matches: list[bool], k: int, max_new_tokens, control: list[bool] | None = None) -> dict:
    steps = greedy_steps(matches, k, max_new_tokens)
    out = {f"{name}_alpha": sum(matches) / max(1, len(matches)), f"{name}_tokens_per_step": len(matches) / max(1, len(steps))}
    if control is not None:  # paired with the control on this request's positions
        lost, gained = paired_flips(control, matches)
        out.update({f"{name}_gained": gained, f"{name}_lost": lost})
    return out


def _baselines(base, learn, items, steps, epochs, epochs_lr, state, save, progress, arrival: bool = False) -> dict:
    """offline_10pct / offline_100pct with `steps` optimizer steps (and the epochs recipe when epochs > 0); each one
    saved in the state once trained with its recipe, so a resumed run does not train it again unless its recipe
    (steps, or epochs and learning rate) changed."""
    report, trained = state.setdefault("baselines_report", {}), state.setdefault("baseline_recipes", {})
    drafts = {}
    recipes = [(name, share, None) for name, share in SHARES] + ([(EPOCHS_RECIPE, 1.0, epochs)] if epochs else []) \
        + ([(ARRIVAL, 1.0, None)] if arrival else [])
    for j, (name, share, n_epochs) in enumerate(recipes):
        trainer = offline_trainer(base, learn, seed=learn.seed + j, epochs=n_epochs or 1,
                                  lr=epochs_lr if n_epochs else None)
        recipe = {"epochs": n_epochs, "lr": epochs_lr} if n_epochs else {"steps": steps}
        recipe.update({"order": "arrival"} if name == ARRIVAL else {})
        if name in state["baselines"] and trained.get(name) == recipe:
            load_trainable_weights(trainer, state["baselines"][name])
        else:
            part = items[: max(1, int(len(items) * share))]
            if n_epochs:
                start = time.perf_counter()
                losses = _fit_epochs(trainer, part)
                report[name] = {"optimizer_steps": len(losses), "epochs": n_epochs, "lr": epochs_lr, "items": len(part),
                                "seconds": time.perf_counter() - start, "recipe": f"{n_epochs} epochs (not equal steps)"}
            else:
                report[name] = {**train_equal_steps(trainer, part, steps, progress, learn.average, name == ARRIVAL),
                                "lr": learn.lr, "recipe": "equal steps" + (", arrival order" if name == ARRIVAL else "")}
            state["baselines"][name], trained[name] = trainable_weights(trainer), recipe
            save()
        drafts[name] = trainer.draft
    return drafts


def _fit_epochs(trainer, items: list) -> list[float]:
    """The epochs recipe on items that already hold their frozen-trunk features."""
    losses = []
    for epoch in range(trainer.config.epochs):
        for batch in trainer.batches(items, epoch):
            losses.append(trainer.train_step(batch))
    trainer.draft.eval()
    return [l for l in losses if l is not None]


def _add_baseline_columns(rows, variants, samples, items, k, split, max_new_tokens) -> None:
    for row in rows:
        i = row["i"]
        control = position_stats(variants["original"], [items[i]], [samples[i]], split)[0]["matches"]
        for name, model in variants.items():
            if name != "original":
                matches = position_stats(model, [items[i]], [samples[i]], split)[0]["matches"]
                row.update(_alpha_columns(name, matches, k, max_new_tokens, control))


def segment_ends(domains: list[str]) -> set[int]:
    """Request counts at which the stream has passed each of its n segments' share (1/n of it, n = domains): the ends
    of the segments of a sharp shift of equal segments; the same points of a drifting stream."""
    n = len(dict.fromkeys(domains))
    return {round(len(domains) * (j + 1) / n) for j in range(n)}


def _heldout_point(i, domains, online, unseen, control, split) -> dict:
    """The online draft on every domain's held-out requests after request i, paired with the control (forgetting)."""
    point = {"at_request": i + 1, "last_domain": domains[i], "heldout": {}}
    for d, (items, samples) in unseen.items():
        matches = _matches(online, items, samples, split)
        point["heldout"][d] = {"online": sum(matches) / max(1, len(matches)),
                               "control": sum(control[d]) / max(1, len(control[d])), **paired_difference(control[d], matches)}
    return point


def _heldout(variants: dict, unseen: dict[str, tuple[list, list]], split: int) -> tuple[dict, dict, dict, dict]:
    """Alpha of every draft on each domain's held-out requests, each paired with the control on the same positions;
    the online draft paired with each full-stream offline draft (name -> domain -> paired difference); and every
    draft's per-position agreement as a string of 0/1 (domain -> name; `osd bench pair` pairs two runs on it)."""
    alphas, vs_control, online_vs, bits = {}, {}, {"offline_100pct": {}, ARRIVAL: {}}, {}
    for domain, (items, samples) in unseen.items():
        matches = {name: _matches(model, items, samples, split) for name, model in variants.items()}
        alphas[domain] = {name: sum(m) / max(1, len(m)) for name, m in matches.items()}
        bits[domain] = {name: "".join("1" if x else "0" for x in m) for name, m in matches.items()}
        vs_control[domain] = {name: paired_difference(matches["original"], m) for name, m in matches.items()
                              if name != "original"}
        for name in set(online_vs) & set(matches):
            online_vs[name][domain] = paired_difference(matches[name], matches["online"])
    return alphas, vs_control, online_vs, bits


def paired_difference(base: list[bool], other: list[bool]) -> dict:
    """Positions `other` gets right and `base` wrong (gained) and the reverse (lost), and the sign-test z
    (the guard's paired count, learn/guard.py)."""
    lost, gained = paired_flips(base, other)
    return {"gained": gained, "lost": lost, "z": paired_z(base, other)}


def _matches(model, items, samples, split) -> list[bool]:
    return [m for s in position_stats(model, items, samples, split) for m in s["matches"]]


def _mean_alpha(model, items, samples, split) -> float:
    matches = _matches(model, items, samples, split)
    return sum(matches) / max(1, len(matches))
