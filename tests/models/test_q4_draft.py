"""A draft's Q4 serving copy (models/q4_draft.py, q4_quantize.py): the bytes against gguf's reference, the runner
against the float model, rows fed together against rows fed alone, and greedy identity through the engine."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import require_q4, tiny_qwen2, tiny_tokenizer

from osd.build import build_system
from osd.config import ModelConfig, SamplingConfig, SpeculationConfig
from osd.drafts import weights_fingerprint
from osd.errors import InvalidArgument
from osd.models import q4
from osd.models.q4_draft import Q4Draft, q4_serving_copy
from osd.models.q4_quantize import pad_columns, quantize_q4k, quantize_q6k, quantize_q8_0
from osd.models.q4_runner import Q4Runner, feed_together
from osd.models.serving_draft import make_serving_draft
from tests.models.tiny_gguf import assert_rows_match_one_at_a_time, logits_one_at_a_time


def _reference(raw: torch.Tensor, kind: str, shape) -> torch.Tensor:
    from gguf import GGMLQuantizationType, dequantize

    return torch.from_numpy(dequantize(raw.numpy(), GGMLQuantizationType[kind]).astype(np.float32)).reshape(shape)


def _matrix(seed: int = 0, n: int = 40, k: int = 512) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[3] = 0.0  # an all-zero row: scales 0, no division by zero
    w[5, :256] *= 0.02  # a block far smaller than the others (not so small that float16 scales underflow)
    w[7, 32:64] = torch.linspace(0.1, 0.4, 32)  # a sub-block with no negative weight (min clamps to 0)
    w[9] *= 40  # a row far larger
    return w


def test_q4k_bytes_read_back_by_ggufs_reference_within_half_a_step():
    w = _matrix()
    raw = quantize_q4k(w)
    assert raw.dtype == torch.uint8 and raw.shape == (40, 2 * 144)
    back = _reference(raw, "Q4_K", w.shape)
    sub = w.reshape(40, -1, 32)
    step = (sub.amax(-1) - sub.amin(-1).clamp(max=0)) / 15  # (N, sub-blocks): before 6-bit scales
    error = (back - w).abs().reshape(40, -1, 32).amax(-1)
    assert (error <= 0.75 * step + 1e-6).all()  # half a step, plus what the 6-bit scales lose
    assert torch.equal(back[3], torch.zeros(512))
    assert (back - w).abs().mean() < 0.3 * step.mean()


def test_q6k_bytes_read_back_by_ggufs_reference_within_half_a_step():
    w = _matrix(1)
    raw = quantize_q6k(w)
    assert raw.dtype == torch.uint8 and raw.shape == (40, 2 * 210)
    back = _reference(raw, "Q6_K", w.shape)
    step = w.reshape(40, -1, 16).abs().amax(-1) / 31
    error = (back - w).abs().reshape(40, -1, 16).amax(-1)
    assert (error <= 0.6 * step + 1e-6).all()
    assert torch.equal(back[3], torch.zeros(512))


def test_q8_0_rows_are_ggufs_own_bytes():
    """quantize_q8_0 (the Q4 copy's token table, vectorized) gives the bytes of gguf's reference quantizer, exact ties
    of the rounding (x.5 steps), all-zero blocks and a block of one large value included."""
    from gguf import GGMLQuantizationType, quantize

    w = _matrix(2, n=5000, k=96)  # more rows than one chunk of the vectorized quantizer
    w[1, :32] = torch.arange(32) - 15.5  # halves
    w[1, 31] = 127.0  # scale 1: the halves are exact ties, rounded away from zero (not to even)
    w[2, 32:64] = 0
    w[4, 5] = 1e4
    want = quantize(np.ascontiguousarray(w.numpy()), GGMLQuantizationType.Q8_0)
    got = quantize_q8_0(w)
    assert got.dtype == torch.uint8 and np.array_equal(got.numpy(), want)
    with pytest.raises(InvalidArgument, match="multiple of 32"):
        quantize_q8_0(torch.zeros(2, 40))


def test_quantizers_refuse_ragged_widths_and_non_finite_weights():
    with pytest.raises(InvalidArgument, match="multiple of 256"):
        quantize_q4k(torch.zeros(4, 300))
    w = torch.zeros(4, 256)
    w[1, 7] = float("nan")
    with pytest.raises(InvalidArgument, match="inf or NaN"):
        quantize_q6k(w)
    padded = pad_columns(torch.ones(3, 896))
    assert padded.shape == (3, 1024) and padded[:, 896:].abs().sum() == 0 and padded[:, :896].eq(1).all()


def test_the_kernel_multiplies_the_quantized_bytes_as_gguf_reads_them():
    require_q4()
    w, x = _matrix(2, n=37), torch.randn(5, 512, generator=torch.Generator().manual_seed(3))
    for kind, quantize in (("Q4_K", quantize_q4k), ("Q6_K", quantize_q6k)):
        got = q4.matmul(q4.quantize_activations(x), q4.repack(quantize(w), kind))
        want = x @ _reference(quantize(w), kind, w.shape).T
        assert got.shape == (5, 37)
        assert (got - want).abs().max() < 0.02 * want.abs().max()  # only the activations' 8-bit rounding differs


@pytest.fixture(scope="module")
def draft():
    require_q4()
    return tiny_qwen2(seed=1, layers=2, hidden=64)


def _dequantized_twin(model):
    """A copy of `model` holding exactly the weights its Q4 copy holds, read back by gguf's reference: Q4_K linears,
    a Q6_K LM head, a Q8_0 embedding (input widths padded, then the padding dropped)."""
    import copy

    from gguf import GGMLQuantizationType, quantize

    twin = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in twin.named_modules():
            if isinstance(module, torch.nn.Linear):
                kind, quantizer = ("Q6_K", quantize_q6k) if name == "lm_head" else ("Q4_K", quantize_q4k)
                w = module.weight
                padded = pad_columns(w)
                w.copy_(_reference(quantizer(padded), kind, padded.shape)[:, : w.shape[1]])
        table = twin.model.embed_tokens.weight
        raw = torch.from_numpy(quantize(table.numpy(), GGMLQuantizationType.Q8_0))
        table.copy_(_reference(raw, "Q8_0", table.shape))
    return twin


def test_the_q4_copy_computes_the_float_model_of_its_quantized_weights(draft):
    copy = q4_serving_copy(draft)
    assert isinstance(copy, Q4Draft) and copy.vocab_size == draft.config.vocab_size
    runner = copy.runner()
    assert isinstance(runner, Q4Runner) and runner.model is copy and runner.context_window == 256
    tokens = [5, 9, 2, 14, 30, 7, 7, 21, 3, 11, 40, 8]
    got = runner.feed(tokens, n_logits=len(tokens))
    want = _dequantized_twin(draft)(torch.tensor([tokens])).logits[0]
    error = (got - want).abs()
    # only the activations' 8-bit rounding per 256-block differs (the target backend's bound, test_q4_runner.py); a
    # wrong layout, padding or scale is of the order of 100% of the spread
    assert error.max() < 0.08 * want.std() and error.mean() < 0.02 * want.std(), (error.max(), want.std())
    float_logits = draft(torch.tensor([tokens])).logits[0]  # and the quantization itself: close to the float draft
    assert (got.argmax(-1) == float_logits.argmax(-1)).float().mean() >= 0.5


def test_rows_fed_together_are_bitwise_those_fed_alone(draft):
    runner = q4_serving_copy(draft).runner()
    tokens = [4, 17, 9, 33, 2, 8, 15, 21, 6, 12, 19, 25, 3, 30]
    assert_rows_match_one_at_a_time(runner, tokens, 5, logits_one_at_a_time(runner, tokens, 5))


def test_runners_fed_together_get_the_bits_of_their_own_feeds(draft):
    """Three sequences' draft forwards in one (q4_runner.feed_together, the scheduler's batched drafting): prompts of
    different lengths, then single tokens beside a catch-up; each row and each cache length as its runner alone."""
    copy = q4_serving_copy(draft)
    together, alone = [copy.runner() for _ in range(3)], [copy.runner() for _ in range(3)]
    for feeds in ([[1, 2, 3, 4, 5], [9, 8], [30, 31, 32, 33, 34, 35, 36]], [[7], [10, 11, 12], [40]], [[2], [3], [4]]):
        want = torch.cat([r.feed(f) for r, f in zip(alone, feeds)])
        got = feed_together(together, feeds)
        assert got.shape == (3, copy.vocab_size) and torch.equal(got, want)
        assert [r.length for r in together] == [r.length for r in alone]
    with pytest.raises(ValueError, match="same weights"):  # one pass over one copy's weights
        feed_together([together[0], q4_serving_copy(draft).runner()], [[1], [2]])


def test_a_publish_requantizes_the_master_and_leaves_the_published_copy_alone(draft):
    master = tiny_qwen2(seed=1, layers=2, hidden=64)
    before, _ = make_serving_draft(master, "q4")
    logits = before.runner().feed([3, 4, 5])
    mark = weights_fingerprint(before)
    with torch.no_grad():
        master.model.layers[-1].mlp.down_proj.weight.mul_(1.5)
    after, _ = make_serving_draft(master, "q4")
    assert weights_fingerprint(after) != mark and weights_fingerprint(before) == mark
    assert torch.equal(before.runner().feed([3, 4, 5]), logits)
    assert not torch.equal(after.runner().feed([3, 4, 5]), logits)


def test_a_publish_quantizes_an_unchanged_embedding_once_and_a_changed_one_again(draft, monkeypatch):
    """The learner does not train the token table (trainable no_embeddings): each publish reuses its Q8_0 rows; a
    table changed in place (trainable all) is quantized again, so a copy never serves stale rows."""
    import osd.models.q4_draft as q4_draft

    master = tiny_qwen2(seed=1, layers=2, hidden=64)
    calls = []
    monkeypatch.setattr(q4_draft, "quantize_q8_0", lambda t: calls.append(1) or quantize_q8_0(t))
    first, _ = make_serving_draft(master, "q4")
    second, _ = make_serving_draft(master, "q4")
    assert len(calls) == 1 and second.weights.embd is first.weights.embd
    with torch.no_grad():
        master.get_input_embeddings().weight[3].mul_(2.0)
    third, _ = make_serving_draft(master, "q4")
    assert len(calls) == 2
    assert np.array_equal(third.weights.embd, quantize_q8_0(master.get_input_embeddings().weight).numpy())
    assert not np.array_equal(third.weights.embd, first.weights.embd)


def test_a_publish_reuses_the_frozen_layers_quantized_matrices_and_requantizes_the_trained_one(monkeypatch):
    """Layers the learner does not train (train_layers 1: all but the last) and the head keep their kernel weights
    across publishes; a layer changed in place gets new ones, and the copy serves what a fresh build serves."""
    import osd.models.q4_draft as q4_draft

    require_q4()
    master = tiny_qwen2(seed=1, layers=2, hidden=64)
    first, _ = make_serving_draft(master, "q4")
    with torch.no_grad():
        master.model.layers[-1].self_attn.o_proj.weight.mul_(1.5)
    second, _ = make_serving_draft(master, "q4")
    same = lambda name: second.weights.matrices[name][0] is first.weights.matrices[name][0]  # noqa: E731
    assert same("blk.0.qkv") and same("blk.0.gate_up") and same("output")
    assert not same("blk.1.attn_output") and same("blk.1.qkv")  # per matrix: only what changed
    monkeypatch.setattr(q4_draft, "_UNCHANGED", {})  # nothing to reuse: everything quantized afresh
    fresh, _ = make_serving_draft(master, "q4")
    assert torch.equal(second.runner().feed([3, 4, 5]), fresh.runner().feed([3, 4, 5]))
    assert not torch.equal(first.runner().feed([3, 4, 5]), fresh.runner().feed([3, 4, 5]))


def test_an_unsupported_draft_is_refused_with_the_reason():
    """(Every family's refusals: test_q4_draft_families.py.)"""
    from transformers import Phi3Config, Phi3ForCausalLM

    phi3 = Phi3ForCausalLM(Phi3Config(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, pad_token_id=0))
    with pytest.raises(InvalidArgument, match="runs qwen2, llama, qwen3 and gemma3 drafts .*a 'phi3' model"):
        q4_serving_copy(phi3)
    with pytest.raises(InvalidArgument, match="head dim 8"):
        q4_serving_copy(tiny_qwen2(seed=0, layers=1, hidden=32))
    with pytest.raises(InvalidArgument, match="draft_quantize must be one of"):
        ModelConfig(draft_quantize="q3")


def test_speculation_with_a_q4_draft_keeps_greedy_identity(tmp_path):
    require_q4()
    for name in ("target", "draft"):  # the draft is the target itself: its 4-bit copy agrees often, not always
        model = tiny_qwen2(seed=0, hidden=64)
        model.save_pretrained(tmp_path / name)
        tiny_tokenizer().save_pretrained(tmp_path / name)
    system = build_system(ModelConfig(target=str(tmp_path / "target"), draft=str(tmp_path / "draft"),
                                      target_backend="torch", draft_quantize="q4"), SpeculationConfig(k=3, adaptive=False))
    assert isinstance(system.registry.get("default").model, Q4Draft)
    target_only = build_system(system.models, SpeculationConfig(k=0, adaptive=False), with_draft=False).engine
    for text in ("hello world", "the quick brown fox"):
        ids = system.tokenizer.encode(text)
        result = system.engine.generate(ids, SamplingConfig(max_new_tokens=20))
        assert result.token_ids == target_only.generate(ids, SamplingConfig(max_new_tokens=20)).token_ids
    stats = system.engine.metrics.total().summary()
    assert stats["proposed"] > 0 and 0 < stats["accepted"] < stats["proposed"]  # rejections were exercised too


def test_online_learning_publishes_q4_copies_and_output_stays_the_targets(tmp_path):
    """The learner trains the float master; each publish builds a new Q4 copy from it (build.System.publish_draft),
    the next request drafts with it, and no update changes an output."""
    require_q4()
    from osd.build import attach_learner
    from osd.learn.online import LearnConfig

    for name in ("target", "draft"):
        tiny_qwen2(seed=0 if name == "target" else 1, hidden=64).save_pretrained(tmp_path / name)
        tiny_tokenizer().save_pretrained(tmp_path / name)
    system = build_system(ModelConfig(target=str(tmp_path / "target"), draft=str(tmp_path / "draft"),
                                      target_backend="torch", draft_quantize="q4"), SpeculationConfig(k=3, adaptive=False))
    learner = attach_learner(system, LearnConfig(mode="all", every_requests=2, trainable="all", train_layers=0,
                                                 guard=False, drift_guard=False, lr=1e-2, steps_per_update=4,
                                                 batch_size=4, average=0.0))
    target_only = build_system(system.models, SpeculationConfig(k=0, adaptive=False), with_draft=False).engine
    try:
        for text in ("abc abc", "the cat", "a bad cab", "dead beef", "ace of cab", "bead"):
            ids = system.tokenizer.encode(text)
            got = system.engine.generate(ids, SamplingConfig(max_new_tokens=16)).token_ids
            assert got == target_only.generate(ids, SamplingConfig(max_new_tokens=16)).token_ids
    finally:
        learner.stop()
    snap = system.registry.get("default")
    assert learner.counters["updates_published"] >= 2 and snap.version >= 2
    assert isinstance(snap.model, Q4Draft)
    served = {key.split("@v")[1] for key in system.engine.metrics.snapshot()}
    assert len(served) >= 2  # requests drafted with more than one published version


def test_auto_serves_the_copy_that_times_faster_here_and_publishes_that_kind_later(tmp_path, monkeypatch):
    """--draft-quantize auto (the default): for a draft the Q4 kernel runs, both copies are built and timed and the
    faster serves; the choice is named in the system's config, so a later publish (the learner's) builds the same
    kind. A draft it cannot run (head dim 8) serves int8 untimed; a routed system's adapter drafts keep int8."""
    require_q4()
    from osd.models.serving_draft import resolve_quantize
    from osd.propose import copy_choice
    from osd.route.config import RouteConfig

    assert ModelConfig().draft_quantize == "auto"
    assert resolve_quantize("auto", tiny_qwen2(seed=1, hidden=64)) == "q4"
    assert resolve_quantize("auto", tiny_qwen2(seed=1, hidden=32)) == "int8"
    assert resolve_quantize("int8", tiny_qwen2(seed=1, hidden=64)) == "int8"  # what is asked, as given
    for name, hidden in (("target", 64), ("draft", 64), ("narrow", 32)):
        tiny_qwen2(seed=0 if name == "target" else 1, hidden=hidden).save_pretrained(tmp_path / name)
        tiny_tokenizer().save_pretrained(tmp_path / name)
    models = ModelConfig(target=str(tmp_path / "target"), draft=str(tmp_path / "draft"), target_backend="torch")
    spec = SpeculationConfig(k=3, adaptive=False)
    real = copy_choice.forward_seconds
    for slower, want in (("int8", Q4Draft), ("q4", torch.nn.Module)):  # the measured seconds, one copy's made 10x
        monkeypatch.setattr(copy_choice, "forward_seconds", lambda runners, vocab, **kw: {
            q: t * (10 if q == slower else 1) for q, t in real(runners, vocab, **kw).items()})
        system = build_system(models, spec)
        chosen = "q4" if slower == "int8" else "int8"
        assert system.models.draft_quantize == chosen and set(system.draft_copy_seconds) == {"q4", "int8"}
        served = system.registry.get("default").model
        assert isinstance(served, want) and (chosen == "q4") == isinstance(served, Q4Draft)
        system.publish_draft()  # a later publish builds the kind chosen
        assert (chosen == "q4") == isinstance(system.registry.get("default").model, Q4Draft)
    monkeypatch.setattr(copy_choice, "forward_seconds", real)
    seconds = copy_choice.forward_seconds({"q4": q4_serving_copy(tiny_qwen2(seed=1, hidden=64)).runner()}, 48, rounds=3)
    assert 0 < seconds["q4"] < 1
    narrow = build_system(replace(models, draft=str(tmp_path / "narrow")), spec)
    assert narrow.models.draft_quantize == "int8" and not narrow.draft_copy_seconds
    routed = build_system(models, spec, route=RouteConfig(drafts="a,b"))
    assert routed.models.draft_quantize == "int8"
