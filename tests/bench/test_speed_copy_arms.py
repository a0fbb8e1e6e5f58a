"""`osd bench speed --arms osd_q4_vnni,osd_q4_q4draft`: another serving copy of the same draft beside the int8 one."""
from dataclasses import replace

import pytest

from conftest import require_q4, tiny_qwen2, tiny_tokenizer

from osd_bench.speed import _copy_arm
from osd_bench.tiny_pair import write_tiny_pair
from osd.build import build_system
from osd.config import ModelConfig, SamplingConfig, SpeculationConfig
from osd.errors import InvalidArgument
from osd.models import kernels
from osd.models.serving_draft import Int8Linear


def _system(tmp_path, quantize="int8"):
    target, draft = write_tiny_pair(tmp_path)
    return build_system(ModelConfig(target=target, draft=draft, target_backend="torch", draft_quantize=quantize),
                        SpeculationConfig(k=3, adaptive=False))


def test_vnni_arm_serves_the_same_draft_with_int8_activations_and_keeps_greedy_identity(tmp_path, compiled):
    if not kernels.vnni_available():
        pytest.skip("int8_vnni needs a CPU with AVX-512 VNNI")
    system = _system(tmp_path)
    run = _copy_arm(system, system.target_model, SpeculationConfig(k=3, adaptive=False), 12, "osd_q4_vnni")
    int8, vnni = system.registry.get("default").model, system.registry.get("int8_vnni").model
    linears = [m for m in vnni.modules() if isinstance(m, Int8Linear)]
    assert linears and all(m.vnni for m in linears)
    assert not any(m.vnni for m in int8.modules() if isinstance(m, Int8Linear))  # the int8 arm is untouched
    target_only = build_system(system.models, SpeculationConfig(k=0, adaptive=False), with_draft=False).engine
    ids = system.tokenizer.encode("hello world")
    assert run(ids).tokens == target_only.generate(ids, SamplingConfig(max_new_tokens=12)).token_ids
    assert run.engine.metrics.total().summary()["proposed"] > 0


def test_vnni_arm_is_refused_without_vnni_or_against_a_vnni_draft(tmp_path, compiled, monkeypatch):
    system = _system(tmp_path / "a")
    spec = SpeculationConfig(k=3, adaptive=False)
    monkeypatch.setattr(kernels, "vnni_available", lambda: False)
    with pytest.raises(InvalidArgument, match="AVX-512 VNNI"):
        _copy_arm(system, system.target_model, spec, 8, "osd_q4_vnni")
    assert "int8_vnni" not in system.registry.names()
    monkeypatch.setattr(kernels, "vnni_available", lambda: True)
    system.models = replace(system.models, draft_quantize="int8_vnni")
    with pytest.raises(InvalidArgument, match="give --draft-quantize int8"):
        _copy_arm(system, system.target_model, spec, 8, "osd_q4_vnni")


def test_q4_copy_arm_drafts_with_the_4_bit_copy_and_keeps_greedy_identity(tmp_path):
    require_q4()
    from osd.models.q4_draft import Q4Draft

    for name in ("target", "draft"):  # head dim 16: the Q4 glue's smallest
        tiny_qwen2(seed=0, hidden=64).save_pretrained(tmp_path / name)
        tiny_tokenizer().save_pretrained(tmp_path / name)
    system = build_system(ModelConfig(target=str(tmp_path / "target"), draft=str(tmp_path / "draft"),
                                      target_backend="torch", draft_quantize="int8"), SpeculationConfig(k=3, adaptive=False))
    run = _copy_arm(system, system.target_model, SpeculationConfig(k=3, adaptive=False), 12, "osd_q4_q4draft")
    assert isinstance(system.registry.get("q4").model, Q4Draft)
    assert not isinstance(system.registry.get("default").model, Q4Draft)  # the int8 arm is untouched
    target_only = build_system(system.models, SpeculationConfig(k=0, adaptive=False), with_draft=False).engine
    ids = system.tokenizer.encode("abc cab")
    assert run(ids).tokens == target_only.generate(ids, SamplingConfig(max_new_tokens=12)).token_ids
    assert run.engine.metrics.total().summary()["proposed"] > 0
    default = build_system(replace(system.models, draft_quantize="q4"), SpeculationConfig(k=3, adaptive=False))
    with pytest.raises(InvalidArgument, match="give --draft-quantize int8"):
        _copy_arm(default, default.target_model, SpeculationConfig(k=3, adaptive=False), 8, "osd_q4_q4draft")
