"""`osd bench speed --arms osd_q4_vnni`: the same draft's int8_vnni serving copy beside the int8 one."""
from dataclasses import replace

import pytest

from osd.bench.speed import _vnni_arm
from osd.bench.tiny_pair import write_tiny_pair
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
    run = _vnni_arm(system, system.target_model, SpeculationConfig(k=3, adaptive=False), 12)
    int8, vnni = system.registry.get("default").model, system.registry.get("vnni").model
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
        _vnni_arm(system, system.target_model, spec, 8)
    assert "vnni" not in system.registry.names()
    monkeypatch.setattr(kernels, "vnni_available", lambda: True)
    system.models = replace(system.models, draft_quantize="int8_vnni")
    with pytest.raises(InvalidArgument, match="leave --draft-quantize at int8"):
        _vnni_arm(system, system.target_model, spec, 8)
