"""`osd replay`: replay a prompt stream through the online system (live mode: real decoding).

Per request it records alpha, tokens per step, tokens/s and the draft version; in the same run the
never-trained draft (the control) serves the same stream side by side, so both curves come from one
machine state, and optionally the target alone: osd's own target-only engine (--target-only) and llama.cpp on
the same GGUF (--llama-cpp-target), each request decoded by every arm back to back.

Fair comparison, on the same positions (bench/baselines.py): every request's target distributions at the
positions the online draft proposed are kept (they come with verification, no extra target forward);
the online draft is measured on them teacher-forced as the request ends (before it learns from it; sync
schedule only, a background learner's master may be mid-update), and after the stream so are the control
and drafts distilled offline on the first 10% and on all of those requests with the online draft's number
of optimizer steps. With heldout > 0, requests none trained on are decoded by the control and every draft
is measured on them, paired with the control (gained / lost / z). Teacher-forced agreement uses the fp32
masters on bf16-cached trunk features (replay_fast.TEACHER_FORCED); the live alpha columns are what was served.
"""
from __future__ import annotations

from pathlib import Path

from osd_bench.baselines import SHARES, draft_copy, offline_trainer, train_equal_steps
from osd.records import emit_report
from osd_bench.replay_fast import TEACHER_FORCED, paired_difference, stream_parts
from osd_bench.report import measured_command, table
from osd_bench.speed import llama_cpp_target_arm
from osd.build import attach_learner, build_system
from osd.config import ModelConfig, SamplingConfig, SpeculationConfig
from osd.data import load_records, prompt_ids
from osd.engine import SpeculativeEngine
from osd.errors import InvalidArgument
from osd.learn.batch import acceptance_on
from osd.learn.buffer import ReplayBuffer, item_from_step
from osd.learn.guard import paired_flips
from osd.learn.online import LearnConfig
from osd.learn.trainable import split_index
from osd.propose import DraftModelProposer


def parse_stream(spec: str, split: str, per_segment: int) -> list[dict]:
    """'gsm8k' or 'gsm8k,spider,finance:test' (a sharp shift: per_segment requests of each, in order; a dataset may
    name its own split)."""
    out = []
    for name, own in stream_parts(spec, split):
        records = load_records(name, split=own or None, limit=per_segment)
        if not records:
            raise InvalidArgument(f"no requests of {name} in split {own!r} (a dataset with one split: {name}:test)")
        out += records
    return out


class RequestPositions:
    """An engine observer keeping every output position of the current request (target distribution included), as
    ReplayItems; `take()` hands them over and starts the next request."""

    def __init__(self, top_k: int, max_context: int):
        self.top_k, self.max_context = top_k, max_context
        self.buffer = ReplayBuffer(capacity=1 << 40)

    def observe(self, record) -> None:
        item = item_from_step(record, "all", self.top_k, self.max_context)
        if item is not None:
            self.buffer.add(item)

    def take(self) -> list:
        items = self.buffer.snapshot()
        self.buffer.clear()
        return items


def run_replay(models: ModelConfig, spec: SpeculationConfig, learn: LearnConfig, stream: str, split: str,
               per_segment: int, max_new_tokens: int, baseline: bool = True, progress=None,
               target_only: bool = False, heldout: int = 0, heldout_split: str = "test",
               llama_cpp_target: bool = False, compare_every: int = 1) -> dict:
    """compare_every: the other arms (the control served, osd and llama.cpp target-only) decode every this many
    requests only (the first included); the online draft serves and learns from every one, and the teacher-forced
    columns cover every request. baseline: also the offline drafts (10% / 100% of the stream, equal optimizer steps); the control always serves.
    llama_cpp_target: also decode each request with llama.cpp alone on the target's GGUF (refused for other targets).
    spec.adaptive: the online draft and the control serve with the adaptive k policy, as `osd serve` does (tokens/s as
    served); else at the fixed spec.k (the live alpha columns compare at one k). The teacher-forced columns are fair
    either way."""
    if compare_every < 1:
        raise InvalidArgument(f"compare_every must be >= 1, got {compare_every}")
    gguf = llama_cpp_gguf(models) if llama_cpp_target else None  # refused before anything loads
    system = build_system(models, spec)
    system.engine.calibrate()
    control = draft_copy(system.draft_master, learn)  # never trained (taken before a checkpoint is resumed)
    system.publish_draft(control, name="static")
    static = SpeculativeEngine(system.target_model, system.tokenizer,
                               DraftModelProposer(system.registry, "static", system.engine.vocab_size), spec)
    static.set_adaptive(spec.adaptive)  # as the online engine
    if spec.adaptive:
        static.calibrate()
    plain = SpeculativeEngine(system.target_model, system.tokenizer, None, SpeculationConfig(k=0, adaptive=False)) \
        if target_only else None
    system.engine.set_adaptive(spec.adaptive)
    llama_cpp = llama_cpp_target_arm(gguf, models.threads, models.n_ctx, max_new_tokens, system.engine.eos_ids) \
        if gguf is not None else None
    sampling = SamplingConfig(max_new_tokens=max_new_tokens)
    _warm_up(system.engine, [static.generate] + ([plain.generate] if plain else []), llama_cpp,
             prompt_ids(system.tokenizer, WARM_UP_PROMPT), sampling)
    positions = RequestPositions(learn.top_k, learn.max_context)
    system.engine.observers.append(positions.observe)
    learner = attach_learner(system, learn)
    split_at = split_index(control, learn.train_layers)
    measured = {}  # the online draft on each request's positions, as the request ends (before it learns from it)

    def measure_online(result):
        items = positions.take()
        online = acceptance_on(learner.master, items, split=split_at)["correct"] if items and learn.schedule == "sync" else None
        measured[result.request_id] = (items, online)

    system.engine.request_observers.insert(0, measure_online)  # before the learner's own after_request
    records = parse_stream(stream, split, per_segment)
    rows, request_items = [], []
    iterator = progress(records) if progress else records
    for i, record in enumerate(iterator):
        ids = prompt_ids(system.tokenizer, record["prompt"])
        result = system.engine.generate(ids, sampling)
        s = result.stats
        row = {"i": i, "id": record["id"], "domain": record["domain"], "draft_version": result.draft[1],
               "alpha": s["alpha"], "tokens_per_step": s["tokens_per_step"], "tokens_per_second": s["wall_tokens_per_second"]}
        if i % compare_every == 0:
            row.update(_other_arms(ids, sampling, static, plain, llama_cpp))
        items, online = measured.pop(result.request_id)
        request_items.append((items, online))
        rows.append(row)
        if progress and hasattr(iterator, "set_postfix"):
            iterator.set_postfix(alpha=f"{row['alpha'] or 0:.2f}", v=row["draft_version"])
    learner.stop()
    variants = {"original": control}
    reports = {}
    if baseline:
        flat = [(i, it) for i, (items, _) in enumerate(request_items) for it in items]
        for j, (name, share) in enumerate(SHARES):
            trainer = offline_trainer(control, learn, seed=learn.seed + j)
            cut = max(1, int(len(rows) * share))
            part = [it for i, it in flat if i < cut]
            reports[name] = {**train_equal_steps(trainer, part, learner.counters["optimizer_steps"], average=learn.average), "lr": learn.lr,
                             "recipe": "equal steps", "items": cut}
            variants[name] = trainer.draft
    _add_teacher_forced_columns(rows, request_items, variants, split_at)
    variants["online"] = learner.master
    on_heldout, vs_control = {}, {}
    if heldout > 0:
        on_heldout, vs_control = _heldout(static, system.tokenizer, variants, stream, split, per_segment, heldout,
                                          heldout_split, sampling, learn, split_at)
    return {"config": {"models": vars(models), "spec": vars(spec), "learn": vars(learn), "stream": stream, "split": split,
                       "per_segment": per_segment, "max_new_tokens": max_new_tokens, "target_only": target_only,
                       "compare_every": compare_every,
                       "llama_cpp_target": llama_cpp_target, "k": spec.k, "overlap": 0.0, "heldout": heldout, "heldout_split": heldout_split,
                       "baseline_steps": "equal to the online draft's optimizer steps", "exactness": TEACHER_FORCED},
            "requests": rows, "variants": list(variants), "baselines": reports,
            "end_of_stream_alpha_on_heldout": on_heldout, "heldout_vs_control": vs_control,
            "learner": learner.stats(), "updates": learner.history,
            "metrics_by_draft_version": system.engine.metrics.snapshot()}


def _other_arms(ids, sampling, static, plain, llama_cpp) -> dict:
    """The same request decoded by the control and, when asked, the target alone (osd, llama.cpp: same eos)."""
    row = {}
    if plain is not None:
        row["target_only_tokens_per_second"] = plain.generate(ids, sampling).stats["wall_tokens_per_second"]
    if llama_cpp is not None:
        timed = llama_cpp(ids)
        row["llama_cpp_target_tokens_per_second"] = len(timed.tokens) / timed.seconds if timed.seconds else None
    b = static.generate(ids, sampling).stats
    return row | {"static_alpha": b["alpha"], "static_tokens_per_step": b["tokens_per_step"],
                  "static_tokens_per_second": b["wall_tokens_per_second"]}


WARM_UP_PROMPT = "Write a haiku about the sea."  # not from any stream


def _warm_up(online, others, llama_cpp, ids: list[int], sampling: SamplingConfig) -> None:
    """One request on every arm before the stream, not counted: cold caches and first-call allocations would
    otherwise fall on the first quarter's tokens/s. The online engine's observers (the learner among them) do
    not see it and its metrics start after it."""
    observers, request_observers = online.observers, online.request_observers
    online.observers, online.request_observers = [], []
    try:
        online.generate(ids, sampling)
    finally:
        online.observers, online.request_observers = observers, request_observers
    online.metrics.reset()
    for generate in others:
        generate(ids, sampling)
    if llama_cpp is not None:
        llama_cpp(ids)


def llama_cpp_gguf(models: ModelConfig):
    """The target's GGUF for --llama-cpp-target; refused unless the target is one (the comparison is only fair on the
    same quantized weights)."""
    from osd.models.loading import gguf_file

    gguf = gguf_file(models.target)
    if gguf is None:
        raise InvalidArgument(f"--llama-cpp-target needs a GGUF target (a .gguf file or bundled:<name>); "
                              f"{models.target!r} is not one")
    return gguf


def _add_teacher_forced_columns(rows, request_items, variants, split_at) -> None:
    """<draft>_alpha: teacher-forced greedy agreement on the request's output positions; gained / lost: paired with
    the control there. The online draft's comes from the time the request ended."""
    for row, (items, online) in zip(rows, request_items):
        row["positions"] = sum(len(it.positions) for it in items)
        if not items:
            continue
        control = acceptance_on(variants["original"], items, split=split_at)["correct"]
        correct = {name: acceptance_on(model, items, split=split_at)["correct"]
                   for name, model in variants.items() if name != "original"}
        if online is not None:
            correct["online"] = online
        row["original_alpha"] = sum(control) / len(control)
        for name, c in correct.items():
            lost, gained = paired_flips(control, c)
            row.update({f"{name}_alpha": sum(c) / len(c), f"{name}_gained": gained, f"{name}_lost": lost})


def _heldout(engine, tokenizer, variants, stream, split, per_segment, heldout, heldout_split, sampling, learn, split_at):
    """Requests of each dataset that no draft trained on, decoded by the control; every draft on their positions."""
    positions = RequestPositions(learn.top_k, learn.max_context)
    engine.observers.append(positions.observe)
    alphas, vs_control = {}, {}
    for name, own in stream_parts(stream, split):
        records = load_records(name, heldout_split or None, heldout, per_segment if heldout_split == own else 0)
        items = []
        for record in records:
            engine.generate(prompt_ids(tokenizer, record["prompt"]), sampling)
            items += positions.take()
        correct = {v: acceptance_on(model, items, split=split_at)["correct"] for v, model in variants.items()}
        alphas[name] = {v: sum(c) / max(1, len(c)) for v, c in correct.items()}
        vs_control[name] = {v: paired_difference(correct["original"], c) for v, c in correct.items() if v != "original"}
    engine.observers.remove(positions.observe)
    return alphas, vs_control


def report_live_comparison(result: dict, out: str, markdown: str, window: int = 10) -> None:
    """The fair-comparison block of a live replay: every draft against the control on the same positions (per segment,
    recovery side by side, held-out with z) and the figure of the four drafts."""
    from osd_bench.replay_fast_report import heldout_rows, plot, recovery_notes, summary

    rows = [r for r in result["requests"] if "original_alpha" in r and "online_alpha" in r]
    if not rows:
        return
    fair = {**result, "requests": rows}
    png = plot(fair, str(Path(out).with_suffix(".drafts.png")), window)
    t_rows, header = summary(fair, window)
    blocks = ["Teacher-forced greedy agreement on each request's output positions, every draft on the same positions "
              "(the online one as the request ended); gained / lost / z: paired with the control:", table(t_rows, header),
              *recovery_notes(fair, window)]
    h_rows = heldout_rows(result)
    if h_rows:
        blocks += [f"Held-out requests ({result['config']['heldout']} per dataset, decoded by the control, no draft "
                   "trained on them), paired with the control:",
                   table(h_rows, ["held-out requests of", "draft", "alpha", "vs control", "gained", "lost", "z"])]
    steps = "; ".join(f"{n}: {b['optimizer_steps']} optimizer steps on {b['items']} requests"
                      for n, b in result.get("baselines", {}).items())
    blocks += [f"online: {result['learner']['optimizer_steps']} optimizer steps, {result['learner'].get('rollbacks', 0)} "
               f"rollbacks, {result['learner'].get('resets', 0)} resets; {steps}", f"Exactness: {TEACHER_FORCED}"]
    emit_report("Online replay (`osd replay`), drafts against the control", measured_command(result),
                blocks, Path(out), markdown, plot=png)
