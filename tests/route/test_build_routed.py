"""`--drafts a,b` wiring: build_system makes adapter drafts and a routed proposer; attach_learner one learner per draft."""
import pytest

from osd_bench.tiny_pair import write_tiny_pair
from osd.build import attach_learner, build_system
from osd.config import ModelConfig, SamplingConfig, SpeculationConfig
from osd.errors import InvalidArgument
from osd.learn.online import LearnConfig
from osd.learn.per_draft import DraftLearners
from osd.route import pinned
from osd.route.config import RouteConfig


def models(tmp_path, **kw):
    target, draft = write_tiny_pair(tmp_path)
    return ModelConfig(target=target, draft=draft, target_backend="torch", draft_quantize="none", **kw)


def test_build_system_with_drafts_routes_and_learns_per_draft(tmp_path):
    route = RouteConfig(drafts="x,y", adapter_layers=1, score_share=1.0, score_time_share=1e9)
    system = build_system(models(tmp_path), SpeculationConfig(k=4, adaptive=False), route=route)
    assert system.routing is not None and system.routing.names() == ["x", "y"]
    assert system.registry.names() == ["x", "y"]  # both published, sharing the draft model's weights
    learners = attach_learner(system, LearnConfig(checkpoint_dir=str(tmp_path / "ckpt"), guard=False, every_requests=1))
    assert isinstance(learners, DraftLearners) and sorted(learners.learners) == ["x", "y"]
    ids = system.tokenizer.encode("hello")
    with pinned("y"):
        result = system.engine.generate(ids, SamplingConfig(max_new_tokens=8))
    assert result.draft[0] == "y" and learners.learners["y"].stats()["requests"] == 1
    assert learners.learners["x"].stats()["requests"] == 0
    assert system.routing.feedback.counters["scored"] == 1
    learners.stop()
    assert (tmp_path / "ckpt" / "y" / "state.json").exists()


def test_without_drafts_nothing_changes_and_lookup_with_drafts_is_refused(tmp_path):
    system = build_system(models(tmp_path), SpeculationConfig(k=4), route=RouteConfig())
    assert system.routing is None and system.registry.names() == ["default"]
    with pytest.raises(InvalidArgument, match="lookup"):
        build_system(models(tmp_path), SpeculationConfig(k=4, lookup=True), route=RouteConfig(drafts="x,y"))
