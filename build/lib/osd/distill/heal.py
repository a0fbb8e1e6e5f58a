"""Healing a derived draft (models/derived.py): distil the target into it on training text, resumably.

Data: the train splits of the datasets, each prompt through the chat template followed by an answer:
  reference  the record's reference answer + the end-of-turn token; the target scores every answer position in one
             prefill (`runner.feed(prompt + answer[:-1], n_logits=len(answer))`); records without one are skipped
  target     the target's own greedy answer: one decode per token (several times slower than scoring a
             reference), but the contexts are the ones the draft meets while serving
Teacher: the target as it serves (a GGUF on llama.cpp for the bundled pair; any runner, e.g. a tiny torch model in
tests). Its distribution at every answer position is kept compactly (top-K + tail, learn/compact.py) in a disk cache
keyed by teacher, prompt, answer mode (and reference), so epochs and reruns never recompute it.
Loss: forward KL(target || draft) over the draft's vocabulary map: the target's mass outside the map is dropped and
the rest renormalised (models/vocab_map.py). Trainable: "lora" = adapters on every kept linear and the head, plus
the RMSNorm scales (a few MB: shippable); "full" = kept layers, norms and head (the embedding stays frozen).
Resumable: distill/trainer.py's checkpoints (weights, optimizer, position) every `save_every` steps under
<out>/heal-state; rerunning the same command continues. Deterministic for a seed and a thread count.
Held-out alpha: greedy agreement with the target's own greedy answers to test prompts (distill/evaluate.py).
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from osd.distill.cache import TargetSample
from osd.distill.teacher import greedy_answer, greedy_answers, score_answer  # noqa: F401 - heal's API too
from osd.errors import InvalidArgument
from osd.learn.compact import CompactDist, compress

ANSWERS = ("reference", "target")
MODES = ("lora", "full")


@dataclass
class HealConfig:
    # text sources to distil on, comma list: the train split unless an entry names its split and slice
    # (models/derived.py parse_text_source: multilingual_qa@de:test[300:400])
    datasets: str = "gsm8k,spider,code"
    limit: int = 300  # records per entry (file order)
    answers: str = "target"  # reference | target: what follows each prompt (see the module doc)
    max_prompt_tokens: int = 384  # longer prompts are skipped
    max_answer_tokens: int = 128  # answers are cut here (a reference keeps its <|im_end|> only when it fits)
    top_k: int = 64  # target distribution kept per position (top-K + tail)
    trainable: str = "lora"  # lora | full
    lora_rank: int = 16
    lora_alpha: float = 32.0
    epochs: int = 3
    lr: float = 1e-3  # AdamW; LoRA adapters want ~1e-3, a full fine-tune ~1e-4
    batch_size: int = 8  # samples per optimizer step
    save_every: int = 20  # optimizer steps between resumable checkpoints
    seed: int = 0  # LoRA initialisation and batch order
    eval_datasets: str = "code,gsm8k,spider,chat"  # held-out alpha: prompts of these (test split unless named)
    eval_limit: int = 2  # prompts per eval dataset (0 = no evaluation)
    eval_tokens: int = 32  # target greedy tokens per eval prompt

    def __post_init__(self):
        if self.answers not in ANSWERS:
            raise InvalidArgument(f"answers must be one of {ANSWERS}, got {self.answers!r}")
        if self.trainable not in MODES:
            raise InvalidArgument(f"trainable must be one of {MODES}, got {self.trainable!r}")
        if min(self.limit, self.max_prompt_tokens, self.max_answer_tokens, self.top_k, self.lora_rank, self.epochs,
               self.batch_size, self.save_every, self.eval_tokens) <= 0 or self.lr <= 0:
            raise InvalidArgument("limit, token limits, top_k, lora_rank, epochs, batch_size, save_every, eval_tokens "
                                  "and lr must be > 0")
        if self.eval_limit < 0:
            raise InvalidArgument(f"eval_limit must be >= 0, got {self.eval_limit}")


# ---- the teacher: the target's distribution at every answer position -------------------------------------------

class TeacherStore:
    """Teacher samples on disk: one safetensors file per (teacher, prompt, answer mode, reference, limits), atomic."""

    def __init__(self, root: str | Path, fingerprint: str):
        self.root = Path(root) / fingerprint

    def path(self, prompt: list[int], mode: str, reference: list[int] | None, top_k: int, max_tokens: int) -> Path:
        blob = json.dumps([list(prompt), mode, reference, top_k, max_tokens])
        key = hashlib.sha256(blob.encode()).hexdigest()
        return self.root / key[:2] / f"{key}.safetensors"

    def get(self, path: Path) -> TargetSample | None:
        if not path.exists():
            return None
        t = load_file(str(path))
        return TargetSample(t["prompt_ids"].tolist(), t["response_ids"].tolist(),
                            CompactDist(t["top_ids"].long(), t["top_probs"].float()))

    def put(self, path: Path, sample: TargetSample) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file({"prompt_ids": torch.tensor(sample.prompt_ids, dtype=torch.int32),
                   "response_ids": torch.tensor(sample.response_ids, dtype=torch.int32),
                   "top_ids": sample.target.ids.to(torch.int32).contiguous(),
                   "top_probs": sample.target.probs.float().contiguous()}, str(tmp))
        os.replace(tmp, path)


@dataclass
class Request:
    """One prompt to get a teacher sample for: reference answer ids, or None (the target answers)."""
    prompt: list[int]
    reference: list[int] | None
    max_tokens: int


def end_of_turn_id(tokenizer) -> int | None:
    """The token the chat template closes an assistant turn with (<|im_end|> for Qwen2.5, whose tokenizer's own
    eos_token is <|endoftext|>), or the tokenizer's EOS when the template does not show one."""
    from osd.data import chat_ids

    try:
        prompt = chat_ids(tokenizer, [{"role": "user", "content": "hi"}])
        full = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
                                             add_generation_prompt=False, tokenize=True)
        full = list(full["input_ids"] if isinstance(full, dict) else full)
        answer = list(tokenizer("ok", add_special_tokens=False)["input_ids"])
        end = len(prompt) + len(answer)
        if full[: len(prompt)] == prompt and full[len(prompt) : end] == answer and len(full) > end:
            return int(full[end])
    except (TypeError, ValueError, KeyError, AttributeError):
        pass
    return tokenizer.eos_token_id


def build_requests(tokenizer, records: list[dict], mode: str, max_prompt_tokens: int, max_tokens: int,
                   eos_id: int | None) -> list[Request]:
    """Chat-templated prompts (+ reference answers ending in EOS, cut at max_tokens); too-long prompts skipped."""
    from osd.data import prompt_ids

    out = []
    for record in records:
        prompt = prompt_ids(tokenizer, str(record["prompt"]))
        if len(prompt) > max_prompt_tokens:
            continue
        if mode == "target":
            out.append(Request(prompt, None, max_tokens))
        elif record.get("reference"):
            answer = list(tokenizer(str(record["reference"]), add_special_tokens=False)["input_ids"])
            answer = (answer + ([eos_id] if eos_id is not None else []))[:max_tokens]
            out.append(Request(prompt, answer, max_tokens))
    return out


def teacher_samples(store: TeacherStore, open_runner, requests: list[Request], top_k: int, eos_ids: set[int],
                    progress=None, say=print, slots: int = 8) -> list[TargetSample]:
    """Samples for the requests in order; only missing ones reach the target (opened lazily by `open_runner()`).
    Target answers decode `slots` at a time on osd's Q4 runner (greedy_answers). Each sample is stored as it ends.

    Prints an estimate of the time left once a few samples are done; the progress bar counts tokens."""
    paths = [store.path(r.prompt, "reference" if r.reference else "target", r.reference, top_k, r.max_tokens)
             for r in requests]
    missing = [i for i, p in enumerate(paths) if not p.exists()]
    if missing:
        runner, total = open_runner(), sum(len(requests[i].reference or []) or requests[i].max_tokens for i in missing)
        bar = progress(total=total, desc="teacher", unit="tok") if progress else None
        start, done, stored = time.perf_counter(), 0, 0

        def put(i: int, sample: TargetSample) -> None:
            nonlocal done, stored
            store.put(paths[i], sample)
            done, stored = done + len(sample.response_ids), stored + 1
            if bar is not None:
                bar.update(len(requests[i].reference or []) or requests[i].max_tokens)
            if stored == min(4 * max(slots, 1), len(missing)):
                rate = done / (time.perf_counter() - start)
                say(f"[osd] teacher: {len(missing)} of {len(requests)} samples to score at ~{rate:.0f} tokens/s: "
                    f"~{(total - done) / rate / 60:.1f} min left for this step (at most; greedy answers may stop early)")

        for i in (i for i in missing if requests[i].reference):
            r = requests[i]
            put(i, TargetSample(r.prompt, r.reference, score_answer(runner, r.prompt, r.reference, top_k)))
        answers = [i for i in missing if not requests[i].reference]
        for j, answer, dist in greedy_answers(runner, [requests[i].prompt for i in answers],
                                              [requests[i].max_tokens for i in answers], eos_ids, top_k, slots):
            put(answers[j], TargetSample(requests[answers[j]].prompt, answer, dist))
        if bar is not None:
            bar.close()
    return [store.get(p) for p in paths]


def teacher_fingerprint(target_spec: str, runner_kind: str, top_k: int) -> str:
    """A GGUF is named by file name and size (bundled ones are sha256-checked on assembly); other specs by spec."""
    from osd.models.loading import gguf_file

    gguf = gguf_file(target_spec) if isinstance(target_spec, str) else None
    ident = [gguf.name, gguf.stat().st_size] if gguf is not None else [str(target_spec)]
    return hashlib.sha256(json.dumps([ident, runner_kind, top_k]).encode()).hexdigest()[:16]


# ---- the student: what trains -------------------------------------------------------------------------------------

def heal_trainable(model, config: HealConfig) -> list[torch.nn.Parameter]:
    """Freeze everything, then open the trainable part; returns it (LoRA adapters are seeded by config.seed)."""
    from osd.models.derived import add_lora, norm_parameters

    model.requires_grad_(False)
    if config.trainable == "lora":
        torch.manual_seed(config.seed)
        add_lora(model, config.lora_rank, config.lora_alpha)
        for name, p in model.named_parameters():
            p.requires_grad_("lora_" in name)
    else:
        model.model.layers.requires_grad_(True)
        model.lm_head.requires_grad_(True)
    for p in norm_parameters(model):
        p.requires_grad_(True)
    return [p for p in model.parameters() if p.requires_grad]


def trained_delta(model) -> dict[str, torch.Tensor]:
    """The trainable tensors by name (what derived.safetensors ships)."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def distill_config(config: HealConfig):
    """The DistillTrainer settings of a heal (its checkpoints compare them on resume)."""
    from osd.distill.trainer import DistillConfig

    return DistillConfig(loss="forward_kl", epochs=config.epochs, lr=config.lr, batch_size=config.batch_size,
                         trainable="lora" if config.trainable == "lora" else "all", train_layers=0,
                         lora_rank=config.lora_rank, save_every=config.save_every, shuffle_seed=config.seed)


def alpha_on(draft, samples: list[TargetSample], max_tokens: int) -> dict | None:
    from osd.distill.run import evaluate_draft

    if not samples:
        return None
    out = evaluate_draft(draft, samples, k=4, max_new_tokens=max_tokens)
    return {k: out[k] for k in ("requests", "positions", "alpha_greedy", "acceptance_greedy", "tokens_per_step_greedy",
                                "alpha_sampling_t1")}


def vocab_coverage(draft, samples: list[TargetSample]) -> float | None:
    """Share of the target's answer tokens the draft's vocabulary map holds (the ceiling of greedy alpha)."""
    from osd.models.vocab_map import vocab_ids_of

    ids = [t for s in samples for t in s.response_ids]
    vocab_ids = vocab_ids_of(draft)
    if not ids or vocab_ids is None:
        return None
    inside = torch.zeros(int(draft.config.vocab_size), dtype=torch.bool)
    inside[vocab_ids] = True
    return float(inside[torch.tensor(ids)].float().mean())


def time_one_step(trainer, items) -> float:
    """Seconds of one forward + backward on a batch, gradients discarded (for the printed estimate)."""
    from osd.learn.batch import items_loss

    start = time.perf_counter()
    trainer.draft.train()
    items_loss(trainer.draft, items[: trainer.config.batch_size]).backward()
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.draft.eval()
    return time.perf_counter() - start


def heal(draft, samples: list[TargetSample], config: HealConfig, state_dir: str | Path | None, progress=None,
         say=print) -> dict:
    """Train `draft` (a freshly derived, untrained one) in place on teacher samples; resumes from state_dir."""
    from osd.distill.evaluate import sample_item
    from osd.distill.trainer import DistillTrainer

    if not samples:
        raise InvalidArgument("no training samples: check the datasets, their train split and --limit")
    params = heal_trainable(draft, config)
    trainer = DistillTrainer(draft, distill_config(config), state_dir, params=params)
    resumed = trainer.resume()
    items = [sample_item(s) for s in samples]
    steps_per_epoch = -(-len(items) // config.batch_size)
    left = steps_per_epoch * config.epochs - trainer.step
    if left > 0:
        per_step = time_one_step(trainer, items)
        say(f"[osd] heal: {len(items)} samples, {left} optimizer steps left of {steps_per_epoch * config.epochs} "
            f"(~{per_step:.1f} s each: ~{left * per_step / 60:.1f} min)" + (" (resumed)" if resumed else ""))
    start = time.perf_counter()
    losses = trainer.fit(lambda epoch: samples, progress, items_cache={})
    return {"resumed": resumed, "optimizer_steps": trainer.step, "skipped_nonfinite": trainer.skipped_nonfinite,
            "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
            "loss_by_epoch": [sum(h["losses"]) / max(1, len(h["losses"])) for h in trainer.history],
            "train_seconds": time.perf_counter() - start}


# ---- end to end: `osd draft heal` / `osd draft build` -----------------------------------------------------------

def check_same_run(out: Path, config: HealConfig) -> None:
    """A rerun continues a heal only with the same settings (the samples and step count depend on all of them)."""
    path = out / "heal-config.json"
    if path.exists() and (out / "heal-state").exists() and json.loads(path.read_text()) != asdict(config):
        raise InvalidArgument(f"{out} holds a heal with other settings ({path}); use another --out, or delete "
                              f"{out / 'heal-state'} to start this one afresh")
    path.write_text(json.dumps(asdict(config), indent=2))


def open_target(target_spec: str, threads: int = 0, backend: str = "auto"):
    """The target as it serves (build.target_backend): for "auto", a GGUF (bundled:<name> or .gguf) on osd's Q4 kernel
    where it runs the file, else on llama.cpp; any other spec a torch model. On the Q4 kernel, greedy answers decode
    several prompts at once (teacher_samples)."""
    from osd.build import build_target
    from osd.config import ModelConfig

    return build_target(ModelConfig(target=target_spec, threads=threads, prepack_target=False, target_backend=backend))


def run_heal(out_dir: str | Path, config: HealConfig, target_spec: str, derive=None, threads: int = 0,
             cache_dir: str | Path | None = None, progress=None, target=None, tokenizer=None, say=print,
             teacher_backend: str = "auto", teacher_slots: int = 8) -> dict:
    """Derive (when <out> holds no draft yet, from `derive`: a DeriveConfig), heal, write the delta into <out>.

    target/tokenizer: given objects instead of loading `target_spec` (tests pass tiny in-process models).
    teacher_backend: the target's runner (open_target); its name keys the teacher cache, as its outputs may differ
    at near-ties. teacher_slots: target answers decoded together on the osd backend (bitwise as alone)."""
    from osd.build import target_backend
    from osd.config import ModelConfig
    from osd.distill.cache import default_cache_root
    from osd.models.derived import RECIPE, build_derived, load_derived, read_recipe, save_derived, source_records
    from osd.models.loading import load_tokenizer
    from osd.models.runner import as_runner, eos_ids_of

    out = Path(out_dir)
    started = time.perf_counter()
    if not (out / RECIPE).exists():
        if derive is None:
            raise InvalidArgument(f"{out} holds no derived draft: run `osd draft derive --out {out}` first")
        say(f"[osd] deriving a draft from {derive.base} (layers {derive.layers}, vocabulary {derive.vocab}) ...")
        model, recipe = build_derived(derive, tokenizer=tokenizer)
        save_derived(out, model, recipe)
        del model
    recipe = read_recipe(f"derived:{out}")
    if derive is not None and recipe["derive"] != asdict(derive):
        raise InvalidArgument(f"{out} holds a draft derived with other settings ({recipe['derive']}); "
                              "use another --out")
    check_same_run(out, config)
    tokenizer = tokenizer or load_tokenizer(recipe["derive"]["base"])
    draft = load_derived(f"derived:{out}", with_delta=False)
    runner_cell = {}

    def open_runner():
        if "runner" not in runner_cell:
            runner_cell["runner"] = as_runner(target if target is not None
                                              else open_target(target_spec, threads, teacher_backend))
        return runner_cell["runner"]

    kind = target_backend(ModelConfig(target=target_spec, target_backend=teacher_backend))
    store = TeacherStore(cache_dir or Path(default_cache_root()).with_name("teacher-heal"),
                         teacher_fingerprint(target_spec, kind, config.top_k))
    eos_ids = eos_ids_of(getattr(draft, "generation_config", None), draft.config, tokenizer)
    train_records = source_records(config.datasets, "train", config.limit)
    requests = build_requests(tokenizer, train_records, config.answers, config.max_prompt_tokens, config.max_answer_tokens,
                              end_of_turn_id(tokenizer))
    eval_records = source_records(config.eval_datasets, "test", config.eval_limit) if config.eval_limit else []
    eval_requests = build_requests(tokenizer, eval_records, "target", config.max_prompt_tokens, config.eval_tokens, None)
    eval_samples = teacher_samples(store, open_runner, eval_requests, config.top_k, eos_ids, progress, say, teacher_slots)
    samples = teacher_samples(store, open_runner, requests, config.top_k, eos_ids, progress, say, teacher_slots)
    teacher_seconds = time.perf_counter() - started
    before = alpha_on(draft, eval_samples, config.eval_tokens)
    metrics = heal(draft, samples, config, out / "heal-state", progress, say)
    after = alpha_on(draft, eval_samples, config.eval_tokens)
    trained = {"mode": config.trainable, "lora_rank": config.lora_rank, "lora_alpha": config.lora_alpha,
               "heal": asdict(config), "target": target_spec, "teacher_backend": kind, "samples": len(samples),
               "answer_tokens": sum(len(s.response_ids) for s in samples)}
    metrics.update({"samples": len(samples), "eval_before": before, "eval_after": after,
                    "eval_vocab_coverage": vocab_coverage(draft, eval_samples), "teacher_seconds": teacher_seconds,
                    "seconds": time.perf_counter() - started})
    save_derived(out, draft, {k: v for k, v in recipe.items() if k != "trained"}, trained_delta(draft),
                 {**trained, "metrics": {k: v for k, v in metrics.items() if k != "loss_by_epoch"}})
    (out / "heal-metrics.json").write_text(json.dumps(metrics, indent=2, default=str))
    return metrics
