"""Healing a derived draft on tiny in-process models: the teacher is exact and cached, healing lowers the held-out
KL and raises greedy agreement (seeded), and a run cut short resumes to the weights of an uncut run."""
import json
import random
from dataclasses import asdict

import pytest
import torch
from conftest import EOS, ToyTokenizer, tiny_qwen2
from helpers import plain_greedy
from safetensors.torch import load_file

from osd.distill.evaluate import sample_item
from osd.distill.heal import (HealConfig, TeacherStore, build_requests, end_of_turn_id, greedy_answer, run_heal,
                              score_answer)
from osd.errors import InvalidArgument
from osd.learn.batch import items_loss
from osd.learn.compact import compress
from osd.models.cached import CachedModel
from osd.models.derived import DeriveConfig, derive_model, save_derived
from osd.models.loading import load_model

MAP = torch.tensor(sorted({0, EOS} | set(range(2, 40))))  # 40 of the 48 ids: a few target tokens fall outside
ALPHABET = ToyTokenizer.alphabet


def write_dataset(path, n_train, n_test, seed=0):
    rng = random.Random(seed)
    text = lambda: "".join(rng.choice(ALPHABET[2:30]) for _ in range(rng.randrange(2, 6)))
    with open(path, "w") as f:
        for i in range(n_train + n_test):
            split = "train" if i < n_train else "test"
            f.write(json.dumps({"id": f"toy-{split}-{i}", "prompt": text(), "reference": text() * 2, "split": split}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny target, a derived draft directory cut from another tiny model, a toy dataset."""
    root = tmp_path_factory.mktemp("heal")
    base = tiny_qwen2(seed=1, layers=3)
    base.save_pretrained(root / "base")
    draft = derive_model(load_model(str(root / "base")), [0, 2], MAP)
    recipe = {"derive": asdict(DeriveConfig(base=str(root / "base"), layers="0,2", vocab=len(MAP)))}
    return {"root": root, "target": tiny_qwen2(seed=0, layers=2), "recipe": recipe, "draft": draft,
            "data": write_dataset(root / "toy.jsonl", 64, 16)}


def fresh_draft_dir(world, name):
    out = world["root"] / name
    save_derived(out, world["draft"], world["recipe"])
    return out


def config(world, **kw):
    base = dict(datasets=world["data"], limit=64, answers="target", max_answer_tokens=12, top_k=16, lora_rank=4,
                lora_alpha=8.0, epochs=6, lr=2e-2, batch_size=8, save_every=4, eval_datasets=world["data"], eval_limit=16,
                eval_tokens=12)
    return HealConfig(**{**base, **kw})


def heal(world, out, cfg, cache="teacher", target="given", progress=None):
    return run_heal(out, cfg, "tiny-target", target=world["target"] if target == "given" else target,
                    tokenizer=ToyTokenizer(), cache_dir=world["root"] / cache, progress=progress, say=lambda s: None)


def test_the_teacher_is_the_target_itself(world):
    target = world["target"]
    runner, prompt = CachedModel(target), [5, 9, 2, 7]
    answer, dist = greedy_answer(runner, prompt, 10, {EOS}, 16)
    plain = plain_greedy(target, prompt, 10, eos=EOS)  # (without its EOS; greedy_answer keeps it)
    assert answer[: len(plain)] == plain and answer[len(plain):] in ([], [EOS])
    forced = target(torch.tensor([prompt + answer[:-1]])).logits[0, len(prompt) - 1 :]
    assert torch.equal(dist.ids, compress(forced, 16).ids)
    assert torch.allclose(dist.probs, compress(forced, 16).probs, atol=1e-5)
    scored = score_answer(runner, prompt, answer, 16)  # one prefill gives every position
    assert torch.equal(scored.ids, dist.ids) and torch.allclose(scored.probs, dist.probs, atol=1e-5)


def test_requests_skip_long_prompts_and_end_references_with_eos():
    tok = ToyTokenizer()
    records = [{"prompt": "abc", "reference": "de"}, {"prompt": "a" * 50, "reference": "x"}, {"prompt": "b"}]
    refs = build_requests(tok, records, "reference", 20, 8, EOS)
    assert [r.reference for r in refs] == [tok.encode("de") + [EOS]]  # no reference: skipped; long prompt: skipped
    assert len(build_requests(tok, records, "target", 20, 8, EOS)) == 2
    assert build_requests(tok, [{"prompt": "a", "reference": "xyzxyz"}], "reference", 20, 4, EOS)[0].reference == tok.encode("xyzx")


class TurnTokenizer(ToyTokenizer):
    """A chat template that closes assistant turns with "T" (as Qwen's closes them with <|im_end|>)."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, **kw):
        text = "".join(f"${m['role'][0]}{m['content']}" + ("T" if m["role"] == "assistant" else "") for m in messages)
        text += "$a" if add_generation_prompt else ""
        return self.encode(text) if tokenize else text


def test_references_end_with_the_templates_end_of_turn_token():
    assert end_of_turn_id(TurnTokenizer()) == ToyTokenizer().encode("T")[0]
    assert end_of_turn_id(ToyTokenizer()) == EOS  # no closing token in the template: the tokenizer's EOS


def held_out_kl(world, draft_spec_or_model, samples):
    draft = load_model(draft_spec_or_model) if isinstance(draft_spec_or_model, str) else draft_spec_or_model
    with torch.no_grad():
        return float(items_loss(draft, [sample_item(s) for s in samples]))


@pytest.mark.parametrize("trainable,lr", [("lora", 2e-2), ("full", 3e-3)])
def test_healing_lowers_held_out_kl_and_raises_greedy_agreement(world, trainable, lr):
    out = fresh_draft_dir(world, f"healed-{trainable}")
    metrics = heal(world, out, config(world, trainable=trainable, lr=lr))
    before, after = metrics["eval_before"]["alpha_greedy"], metrics["eval_after"]["alpha_greedy"]
    assert after > before + 0.15, (before, after)
    assert metrics["loss_by_epoch"][-1] < 0.7 * metrics["loss_by_epoch"][0]
    store = TeacherStore(world["root"] / "teacher", next(p.name for p in (world["root"] / "teacher").iterdir()))
    cfg = config(world)
    tok = ToyTokenizer()
    from osd.data import load_records

    requests = build_requests(tok, load_records(world["data"], "test", 16), "target", cfg.max_prompt_tokens, cfg.eval_tokens, None)
    held_out = [store.get(store.path(r.prompt, "target", None, cfg.top_k, r.max_tokens)) for r in requests]
    assert held_out_kl(world, f"derived:{out}", held_out) < 0.8 * held_out_kl(world, world["draft"], held_out)
    recipe = json.loads((out / "derived.json").read_text())
    assert recipe["trained"]["mode"] == trainable and recipe["trained"]["samples"] == 64
    delta = load_file(str(out / "derived.safetensors"))
    if trainable == "lora":  # adapters and norms only: small
        assert all("lora_" in k or "norm" in k for k in delta if k.startswith("delta."))


def test_the_teacher_cache_serves_a_rerun_without_the_target(world):
    out = fresh_draft_dir(world, "cached-run")
    heal(world, out, config(world, epochs=1))
    again = fresh_draft_dir(world, "cached-rerun")
    heal(world, again, config(world, epochs=1), target=None)  # "tiny-target" cannot load: every sample is cached
    first, second = load_file(str(out / "derived.safetensors")), load_file(str(again / "derived.safetensors"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


class Cut(Exception):
    pass


def cutting_progress(after_steps):
    """A progress factory whose training bar raises after `after_steps` updates (a run killed mid-epoch)."""
    count = {"n": 0}

    class Bar:
        def __init__(self, total=None, initial=0, desc="", **kw):
            self.training = desc.startswith("distill")

        def update(self, n=1):
            if self.training:
                count["n"] += 1
                if count["n"] >= after_steps:
                    raise Cut()

        def set_postfix(self, **kw):
            pass

        def close(self):
            pass

    return Bar


def test_a_cut_run_resumes_to_the_weights_of_an_uncut_run(world):
    cfg = config(world, epochs=2, save_every=3)  # 8 steps per epoch: checkpoints at 3, 6, 8, 9, 12, ...
    uncut = fresh_draft_dir(world, "uncut")
    heal(world, uncut, cfg)
    cut = fresh_draft_dir(world, "cut")
    with pytest.raises(Cut):
        heal(world, cut, cfg, progress=cutting_progress(11))  # dies in step 11; the last checkpoint is step 9
    state = json.loads((cut / "heal-state" / "state.json").read_text())
    assert state["step"] == 9
    metrics = heal(world, cut, cfg)
    assert metrics["resumed"] and metrics["optimizer_steps"] == 16
    a, b = load_file(str(uncut / "derived.safetensors")), load_file(str(cut / "derived.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(InvalidArgument, match="other settings"):
        heal(world, cut, config(world, epochs=2, save_every=3, lr=1e-2))
    with pytest.raises(InvalidArgument, match="other settings"):
        heal(world, cut, config(world, epochs=2, save_every=3, limit=32))  # other samples: not the same run


def test_heal_config_is_validated():
    with pytest.raises(InvalidArgument):
        HealConfig(answers="mine")
    with pytest.raises(InvalidArgument):
        HealConfig(trainable="half")
    with pytest.raises(InvalidArgument):
        HealConfig(lr=0)
