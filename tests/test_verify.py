"""Acceptance rules on hand-built logits and distributions."""
import pytest
import torch

from osd.verify import acceptance_beta, greedy_verify, rejection_verify, warp_probs


def one_hot_logits(ids, vocab=6):
    logits = torch.full((len(ids), vocab), -5.0)
    logits[torch.arange(len(ids)), torch.tensor(ids)] = 5.0
    return logits


@pytest.mark.parametrize("target_ids,draft_ids,n_acc,next_tok", [
    ([1, 2, 3, 4], [1, 2, 3], 3, 4),  # all accepted: bonus is the target's last argmax
    ([1, 2, 3, 4], [1, 5, 3], 1, 2),  # mismatch at 1: recovered = target argmax there
    ([1, 2, 3, 4], [0, 2, 3], 0, 1),  # first token rejected
    ([3], [], 0, 3),                  # k = 0: plain target step
])
def test_greedy_verify_exact_cases(target_ids, draft_ids, n_acc, next_tok):
    out = greedy_verify(one_hot_logits(target_ids), torch.tensor(draft_ids, dtype=torch.long))
    assert (out.n_accepted, out.next_token) == (n_acc, next_tok)


def test_rejection_accepts_when_draft_equals_target():
    probs = torch.softmax(torch.randn(4, 6, generator=torch.Generator().manual_seed(0)), -1)
    tokens = torch.tensor([0, 1, 2])
    for seed in range(20):
        out = rejection_verify(probs, probs[:3], tokens, torch.Generator().manual_seed(seed))
        assert out.n_accepted == 3


def test_rejection_rejects_impossible_token_and_recovers_from_residual():
    target = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    draft = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    for seed in range(20):
        out = rejection_verify(target, draft, torch.tensor([0]), torch.Generator().manual_seed(seed))
        assert out.n_accepted == 0 and out.next_token in (1, 2)


def test_rejection_never_accepts_a_token_the_target_cannot_emit_even_at_u_zero(monkeypatch):
    """torch.rand draws from [0, 1): u = 0 occurs (about once in 2^24 draws), and u * q <= p would then accept a token
    of target probability 0; the rule is strict."""
    import osd.verify.acceptance as acceptance

    monkeypatch.setattr(acceptance.torch, "rand", lambda *shape, generator=None: torch.zeros(*shape))
    target = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    draft = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    out = rejection_verify(target, draft, torch.tensor([0]))
    assert out.n_accepted == 0 and out.next_token in (1, 2)


def test_rejection_sampling_first_token_follows_target_distribution():
    g = torch.Generator().manual_seed(0)
    target = torch.softmax(torch.randn(2, 5, generator=g) * 2, -1)
    draft = torch.softmax(torch.randn(1, 5, generator=g) * 2, -1)
    counts = torch.zeros(5)
    n = 20000
    for _ in range(n):
        token = int(torch.multinomial(draft[0], 1, generator=g))
        out = rejection_verify(target, draft, torch.tensor([token]), g)
        counts[token if out.n_accepted == 1 else out.next_token] += 1
    assert (counts / n - target[0]).abs().max() < 0.015


def test_beta_is_one_minus_total_variation():
    p = torch.tensor([[0.5, 0.5, 0.0]])
    q = torch.tensor([[0.25, 0.25, 0.5]])
    assert acceptance_beta(p, q).item() == pytest.approx(1 - 0.5 * (p - q).abs().sum().item())


def test_warp_probs_top_k_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.allclose(warp_probs(logits, 1.0, top_k=2), torch.tensor([0.625, 0.375, 0, 0]), atol=1e-6)
    assert torch.allclose(warp_probs(logits, 1.0, top_p=0.7), torch.tensor([0.625, 0.375, 0, 0]), atol=1e-6)
    assert torch.allclose(warp_probs(logits, 1.0, top_p=0.5), torch.tensor([1.0, 0, 0, 0]), atol=1e-6)
    assert torch.allclose(warp_probs(logits, 1.0), torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=1e-6)


def test_warp_probs_min_p_drops_tokens_below_a_share_of_the_likeliest():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    # 0.35 x 0.5 = 0.175: 0.15 and 0.05 go
    assert torch.allclose(warp_probs(logits, 1.0, min_p=0.35), torch.tensor([0.625, 0.375, 0, 0]), atol=1e-6)
    assert torch.allclose(warp_probs(logits, 1.0, min_p=0.25), torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95, atol=1e-6)
    # after temperature (vLLM's order): at T = 0.5 the probabilities are 25:9:2.25:0.25, so 0.25 x 25 drops the last two
    assert torch.allclose(warp_probs(logits, 0.5, min_p=0.25), torch.tensor([25, 9, 0, 0]) / 34, atol=1e-6)
    # after top-k: the floor is a share of the likeliest kept token, the same before and after renormalising
    assert torch.allclose(warp_probs(logits, 1.0, top_k=3, min_p=0.5), torch.tensor([0.625, 0.375, 0, 0]), atol=1e-6)
    assert torch.equal(warp_probs(logits, 1.0, min_p=0.0), warp_probs(logits, 1.0))
    tied = torch.zeros(4)
    assert torch.allclose(warp_probs(tied, 1.0, min_p=0.99), torch.full((4,), 0.25))  # a tie at the top all stays
