"""Drafts as peft adapters on one base: serving copies, create / copy / retire, memory, per-draft checkpoints."""
import pytest
import torch
from conftest import tiny_qwen2

from osd.drafts_multi import AdapterConfig, AdapterDrafts, tensor_bytes
from osd.errors import CheckpointMismatch, DraftNotFound, InvalidArgument
from osd.learn.online import LearnConfig
from osd.learn.per_draft import DraftLearners
from osd.models.serving_draft import make_serving_draft

IDS = torch.tensor([[3, 4, 5, 6, 7, 8, 9]])


def perturb(drafts, name, seed):
    """Give `name`'s adapter non-zero B matrices (as training would)."""
    g = torch.Generator().manual_seed(seed)
    with drafts.use(name), torch.no_grad():
        for p in drafts.parameters(name):
            p.add_(torch.randn(p.shape, generator=g) * 0.3)


def logits(model):
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("serving", ["adapter", "merged"])
def test_serving_copies_equal_their_master_and_leave_each_other_alone(serving):
    base_ref = tiny_qwen2(seed=1, layers=3)
    drafts = AdapterDrafts(tiny_qwen2(seed=1, layers=3), AdapterConfig(rank=4, train_layers=2, serving=serving))
    drafts.create("a")
    drafts.create("b")
    assert torch.allclose(logits(drafts.registry.get("a").model), logits(base_ref), atol=1e-5)  # fresh = the base
    perturb(drafts, "a", 0)
    snap = drafts.publish("a")
    with drafts.use("a") as master:
        expected = logits(master)
    assert snap.version == 1 and not torch.allclose(expected, logits(base_ref), atol=1e-3)
    assert torch.allclose(logits(snap.model), expected, atol=1e-4)
    assert torch.allclose(logits(drafts.registry.get("b").model), logits(base_ref), atol=1e-5)  # b untouched
    perturb(drafts, "a", 1)  # the master moves on; the published copy does not
    assert torch.allclose(logits(snap.model), expected, atol=1e-4)


def test_create_as_copy_and_retire():
    drafts = AdapterDrafts(tiny_qwen2(seed=1, layers=2), AdapterConfig(rank=4, train_layers=1))
    drafts.create("a")
    perturb(drafts, "a", 0)
    drafts.publish("a")
    drafts.create("c", copy_from="a")
    assert torch.allclose(logits(drafts.registry.get("c").model), logits(drafts.registry.get("a").model), atol=1e-5)
    assert all(torch.equal(x, y) for x, y in zip(drafts.state("a").values(), drafts.state("c").values()))
    perturb(drafts, "c", 1)  # the copy is its own adapter
    assert not all(torch.equal(x, y) for x, y in zip(drafts.state("a").values(), drafts.state("c").values()))
    drafts.retire("a")
    assert drafts.names() == ["c"] and drafts.registry.names() == ["c"]
    with pytest.raises(DraftNotFound):
        drafts.state("a")
    with pytest.raises(InvalidArgument, match="last draft"):
        drafts.retire("c")
    with pytest.raises(InvalidArgument, match="exists"):
        drafts.create("c")


def test_five_adapter_drafts_cost_well_under_one_and_a_half_drafts():
    """Bytes of distinct tensors: one draft served the usual way (fp32 master + its serving copy) against five
    adapter drafts (master + five adapters, serving base + five serving copies sharing it)."""
    make = lambda: tiny_qwen2(seed=1, layers=8, hidden=128)
    single = make()
    one = tensor_bytes(single, make_serving_draft(single)[0])
    ratios = {}
    for serving, layers in (("adapter", 2), ("merged", 1)):
        drafts = AdapterDrafts(make(), AdapterConfig(rank=4, train_layers=layers, serving=serving))
        for name in "abcde":
            drafts.create(name)
        ratios[serving] = drafts.tensor_bytes()["total"] / one
        served = [drafts.registry.get(n).model for n in "abcde"]
        shared = served[0].model.embed_tokens.weight
        assert all(m.model.embed_tokens.weight is shared for m in served)  # shared, not cloned
    assert ratios["adapter"] < 1.1, ratios  # each draft adds its adapter only
    assert ratios["merged"] < 1.5, ratios  # each draft adds its merged top layer (1/8 of the decoder layers)


def train_on(learner, drafts, name, seed):
    """Stand-in for an update: move the adapter, publish it as a new version, checkpoint."""
    perturb(drafts, name, seed)
    learner.version = drafts.publish(name).version
    learner.counters["updates_published"] += 1
    learner.save()


def test_per_draft_checkpoints_resume_independently(tmp_path):
    config = AdapterConfig(rank=4, train_layers=1)
    learn = LearnConfig(checkpoint_dir=str(tmp_path / "ckpt"), guard=False)
    drafts = AdapterDrafts(tiny_qwen2(seed=1, layers=2), config)
    for name in ("a", "b"):
        drafts.create(name)
    learners = DraftLearners(drafts, learn)
    train_on(learners.learners["a"], drafts, "a", 0)
    saved_a = drafts.state("a")
    train_on(learners.learners["b"], drafts, "b", 1)
    train_on(learners.learners["b"], drafts, "b", 2)
    saved_b = drafts.state("b")
    perturb(drafts, "a", 3)  # a moves on after its checkpoint: not saved
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["a", "b"]

    fresh = AdapterDrafts(tiny_qwen2(seed=1, layers=2), config)
    for name in ("a", "b", "c"):
        fresh.create(name)
    resumed = DraftLearners(fresh, learn)
    assert resumed.resume() == {"a": True, "b": True, "c": False}
    assert all(torch.equal(x, y) for x, y in zip(fresh.state("a").values(), saved_a.values()))
    assert all(torch.equal(x, y) for x, y in zip(fresh.state("b").values(), saved_b.values()))
    assert fresh.registry.get("a").version == 1 and fresh.registry.get("b").version == 2
    assert resumed.learners["b"].counters["updates_published"] == 2
    assert torch.allclose(logits(fresh.registry.get("c").model), logits(tiny_qwen2(seed=1, layers=2)), atol=1e-5)

    other_base = AdapterDrafts(tiny_qwen2(seed=5, layers=2), config)
    other_base.create("a")
    with pytest.raises(CheckpointMismatch):
        DraftLearners(other_base, learn).resume()


def test_pausing_the_per_draft_learners_pauses_each_and_a_draft_created_while_paused():
    drafts = AdapterDrafts(tiny_qwen2(seed=1, layers=2), AdapterConfig(rank=4, train_layers=1))
    for name in ("a", "b"):
        drafts.create(name)
    learners = DraftLearners(drafts, LearnConfig(guard=False, every_requests=1, min_positions=0))
    assert learners.pause() is True
    drafts.create("c")
    learners.add("c")
    assert learners.paused and all(learner.paused for learner in learners.learners.values())
    started = []
    for name, learner in learners.learners.items():
        learner.trigger.due = lambda *state: "requests"  # an update is due
        learner.update = lambda reason="manual", name=name: started.append(name) or {}
        assert learner.maybe_update() is None  # ... but none starts while paused
    assert started == []
    learners.unpause()
    assert not any(learner.paused for learner in learners.learners.values())
    for learner in learners.learners.values():
        learner.maybe_update()
    assert started == ["a", "b", "c"]
