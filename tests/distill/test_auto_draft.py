"""`--draft auto` on a tiny seeded target on disk: the draft is derived from the target itself and healed (with a
progress bar), cached (a second build trains nothing), reloaded (the same weights), served losslessly (greedy output
== target-only) and learned online; the draft choice is said at startup; an architecture the recipe cannot cut is
a named error."""
import json
import random

import pytest
import torch
from conftest import tiny_qwen2, tiny_tokenizer

import osd.distill.auto as auto
from osd.build import attach_learner, build_system, choose_draft, resolve_draft
from osd.config import ModelConfig, SamplingConfig, SpeculationConfig
from osd.distill.auto import AutoDraftConfig, ensure_auto_draft, kept_layers
from osd.distill.heal import HealConfig
from osd.errors import InvalidArgument
from osd.learn.online import LearnConfig
from osd.models.loading import load_model

CHARS = "abcdefghijklmnopqrstuvwxyz ."  # all in conftest.TOKENIZER_CHARS


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("auto")
    tiny_qwen2(seed=0, layers=4).save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    rng = random.Random(0)
    with open(root / "toy.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"id": f"t{i}", "split": "train" if i < 32 else "test",
                                "prompt": "".join(rng.choice(CHARS) for _ in range(8))}) + "\n")
    data = str(root / "toy.jsonl")
    config = AutoDraftConfig(keep=2, vocab=32, vocab_datasets=data, heal=HealConfig(
        datasets=data, limit=32, max_answer_tokens=8, top_k=16, lora_rank=4, lora_alpha=8.0, epochs=2, lr=1e-2,
        batch_size=8, eval_datasets=data, eval_limit=4, eval_tokens=8))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OSD_CACHE", str(root / "cache"))
        yield {"root": root, "target": str(root / "target"), "config": config}


def models(world, **kw):
    return ModelConfig(target=world["target"], target_backend="torch", prepack_target=False, draft_quantize="none",
                       **kw)


class Bars:
    """A tqdm stand-in that records each bar's description."""

    def __init__(self):
        self.descs = []

    def __call__(self, total=None, desc="", **kw):
        self.descs.append(desc)
        return self

    def update(self, n=1): ...

    def set_postfix(self, **kw): ...

    def close(self): ...


def test_kept_layers_are_the_first_and_the_last():
    assert kept_layers(28, 2) == [0, 27] and kept_layers(24, 4) == [0, 1, 22, 23] and kept_layers(4, 3) == [0, 2, 3]
    assert kept_layers(2, 4) == [0, 1]


def test_auto_builds_caches_reloads_serves_and_learns(world, capsys):
    bars, lines = Bars(), []
    made = ensure_auto_draft(world["target"], config=world["config"], progress=bars, say=lines.append)
    assert made.built and made.layers == "0,3" and made.depth == 4 and made.vocab == 32
    assert any(d == "teacher" for d in bars.descs) and any(d.startswith("distill epoch") for d in bars.descs)
    assert any("deriving a draft from the target" in line for line in lines)
    where = made.spec.split(":", 1)[1]
    recipe = json.loads(open(f"{where}/derived.json").read())
    assert recipe["derive"]["base"] == world["target"] and recipe["trained"]["mode"] == "lora"
    assert recipe["trained"]["metrics"]["optimizer_steps"] == 8  # 32 samples / 8 a batch x 2 epochs
    first = load_model(made.spec)

    again_bars = Bars()  # a second start: the cache, no teacher and no training
    again = ensure_auto_draft(world["target"], config=world["config"], progress=again_bars, say=lines.append)
    assert not again.built and again.spec == made.spec and again_bars.descs == []
    reloaded = load_model(again.spec)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), reloaded.state_dict().values()))
    ids = torch.tensor([[2, 5, 9, 14]])
    assert torch.equal(first(ids).logits, reloaded(ids).logits)

    capsys.readouterr()
    system = build_system(models(world, draft="auto"), SpeculationConfig(k=3, adaptive=False),
                          auto_draft=world["config"])
    assert system.models.draft == made.spec
    assert f"[osd] draft: {made.spec} (--draft auto: layers 0,3" in capsys.readouterr().err
    plain = build_system(models(world, draft="none"), SpeculationConfig(k=0), with_draft=False)
    prompts = [[2, 5, 9, 14], [7, 7, 3, 20, 11], [30, 4, 4]]
    for prompt in prompts:  # lossless: the derived draft never changes the greedy output
        result = system.engine.generate(prompt, SamplingConfig(max_new_tokens=16))
        assert result.token_ids == plain.engine.generate(prompt, SamplingConfig(max_new_tokens=16)).token_ids
        assert result.counters.proposed > 0

    learner = attach_learner(system, LearnConfig(mode="all", every_requests=0, lr=1e-3, steps_per_update=2,
                                                 batch_size=4, trainable="all", train_layers=0, guard=False))
    try:
        for prompt in prompts * 2:
            system.engine.generate(prompt, SamplingConfig(max_new_tokens=16))
        before = {k: v.clone() for k, v in system.draft_master.state_dict().items()}
        learner.update("test")
        assert system.registry.get("default").version >= 1  # a new version of the auto draft was published
        after = system.draft_master.state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before)
    finally:
        learner.stop()


def test_another_recipe_or_another_target_builds_anew(world):
    first = auto.auto_dir(world["target"], world["config"])[0]
    other = AutoDraftConfig(keep=1, vocab=32, vocab_datasets=world["config"].vocab_datasets, heal=world["config"].heal)
    assert auto.auto_dir(world["target"], other)[0] != first
    root = world["root"]
    tiny_qwen2(seed=5, layers=4).save_pretrained(root / "other")
    tiny_tokenizer().save_pretrained(root / "other")
    assert auto.auto_dir(str(root / "other"), world["config"])[0] != first


def test_the_startup_line_says_which_draft_and_why(world):
    tokenizer = tiny_tokenizer()
    spec = SpeculationConfig(k=4)
    chosen, spec_out, why = choose_draft(models(world), spec, tokenizer, None)  # the default, another tokenizer
    assert chosen.draft == "" and spec_out.lookup and "shipped draft" in why and "--draft auto" in why
    chosen, spec_out, why = choose_draft(models(world, draft="none"), spec, tokenizer, None)
    assert chosen.draft == "" and spec_out.lookup
    chosen, spec_out, why = choose_draft(models(world, draft="/some/draft"), spec, tokenizer, None)
    assert chosen.draft == "/some/draft" and not spec_out.lookup and why == "given by --draft"
    resolved, spec_out = resolve_draft(models(world), spec)  # `osd serve --replicas`: resolved once, up front
    assert resolved.draft == "" and spec_out.lookup
    system = build_system(models(world), SpeculationConfig(k=3, adaptive=False))  # lookup only: outputs unchanged
    plain = build_system(models(world, draft="none"), SpeculationConfig(k=0), with_draft=False)
    prompt = [2, 5, 2, 5, 2, 5, 2]
    result = system.engine.generate(prompt, SamplingConfig(max_new_tokens=16))
    assert system.draft_master is None and system.spec.lookup
    assert result.token_ids == plain.engine.generate(prompt, SamplingConfig(max_new_tokens=16)).token_ids


def test_a_target_reading_the_shipped_drafts_tokenizer_keeps_it(world, monkeypatch):
    import osd.build as build

    class Qwen25Like:
        def get_vocab(self):
            return {f"t{i}": i for i in range(build.QWEN25_TOKENS)}

    tokenizer = Qwen25Like()
    monkeypatch.setattr(build, "load_tokenizer", lambda spec: tokenizer)  # the shipped draft reads the same tokens
    chosen, spec, why = choose_draft(models(world), SpeculationConfig(k=4), tokenizer, None)
    assert chosen.draft == build.SHIPPED_DRAFT and not spec.lookup and "reads its tokenizer" in why
    with pytest.raises(InvalidArgument, match="--drafts adapts a draft model, and there is none here"):
        from osd.route.config import RouteConfig

        build_system(models(world, draft="none"), SpeculationConfig(k=3), route=RouteConfig(drafts="a,b"))


def test_a_command_that_loads_weights_refuses_a_draft_choice():
    for choice in ("auto", "none"):
        with pytest.raises(InvalidArgument, match=f"--draft {choice} is resolved where a serving system is built"):
            load_model(choice)


def test_an_architecture_the_recipe_cannot_cut_is_named(world, tmp_path):
    config = json.loads(open(f"{world['target']}/config.json").read())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))
    with pytest.raises(InvalidArgument, match="cannot derive a draft from a 'mamba' target"):
        ensure_auto_draft(str(tmp_path), config=world["config"], say=lambda line: None)
    import gguf  # a GGUF says its architecture in its metadata: refused before any weights load

    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "rwkv6")
    writer.add_block_count(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    with pytest.raises(InvalidArgument, match="cannot derive a draft from a 'rwkv6' target: the derived recipe cuts "
                                              "qwen2, llama, qwen3, gemma3 decoders"):
        ensure_auto_draft(str(tmp_path / "m.gguf"), config=world["config"], say=lambda line: None)


def test_auto_on_a_gguf_target_heals_on_the_served_target_and_stays_lossless(tmp_path, monkeypatch):
    """A tiny synth-gguf Qwen2 file served by osd's Q4 backend: converted once to fp32 to cut the draft, the teacher
    is the Q4 runner itself, and speculative greedy output equals the backend's target-only output."""
    from conftest import require_module, require_q4

    require_module("llama_cpp")
    require_q4()
    from osd.data import prompt_ids
    from osd_bench.synth_gguf import Shape, synth_gguf

    monkeypatch.setenv("OSD_CACHE", str(tmp_path / "cache"))
    gguf = synth_gguf(Shape("qwen2", 256, 512, 4, 4, 2, 64, 1024, 512, 1e4, 1e-6, False), out=tmp_path / "t.gguf",
                      threads=1, say=lambda line: None)
    config = AutoDraftConfig(keep=2, vocab=512, vocab_datasets="gsm8k", heal=HealConfig(
        datasets="gsm8k", limit=8, max_answer_tokens=8, top_k=16, lora_rank=4, lora_alpha=8.0, epochs=1, lr=1e-2,
        batch_size=8, eval_limit=0))
    system = build_system(ModelConfig(target=str(gguf), draft="auto", n_ctx=512), SpeculationConfig(k=3, adaptive=False),
                          auto_draft=config)
    assert type(system.target_model).__name__ == "Q4Runner" and system.models.draft.startswith("derived:")
    plain = build_system(ModelConfig(target=str(gguf), draft="none", n_ctx=512), SpeculationConfig(k=0),
                         with_draft=False)
    for prompt in ("What is 2 + 3?", "select all rows"):
        ids = prompt_ids(system.tokenizer, prompt)
        result = system.engine.generate(ids, SamplingConfig(max_new_tokens=12))
        assert result.token_ids == plain.engine.generate(ids, SamplingConfig(max_new_tokens=12)).token_ids
        assert result.counters.proposed > 0


def tiny_family(arch: str):
    """A tiny seeded Llama, Qwen3 or Gemma3 (sliding and full attention layers) with conftest's 48-token vocabulary."""
    from conftest import EOS
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)

    config, model, extra = {"llama": (LlamaConfig, LlamaForCausalLM, {}),
                            "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 8}),
                            "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, {
                                "head_dim": 8, "sliding_window": 4,
                                "layer_types": ["sliding_attention", "full_attention"] * 2})}[arch]
    torch.manual_seed(0)
    return model(config(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=None,
                        pad_token_id=0, **extra)).eval()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_auto_cuts_and_serves_the_other_families(world, tmp_path, arch):
    tiny_family(arch).save_pretrained(tmp_path / arch)
    tiny_tokenizer().save_pretrained(tmp_path / arch)
    config = AutoDraftConfig(keep=2, vocab=32, vocab_datasets=world["config"].vocab_datasets, heal=HealConfig(
        datasets=world["config"].heal.datasets, limit=16, max_answer_tokens=8, top_k=16, lora_rank=4, lora_alpha=8.0,
        epochs=1, lr=1e-2, batch_size=8, eval_limit=0))
    target = ModelConfig(target=str(tmp_path / arch), target_backend="torch", prepack_target=False, draft="auto",
                         draft_quantize="int8")
    system = build_system(target, SpeculationConfig(k=3, adaptive=False), auto_draft=config)
    assert len(system.draft_master.model.layers) == 2
    plain = build_system(ModelConfig(target=str(tmp_path / arch), target_backend="torch", prepack_target=False),
                         SpeculationConfig(k=0), with_draft=False)
    prompt = [2, 5, 9, 14]
    result = system.engine.generate(prompt, SamplingConfig(max_new_tokens=12))
    assert result.token_ids == plain.engine.generate(prompt, SamplingConfig(max_new_tokens=12)).token_ids
    assert result.counters.proposed > 0
