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


@pytest.mark.parametrize("temperature", [0.5, 2.0])
@pytest.mark.parametrize("loss", LOSSES)
def test_tempered_compact_target_equals_tempered_full_when_k_covers_vocab(loss, temperature):
    """--loss-temperature tempers a compact (stored) target too, not only the draft."""
    target, draft = logits(3), logits(4)
    full = distill_loss(draft, target, loss, temperature=temperature)
    compact = distill_loss(draft, compress(target, top_k=10), loss, temperature=temperature)
    assert compact.item() == pytest.approx(full.item(), rel=1e-4, abs=1e-5)


def exact_tempered_buckets(target_logits, ids, temperature):
    """Reference: temper the full distribution, then bucket it (listed tokens + the summed rest)."""
    probs = torch.softmax(target_logits / temperature, -1)
    listed = probs.gather(-1, ids)
    return torch.cat([listed, (1 - listed.sum(-1, keepdim=True)).clamp_min(0)], -1)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_tempered_compact_tail_is_exact_for_a_flat_tail_and_bounded_as_stated_otherwise(temperature):
    from osd.learn.compact import tempered_log_buckets

    v, k = 50, 6
    flat = logits(9, v=v, scale=3.0)
    top = flat.topk(k, -1)
    flat = torch.full_like(flat, float(top.values.min()) - 2.0).scatter(-1, top.indices, top.values)  # flat tail
    dist = compress(flat, top_k=k)
    approx = tempered_log_buckets(dist, temperature, v).exp()
    assert torch.allclose(approx, exact_tempered_buckets(flat, dist.ids, temperature), atol=1e-5)
    uneven = logits(10, v=v, scale=3.0)
    dist = compress(uneven, top_k=k)
    approx_tail = tempered_log_buckets(dist, temperature, v).exp()[:, -1]
    exact_tail = exact_tempered_buckets(uneven, dist.ids, temperature)[:, -1]
    if temperature > 1:  # a flat tail is the flattest: tempering above 1 spreads it the most
        assert (approx_tail >= exact_tail - 1e-6).all() and (approx_tail > exact_tail).any()
    else:
        assert (approx_tail <= exact_tail + 1e-6).all() and (approx_tail < exact_tail).any()


def test_temperature_one_keeps_the_stored_compact_target():
    target, draft = logits(11, v=20), logits(12, v=20)
    dist = compress(target, top_k=5)
    target_logp, _ = bucket_log_probs(draft, dist, temperature=1.0)
    assert torch.equal(target_logp, torch.log(torch.cat([dist.probs, dist.tail.clamp_min(1e-10)[:, None]], -1)))


def test_compress_on_the_compiled_kernel_equals_torchs_softmax_and_topk():
    """learn/compact.py compress runs rows_linear.cpp softmax_top_k (the learner compresses every verified position in
    the serving thread): the same ids best first and the same probabilities as torch's softmax + topk, to rounding,
    on strided rows and on a vocabulary not a multiple of 8; ties keep the lower id; k = V keeps every token."""
    from osd.learn.compact import compress
    from osd.models import kernels

    module = kernels.load()
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 1003, generator=g) * 4
    many = torch.randn(11, 1003, generator=g)  # 8 rows and more run across threads, fewer on the calling thread
    for rows in (logits, logits[1::2], logits[:0], many):  # strided rows (a view, as StepRecord rows are); no rows
        want = torch.topk(torch.softmax(rows, -1), 17, -1)
        got = compress(rows, 17)
        assert torch.equal(got.ids, want.indices)
        assert torch.allclose(got.probs, want.values, rtol=1e-5, atol=1e-7)
    ids, probs = module.softmax_top_k(torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 7.0, 0.0, 0.0, 0.0, 3.0, 9.0]]), 4)
    assert ids.tolist() == [[10, 5, 1, 2]]  # 9, 7, then the 3.0s by id
    assert torch.allclose(probs, torch.softmax(torch.tensor([1.0, 3, 3, 2, 3, 7, 0, 0, 0, 3, 9]), -1)[[10, 5, 1, 2]][None])
    whole = compress(logits[:2], 5000)  # top_k beyond V: the whole distribution, sorted
    assert whole.ids.shape == (2, 1003) and torch.allclose(whole.probs.sum(-1), torch.ones(2))
    assert torch.equal(whole.ids, torch.sort(torch.softmax(logits[:2], -1), stable=True, dim=-1, descending=True).indices)


def test_mapped_buckets_equal_the_buckets_of_logits_expanded_to_the_target_vocabulary():
    """A restricted head measured over its own columns (mapped_bucket_log_probs) gets the buckets, and so the TV, of
    its logits expanded to the target's vocabulary with -inf outside the map: listed tokens outside the map (row 1),
    a row with none inside (row 2), and tokens of the map that are not listed (the tail) included."""
    from osd.learn.compact import CompactDist
    from osd.learn.losses import bucket_log_probs, mapped_bucket_log_probs, tv_distance
    from osd.models.vocab_map import expand_logits, target_to_draft

    g = torch.Generator().manual_seed(0)
    vocab, vocab_ids = 50, torch.tensor([0, 3, 4, 7, 10, 11, 20, 33, 41, 49])
    logits = torch.randn(3, len(vocab_ids), generator=g) * 2
    ids = torch.tensor([[3, 7, 20, 5], [4, 6, 8, 41], [1, 2, 5, 6]])  # row 2: no listed token inside the map
    probs = torch.tensor([[0.4, 0.3, 0.1, 0.1], [0.5, 0.2, 0.1, 0.05], [0.3, 0.3, 0.2, 0.1]])
    target = CompactDist(ids, probs)
    want_t, want_d = bucket_log_probs(expand_logits(logits, vocab_ids, vocab), target)
    got_t, got_d = mapped_bucket_log_probs(logits, target, target_to_draft(vocab_ids, vocab))
    torch.testing.assert_close(got_t, want_t)
    assert torch.equal(torch.isinf(got_d), torch.isinf(want_d))
    torch.testing.assert_close(got_d.exp(), want_d.exp())
    torch.testing.assert_close(tv_distance(got_t, got_d), tv_distance(want_t, want_d))
    assert tv_distance(got_t, got_d)[2] > 0.99 * (1 - 0.1)  # row 2: the draft's mass all in the tail bucket


@pytest.mark.parametrize("loss", LOSSES)
def test_a_repeated_id_with_no_mass_changes_no_loss_and_leaves_gradients_finite(loss):
    """restrict_compact (a draft with its own vocabulary map) and CompactDist.cat's padding list a token again with
    probability 0: the loss must be the loss without the repeats. Before repeats were emptied on the draft's side,
    every distance but forward KL counted the draft's probability of that token once per repeat (the first listed
    token, mostly the target's choice) and pushed it down: a live learner with reverse KL, JSD or TV had every
    update rejected by its guard."""
    from osd.learn.compact import CompactDist

    draft = logits(5, n=3, v=12).requires_grad_(True)
    ids, probs = torch.tensor([[2, 7, 1], [4, 0, 9], [3, 5, 8]]), torch.tensor([[0.6, 0.2, 0.1], [0.5, 0.3, 0.1],
                                                                               [0.4, 0.4, 0.1]])
    plain = distill_loss(draft, CompactDist(ids, probs), loss)
    repeated = CompactDist(torch.cat([ids, ids[:, :1].repeat(1, 3)], -1), torch.cat([probs, torch.zeros(3, 3)], -1))
    with_repeats = distill_loss(draft, repeated, loss)
    assert with_repeats.item() == pytest.approx(plain.item(), rel=1e-5, abs=1e-6)
    with_repeats.backward()
    assert torch.isfinite(draft.grad).all()


@pytest.mark.parametrize("loss", LOSSES)
def test_every_loss_moves_a_mapped_draft_towards_the_target_restricted_to_its_map(loss):
    """A draft over a vocabulary map learns the target restricted to it (items_loss's path): gradient steps on any
    loss raise the draft's probability of the target's first in-map token, whatever the listed tokens outside the
    map."""
    from osd.learn.compact import CompactDist
    from osd.models.vocab_map import restrict_compact, target_to_draft

    vocab, vocab_ids = 50, torch.tensor([0, 3, 4, 7, 10, 11, 20, 33, 41, 49])
    target = CompactDist(torch.tensor([[5, 20, 3, 6], [4, 8, 41, 2]]), torch.tensor([[0.3, 0.4, 0.2, 0.05],
                                                                                     [0.5, 0.2, 0.2, 0.05]]))
    restricted = restrict_compact(target, target_to_draft(vocab_ids, vocab))
    best = torch.tensor([6, 2])  # draft ids of target tokens 20 and 4
    draft = torch.zeros(2, len(vocab_ids), requires_grad=True)
    start = torch.softmax(draft, -1)[torch.arange(2), best].detach()
    optimizer = torch.optim.SGD([draft], lr=1.0)
    for _ in range(100):
        optimizer.zero_grad()
        distill_loss(draft, restricted, loss).backward()
        optimizer.step()
    after = torch.softmax(draft, -1)[torch.arange(2), best]
    assert (after > start + 0.1).all() and (torch.softmax(draft, -1).argmax(-1) == best).all()
