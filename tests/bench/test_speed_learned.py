"""`osd bench speed --learned-draft`: the learned draft's arm serves the checkpointed weights, beside the original."""
import copy
from types import SimpleNamespace

import pytest
import torch

from osd_bench.speed import _learned_arm, bench_prompts, build_arms
from osd_bench.tiny_pair import write_tiny_pair
from osd.build import build_system
from osd.config import ModelConfig, SpeculationConfig
from osd.errors import CheckpointMismatch, InvalidArgument
from osd.learn.online import LearnConfig, OnlineLearner


def _system(tmp_path):
    target, draft = write_tiny_pair(tmp_path)
    return build_system(ModelConfig(target=target, draft=draft, target_backend="torch", draft_quantize="none"),
                        SpeculationConfig(k=3, adaptive=False))


def _learned_checkpoint(system, directory, version=7):
    """A learner's checkpoint whose trainable weights moved away from the base draft."""
    config = LearnConfig(checkpoint_dir=str(directory), train_layers=1, guard=False)
    learner = OnlineLearner(copy.deepcopy(system.draft_master), lambda m, version=None: SimpleNamespace(version=1), config)
    with torch.no_grad():
        for p in learner.params:
            p.add_(0.05 * torch.randn_like(p))
    learner.version = version
    learner.save()
    return learner.master


def test_learned_arm_serves_the_checkpoint_and_keeps_greedy_identity(tmp_path):
    system = _system(tmp_path)
    master = _learned_checkpoint(system, tmp_path / "ckpt")
    spec = SpeculationConfig(k=3, adaptive=False)
    run = _learned_arm(system, system.target_model, spec, str(tmp_path / "ckpt"), 12)
    served = system.registry.get("learned")
    assert run.version == served.version == 7
    learned = dict(served.model.named_parameters())
    moved = [n for n, p in master.named_parameters() if p.requires_grad]
    assert moved and all(torch.equal(learned[n], dict(master.named_parameters())[n]) for n in moved)
    original = dict(system.registry.get("default").model.named_parameters())
    assert not all(torch.equal(learned[n], original[n]) for n in moved)  # the two arms really differ
    target_only = build_system(system.models, SpeculationConfig(k=0, adaptive=False), with_draft=False).engine
    ids = system.tokenizer.encode("hello world")
    from osd.config import SamplingConfig

    assert run(ids).tokens == target_only.generate(ids, SamplingConfig(max_new_tokens=12)).token_ids
    assert run.engine.metrics.total().summary()["proposed"] > 0


def test_learned_arm_refuses_a_missing_or_foreign_checkpoint(tmp_path):
    system = _system(tmp_path / "a")
    spec = SpeculationConfig(k=3, adaptive=False)
    with pytest.raises(InvalidArgument, match="no draft checkpoint"):
        _learned_arm(system, system.target_model, spec, str(tmp_path / "none"), 8)
    other = _system(tmp_path / "b")
    with torch.no_grad():  # another base draft: its frozen layers differ
        for p in other.draft_master.parameters():
            p.add_(0.1)
    _learned_checkpoint(other, tmp_path / "foreign")
    with pytest.raises(CheckpointMismatch):
        _learned_arm(system, system.target_model, spec, str(tmp_path / "foreign"), 8)


def test_bench_prompts_skip_the_trained_requests_and_refuse_none():
    first = bench_prompts(2, domains=("code",))
    later = bench_prompts(2, domains=("code",), offset=2)
    assert len(first) == len(later) == 2 and not {r["id"] for r in first} & {r["id"] for r in later}
    with pytest.raises(InvalidArgument, match="no benchmark prompts"):
        bench_prompts(2, domains=("code",), offset=10**7)


def test_learned_draft_without_the_q4_arms_is_refused(tmp_path):
    target, draft = write_tiny_pair(tmp_path)
    models = ModelConfig(target=target, draft=draft, target_backend="torch", draft_quantize="none")
    with pytest.raises(InvalidArgument, match="GGUF target"):  # a torch target has no Q4 arms: never silently dropped
        build_arms(models, SpeculationConfig(k=3, adaptive=False), 8, False, False, 2, learned_draft=str(tmp_path))
