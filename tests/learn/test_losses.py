"""Loss properties on tiny tensors."""
import pytest
import torch

from osd.learn.compact import compress
from osd.learn.losses import LOSSES, bucket_log_probs, distill_loss, forward_kl, jsd, reverse_kl, tv_distance


def logits(seed, n=4, v=10, scale=2.0):
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("loss", LOSSES)
def test_zero_for_equal_inputs(loss):
    x = logits(0)
    assert distill_loss(x, x.clone(), loss).item() == pytest.approx(0.0, abs=1e-6)


def test_kl_directions_match_definitions():
    t, d = torch.log_softmax(logits(1), -1), torch.log_softmax(logits(2), -1)
    manual_fwd = (t.exp() * (t - d)).sum(-1)
    manual_rev = (d.exp() * (d - t)).sum(-1)
    assert torch.allclose(forward_kl(t, d), manual_fwd, atol=1e-6)
    assert torch.allclose(reverse_kl(t, d), manual_rev, atol=1e-6)
    assert not torch.allclose(manual_fwd, manual_rev)


def test_jsd_endpoints_and_symmetry():
    t, d = torch.log_softmax(logits(1), -1), torch.log_softmax(logits(2), -1)
    assert torch.allclose(jsd(t, d, 0.0), forward_kl(t, d))
    assert torch.allclose(jsd(t, d, 1.0), reverse_kl(t, d))
    assert torch.allclose(jsd(t, d, 0.5), jsd(d, t, 0.5), atol=1e-6)
    assert (jsd(t, d, 0.5) <= torch.log(torch.tensor(2.0)) + 1e-6).all()


def test_tv_is_one_minus_sum_min():
    t, d = torch.log_softmax(logits(1), -1), torch.log_softmax(logits(2), -1)
    assert torch.allclose(tv_distance(t, d), 1 - torch.minimum(t.exp(), d.exp()).sum(-1), atol=1e-6)


@pytest.mark.parametrize("loss", LOSSES)
def test_compact_target_equals_full_when_k_covers_vocab(loss):
    target, draft = logits(3), logits(4)
    full = distill_loss(draft, target, loss)
    compact = distill_loss(draft, compress(target, top_k=10), loss)
    assert compact.item() == pytest.approx(full.item(), rel=1e-4, abs=1e-5)


def test_compact_target_with_tail_is_close_for_peaked_targets():
    target, draft = logits(5, v=50, scale=6.0), logits(6, v=50)
    full = distill_loss(draft, target, "forward_kl")
    compact = distill_loss(draft, compress(target, top_k=8), "forward_kl")
    assert abs(full.item() - compact.item()) < 0.1 * full.item()


@pytest.mark.parametrize("loss", LOSSES)
def test_finite_gradients(loss):
    draft = logits(7).requires_grad_(True)
    for target in (logits(8), compress(logits(8), top_k=3)):
        value = distill_loss(draft, target, loss, mask=torch.tensor([1, 1, 0, 1]))
        (grad,) = torch.autograd.grad(value, draft)
        assert torch.isfinite(value) and torch.isfinite(grad).all() and grad.abs().sum() > 0
        assert grad[2].abs().sum() == 0  # masked position gets no gradient


def test_temperature_and_bad_arguments():
    t, d = logits(1), logits(2)
    assert distill_loss(d, t, temperature=10.0) < distill_loss(d, t, temperature=1.0)
    with pytest.raises(ValueError, match="unknown loss"):
        distill_loss(d, t, "cross_entropy")
    with pytest.raises(ValueError, match="beta"):
        distill_loss(d, t, "jsd", beta=1.5)
    tl, dl = bucket_log_probs(d, compress(t, 4))
    assert tl.shape == dl.shape == (4, 5)
