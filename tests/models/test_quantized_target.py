"""An int8 target quantized at load (--target-quantize int8, models/quantized_target.py) on tiny seeded models:
no float matrix left (and the loaded ones freed), bitwise row invariance, speculative greedy == its own target-only
greedy at every k, and the loud refusals (GGUF targets, 4-bit, bad values)."""
import gc
import weakref

import pytest
import torch
from conftest import VOCAB, tiny_qwen2
from helpers import make_engine

from osd.build import build_system, build_target
from osd.config import ModelConfig, SamplingConfig, SpeculationConfig
from osd.engine import SpeculativeEngine
from osd.errors import InvalidArgument
from osd.models.cached import CachedModel
from osd.models.quantized_target import float_matrices, quantize_target, weight_bytes
from osd.models.serving_draft import Int8Embedding, Int8Linear

PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15], [20]]
INT8 = dict(target="tiny", target_backend="torch", target_quantize="int8")


def int8_target(seed=0, tied=False, **kw):
    return build_target(ModelConfig(**INT8, **kw), tiny_qwen2(seed=seed, tied=tied))


@pytest.mark.parametrize("tied", [False, True])
def test_no_float_matrix_is_left_and_the_loaded_ones_are_freed(compiled, tied):
    model = tiny_qwen2(seed=0, tied=tied)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    refs = [weakref.ref(m.weight) for m in linears] + [weakref.ref(model.get_input_embeddings().weight)]
    before = weight_bytes(model)
    del linears
    quantized = build_target(ModelConfig(**INT8), model)
    assert quantized is model  # in place: no second model
    assert not any(type(m) is torch.nn.Linear for m in quantized.modules())
    assert sum(isinstance(m, Int8Linear) for m in quantized.modules()) == 2 * 7 + 1  # 2 layers x q,k,v,o,gate,up,down + head
    assert isinstance(quantized.get_input_embeddings(), Int8Embedding)
    assert float_matrices(quantized) == []
    assert all(m.weight_int8.dtype == torch.int8 for m in quantized.modules() if isinstance(m, Int8Linear))
    gc.collect()
    assert [r() is None for r in refs] == [True] * len(refs)  # the fp32 matrices are gone, not just unreferenced here
    assert weight_bytes(quantized) < before / 3
    if tied:  # the embedding reads the LM head's int8 rows (one copy)
        assert quantized.get_input_embeddings().weight_int8 is quantized.get_output_embeddings().weight_int8


def test_the_int8_target_computes_the_quantized_model(compiled):
    model = tiny_qwen2(seed=0)
    reference = CachedModel(model).feed(PROMPTS[1], n_logits=6)
    quantized = CachedModel(int8_target(seed=0)).feed(PROMPTS[1], n_logits=6)
    assert not torch.equal(quantized, reference)  # it did quantize ...
    assert (quantized - reference).norm() / reference.norm() < 0.05  # ... and is still the same model


def test_a_bfloat16_target_is_quantized_to_int8_with_float32_leftovers(compiled):
    model = tiny_qwen2(seed=0).to(torch.bfloat16)
    quantized = build_target(ModelConfig(**INT8, dtype="bfloat16"), model)
    assert float_matrices(quantized) == []
    assert all(t.dtype in (torch.float32, torch.int8) for t in list(quantized.parameters()) + list(quantized.buffers()))
    reference = CachedModel(tiny_qwen2(seed=0)).feed(PROMPTS[1], n_logits=3)
    assert (CachedModel(quantized).feed(PROMPTS[1], n_logits=3) - reference).norm() / reference.norm() < 0.05


def test_prepack_copy_quantizes_a_copy_and_leaves_the_given_model_alone(compiled):
    model = tiny_qwen2(seed=0, tied=True)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    quantized = build_target(ModelConfig(**INT8, prepack_copy=True), model)
    assert quantized is not model and float_matrices(quantized) == []
    assert sum(type(m) is torch.nn.Linear for m in model.modules()) == 15
    assert all(torch.equal(t, before[name]) for name, t in model.state_dict().items())


def logits_changed_by_row_count(model, context: int):
    """(k, row) pairs where verifying k + 1 rows together changed a row's logits from feeding it alone."""
    tokens = torch.randint(2, VOCAB, (context + 9,), generator=torch.Generator().manual_seed(context)).tolist()
    runner = CachedModel(model)
    runner.feed(tokens[:context])
    alone = [runner.feed([t])[0] for t in tokens[context:]]
    changed = []
    for k in range(9):
        runner.rollback(context)
        together = runner.feed(tokens[context : context + k + 1], n_logits=k + 1)
        changed += [(k, i) for i in range(k + 1) if not torch.equal(together[i], alone[i])]
    return changed


@pytest.mark.parametrize("context", [1, 30])
def test_int8_target_logits_are_bitwise_independent_of_the_rows_verified(compiled, context):
    assert logits_changed_by_row_count(int8_target(seed=0), context) == []


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_speculative_greedy_equals_the_int8_targets_own_target_only_greedy(compiled, tokenizer, k):
    target = int8_target(seed=0)
    target_only = SpeculativeEngine(target, tokenizer, None, SpeculationConfig(k=0, adaptive=False))
    # a random draft (mostly rejected) and the fp32 target itself (mostly accepted: k + 1 rows per verification)
    for draft in (tiny_qwen2(seed=1, layers=1), tiny_qwen2(seed=0)):
        engine, _ = make_engine(target, draft, tokenizer, k=k)
        for prompt in PROMPTS:
            expected = target_only.generate(prompt, SamplingConfig(max_new_tokens=40))
            result = engine.generate(prompt, SamplingConfig(max_new_tokens=40))
            assert result.token_ids == expected.token_ids, (k, prompt)
    assert max(n for _, n in result.steps) == k  # the near-copy draft had whole proposals verified at once


def test_build_system_serves_the_int8_target_on_both_paths(compiled, tokenizer, monkeypatch):
    monkeypatch.setattr("osd.build.load_tokenizer", lambda spec: tokenizer)
    system = build_system(ModelConfig(**INT8, draft=""), SpeculationConfig(k=3, adaptive=False),
                          target_model=tiny_qwen2(seed=0))
    assert system.target_model.get_input_embeddings().__class__ is Int8Embedding
    assert float_matrices(system.target_model) == []


@pytest.mark.parametrize("spec,served_by", [("/nowhere/model.gguf", "llama.cpp"),  # auto: a file the Q4 kernel cannot read
                                             ("bundled:qwen2.5-coder-1.5b", "osd")])  # auto: the Q4 kernel runs it
def test_a_gguf_target_with_int8_quantization_is_refused(spec, served_by):
    models = ModelConfig(target=spec, target_backend="auto", target_quantize="int8")
    with pytest.raises(InvalidArgument, match=f"GGUF, served by {served_by} .*--target-backend torch"):
        build_target(models)
    with pytest.raises(InvalidArgument, match="GGUF"):  # before the tokenizer or anything else loads
        build_system(models, SpeculationConfig())


@pytest.mark.parametrize("backend", ["llama.cpp", "osd"])
def test_int8_with_a_gguf_backend_is_refused_at_configuration(backend):
    with pytest.raises(InvalidArgument, match=f"the {backend} backend serves a GGUF"):
        ModelConfig(target="bundled:qwen2.5-coder-1.5b", target_backend=backend, target_quantize="int8")


def test_bad_values_and_4_bit_are_clear_errors():
    with pytest.raises(InvalidArgument, match="4-bit is not offered"):
        ModelConfig(target_quantize="int4")
    with pytest.raises(InvalidArgument, match="none or int8"):
        ModelConfig(target_quantize="fp8")
    with pytest.raises(InvalidArgument, match="none or int8"):
        quantize_target(tiny_qwen2(seed=0), "int4")


def test_the_option_is_a_cli_flag_with_its_choices(capsys):
    from osd.cli import build_parser, config_from

    assert ModelConfig().target_quantize == "none"
    args = build_parser().parse_args(["generate", "x", "--target-quantize", "int8"])
    assert config_from(args, ModelConfig).target_quantize == "int8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--target-quantize", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err


def test_the_target_output_cache_refuses_a_quantized_target():
    from osd.distill.cache import DecodeSettings
    from osd.distill.target_outputs import dataset_samples

    with pytest.raises(InvalidArgument, match="drop --target-quantize"):
        dataset_samples(ModelConfig(**INT8), "chat", "test", 1, DecodeSettings())


def test_a_model_with_other_weight_layers_is_an_error_not_a_silent_float_leftover(compiled):
    model = tiny_qwen2(seed=0)
    model.model.extra = torch.nn.Conv1d(4, 4, 1)  # a float matrix that is no nn.Linear / nn.Embedding
    with pytest.raises(InvalidArgument, match="keeps float matrices in model.extra.weight"):
        quantize_target(model, "int8")
