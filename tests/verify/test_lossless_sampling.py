"""Speculative sampling is lossless: tests that can catch a bug (the way vLLM tests its rejection sampler).

1. The rule, `rejection_verify`, on hand-built (k+1, V) target and (k, V) draft distributions:
   exact deterministic cases (rejection at every position, the bonus token); the exact joint law of
   (n_accepted, next_token) for fixed proposals against a Monte Carlo estimate, for k = 1..6 and a
   designed rejection position j = 0..k-1 or the all-accepted bonus case; and the core theorem: with
   proposals drawn from the draft, the token emitted at every position 0..k follows the target.
2. The engine end to end on tiny seeded models: the law of the first 3 generated tokens under
   speculative sampling equals the target's own sampling law, computed exactly by enumerating
   prefixes, at k = 1..6, with temperature, top-k and top-p, and with a draft that forces a rejection
   at (nearly) every step, so (nearly) every output token is drawn from the residual; per (case, k) also the first
   token's law alone (8 cells, none pooled), so a bug after a rejection shows at every k, not only pooled.
3. The same through the proposers osd serves with (DraftModelProposer, the n-gram lookup, lookup-then-draft), with
   top-k and top-p, so a warping or reporting bug inside a real proposer moves the law.

Statistics. Each comparison is a Pearson chi-square goodness-of-fit test against the exact law; a
test passes when its p-value exceeds ALPHA = 1e-3 (the seeds are fixed, so a run is deterministic).
Power: for observed law P and exact law Q, X^2 is approximately noncentral chi-square with
noncentrality lam = n * sum_i (P_i - Q_i)^2 / Q_i, and by Cauchy-Schwarz
(sum_i |P_i - Q_i|)^2 <= sum_i (P_i - Q_i)^2 / Q_i * sum_i Q_i, so lam >= 4 n TV(P, Q)^2. Every test
asserts, for the df it actually has (cells with expected count < 5 are pooled), that a
total-variation error of its stated size (on the pooled cells) would be detected with probability
>= POWER = 0.99 (`detectable_tv`): RULE_TV = 0.06 for the (n_accepted, next_token) law, THEOREM_TV =
0.06 per emitted position, ENGINE_TV = 0.18 per (case, k), ENGINE_MARGINAL_TV = 0.14 per (case, k) on the first
token, ENGINE_POOLED_TV = 0.095 per case with k = 1..6 pooled, and for the real proposers ENGINE_TV per (case, k)
and 0.12 per case with k = 1, 3, 6 pooled. Mutants each of these catch (checked by hand): the draft proposer
sampling from its top-k/top-p-warped distribution but reporting the unwarped one (every real draft-model test, each
k), and the token after a rejection drawn from the target instead of the residual (every per-k engine test). The engine's resolution is coarser because a generation costs ~2 ms of model
forwards (the whole file runs in about a minute on one core); plumbing bugs (a misaligned row, a
wrong cache) move the law by far more. scipy is not installed, so the chi-square tail is computed
from the regularized incomplete gamma function (series / continued fraction) and the noncentral
one as its Poisson mixture.
"""
from __future__ import annotations

import functools
import itertools
import math
from collections import Counter
from dataclasses import dataclass, replace

import pytest
import torch
from conftest import EOS, ToyTokenizer, tiny_qwen2

from osd.config import SamplingConfig, SpeculationConfig
from osd.engine import SpeculativeEngine
from osd.propose import Proposal
from osd.verify import acceptance_beta, rejection_verify, sample_from
from osd.verify.sampling import warp

ALPHA = 1e-3  # reject "lossless" when p < ALPHA: a false alarm rate of 1e-3 per test
POWER = 0.99  # probability of detecting a total-variation error of the stated size
MIN_EXPECTED = 5.0  # cells with a smaller expected count are pooled (the chi-square approximation)


# --- statistics (no scipy in the venv) -------------------------------------------------------------


def regularized_gamma_q(a: float, x: float) -> float:
    """Q(a, x) = Gamma(a, x) / Gamma(a): series for x < a + 1, Lentz continued fraction otherwise."""
    if x <= 0.0:
        return 1.0
    log_prefactor = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1.0:  # P(a, x) = e^-x x^a / Gamma(a) * sum_n x^n / (a (a+1) ... (a+n))
        term = total = 1.0 / a
        denominator = a
        while term > total * 1e-16:
            denominator += 1.0
            term *= x / denominator
            total += term
        return max(0.0, 1.0 - total * math.exp(log_prefactor))
    tiny = 1e-300
    b = x + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    fraction = d
    for i in range(1, 100_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = b + an / c
        c = c if abs(c) > tiny else tiny
        fraction *= d * c
        if abs(d * c - 1.0) < 1e-16:
            break
    return fraction * math.exp(log_prefactor)


def chi2_sf(x: float, df: int) -> float:
    """P(chi2_df > x)."""
    return regularized_gamma_q(df / 2.0, x / 2.0)


def chi2_critical(df: int, alpha: float = ALPHA) -> float:
    """x with chi2_sf(x, df) = alpha (bisection)."""
    low, high = 0.0, df + 100.0 * math.sqrt(df) + 200.0
    for _ in range(200):
        mid = (low + high) / 2.0
        low, high = (mid, high) if chi2_sf(mid, df) > alpha else (low, mid)
    return (low + high) / 2.0


def noncentral_chi2_sf(x: float, df: int, noncentrality: float) -> float:
    """P(chi2_df(lam) > x) = sum_j Poisson(j; lam/2) * P(chi2_{df+2j} > x)."""
    half = noncentrality / 2.0
    if half == 0.0:
        return chi2_sf(x, df)
    last = int(half + 12.0 * math.sqrt(half) + 30.0)  # the Poisson tail beyond is negligible
    return sum(math.exp(-half + j * math.log(half) - math.lgamma(j + 1)) * chi2_sf(x, df + 2 * j) for j in range(last + 1))


def detectable_tv(n: int, df: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """Smallest TV error the test on n samples and df degrees of freedom detects with prob >= power.

    Uses the bound noncentrality >= 4 n TV^2 (module docstring), so it holds for every alternative.
    """
    critical = chi2_critical(df, alpha)
    low, high = 0.0, 1.0
    for _ in range(60):
        tv = (low + high) / 2.0
        low, high = (low, tv) if noncentral_chi2_sf(critical, df, 4.0 * n * tv * tv) >= power else (tv, high)
    return high


@dataclass(frozen=True)
class GoodnessOfFit:
    statistic: float
    df: int
    p_value: float
    n: int
    impossible: dict  # observed outcomes the exact law gives probability 0: {outcome: count}


def goodness_of_fit(counts: Counter, exact: dict) -> GoodnessOfFit:
    """Pearson chi-square of observed counts against an exact law {outcome: probability}.

    Cells with expected count < MIN_EXPECTED are pooled into one cell (folded into the smallest
    other cell if the pool itself is still too small).
    """
    n = sum(counts.values())
    impossible = {o: c for o, c in counts.items() if exact.get(o, 0.0) <= 0.0}
    cells = sorted(((n * prob, counts.get(o, 0)) for o, prob in exact.items() if prob > 0.0), reverse=True)
    big = [cell for cell in cells if cell[0] >= MIN_EXPECTED]
    small = [cell for cell in cells if cell[0] < MIN_EXPECTED]
    if small:
        pooled = (sum(e for e, _ in small), sum(o for _, o in small))
        if pooled[0] < MIN_EXPECTED and big:
            smallest = big.pop()
            pooled = (pooled[0] + smallest[0], pooled[1] + smallest[1])
        big.append(pooled)
    statistic = sum((observed - expected) ** 2 / expected for expected, observed in big)
    df = len(big) - 1
    return GoodnessOfFit(statistic, df, chi2_sf(statistic, df) if df > 0 else 1.0, n, impossible)


def assert_same_law(counts: Counter, exact: dict, tv: float, what: str) -> GoodnessOfFit:
    """Fail on any impossible outcome; check the stated power; then the chi-square test at ALPHA."""
    fit = goodness_of_fit(counts, exact)
    assert not fit.impossible, f"{what}: outcomes with exact probability 0 were observed: {fit.impossible}"
    assert fit.df >= 1, f"{what}: a single pooled cell tests nothing"
    resolution = detectable_tv(fit.n, fit.df)
    assert resolution <= tv, f"{what}: {fit.n} samples, df {fit.df} only detect TV >= {resolution:.3f} (stated {tv})"
    assert fit.p_value > ALPHA, (f"{what}: chi2 {fit.statistic:.1f} on {fit.df} df, p = {fit.p_value:.2e} < {ALPHA}: "
                                 f"the sampled law differs from the exact one")
    return fit


def test_chi_square_helpers_match_tables():
    assert chi2_sf(3.841459, 1) == pytest.approx(0.05, rel=1e-5)
    assert chi2_sf(18.307038, 10) == pytest.approx(0.05, rel=1e-5)
    assert chi2_sf(4.0, 2) == pytest.approx(math.exp(-2.0), rel=1e-12)  # df 2: exactly exp(-x/2)
    assert chi2_critical(10, 1e-3) == pytest.approx(29.5883, rel=1e-4)
    assert chi2_critical(100, 1e-3) == pytest.approx(149.449, rel=1e-4)
    assert noncentral_chi2_sf(20.0, 7, 0.0) == pytest.approx(chi2_sf(20.0, 7))
    assert noncentral_chi2_sf(chi2_critical(5), 5, 20.0) == pytest.approx(0.652, abs=2e-3)  # Monte Carlo: 0.6515


def test_goodness_of_fit_detects_an_error_of_the_stated_size():
    """The chi-square machinery can fail: a law at TV 0.05 from the exact one is rejected at the sizes used."""
    exact_probs = torch.softmax(torch.randn(30, generator=torch.Generator().manual_seed(0), dtype=torch.float64), 0)
    sign = torch.tensor([1.0, -1.0] * 15, dtype=torch.float64)  # worst case of the power bound: error proportional to exact
    shift = sign * exact_probs
    shifted = exact_probs + 0.05 * shift / shift.abs().sum() * 2.0  # TV(shifted, exact) = 0.05
    n = 8000
    counts = torch.multinomial(shifted, n, replacement=True, generator=torch.Generator().manual_seed(1)).bincount(minlength=30)
    exact = {i: float(prob) for i, prob in enumerate(exact_probs)}
    fit = goodness_of_fit(Counter({i: int(c) for i, c in enumerate(counts)}), exact)
    assert detectable_tv(n, fit.df) <= 0.05 and fit.p_value < ALPHA
    same = torch.multinomial(exact_probs, n, replacement=True, generator=torch.Generator().manual_seed(2)).bincount(minlength=30)
    assert goodness_of_fit(Counter({i: int(c) for i, c in enumerate(same)}), exact).p_value > ALPHA


# --- 1. the rule on hand-built distributions --------------------------------------------------------

RULE_VOCAB = 5
RULE_SAMPLES = 5000  # per (k, j) case: detects a TV error of 0.06 in the (n_accepted, next_token) law
RULE_TV = 0.06
THEOREM_TV = 0.06  # per position, on the steps that reach it


def hand_built_step(ratios: list[float], seed: int, vocab: int = RULE_VOCAB):
    """-> target (k+1, V), draft (k, V), proposed (k,): target/draft = ratios[i] at proposal i.

    Proposal i is the draft's favourite token; the target's other entries are random, so every
    residual norm(max(0, target - draft)) spreads over several tokens.
    """
    g = torch.Generator().manual_seed(seed)
    k = len(ratios)
    draft = torch.softmax(1.5 * torch.randn(k, vocab, generator=g), -1)  # (k, V)
    target = torch.softmax(1.5 * torch.randn(k + 1, vocab, generator=g), -1)  # (k+1, V)
    proposed = draft.argmax(-1)  # (k,)
    for i, ratio in enumerate(ratios):
        at_proposal = ratio * draft[i, proposed[i]]
        others = target[i].clone()
        others[proposed[i]] = 0.0
        target[i] = others * (1.0 - at_proposal) / others.sum()
        target[i, proposed[i]] = at_proposal
    return target, draft, proposed


def exact_outcome_law(target: torch.Tensor, draft: torch.Tensor, proposed: torch.Tensor) -> dict:
    """Exact law of (n_accepted, next_token) for fixed proposals (PAPER.md section 1).

    Math: a_i = min(1, p_i(x_i) / q_i(x_i)); P(n = j, y) = prod_{i<j} a_i (1 - a_j) norm(max(0, p_j - q_j))(y);
    P(n = k, y) = prod_i a_i p_k(y).
    """
    target, draft = target.double(), draft.double()
    law, reach = {}, 1.0
    for i, token in enumerate(proposed.tolist()):
        accept = min(1.0, float(target[i, token] / draft[i, token]))
        residual = (target[i] - draft[i]).clamp_min(0.0)  # (V,)
        if accept < 1.0:
            law.update({(i, y): reach * (1.0 - accept) * float(r) for y, r in enumerate(residual / residual.sum())})
        reach *= accept
    law.update({(len(proposed), y): reach * float(t) for y, t in enumerate(target[-1])})
    return law


def sampled_outcomes(target, draft, proposed, n: int, seed: int) -> Counter:
    generator = torch.Generator().manual_seed(seed)
    outcomes = (rejection_verify(target, draft, proposed, generator) for _ in range(n))
    return Counter((o.n_accepted, o.next_token) for o in outcomes)


def one_hot(ids: list[int], vocab: int = RULE_VOCAB) -> torch.Tensor:
    """(len(ids), V) rows with all mass on ids[i]."""
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


def surely_rejected_row(proposal: int) -> torch.Tensor:
    """(V,) target row with 0 on the proposal, 0.7 on token 4, 0.1 elsewhere.

    Against a draft row with 0.6 on the proposal and 0.1 elsewhere, the residual max(0, target - draft)
    is all on token 4, while the target itself would give token 4 only 0.7.
    """
    row = torch.full((RULE_VOCAB,), 0.1)
    row[proposal], row[4] = 0.0, 0.7
    return row


@pytest.mark.parametrize("k", range(1, 7))
def test_exact_rejection_at_every_position_and_bonus(k):
    """Hand-built: proposals before j surely accepted, proposal j surely rejected, recovered token certain."""
    proposed = torch.tensor([i % 3 for i in range(k)])  # (k,)
    draft = torch.full((k, RULE_VOCAB), 0.1)  # (k, V)
    draft[torch.arange(k), proposed] = 0.6
    for j in range(k + 1):  # j == k: every proposal accepted, then the bonus token
        target = one_hot([*proposed[:j].tolist(), *[4] * (k + 1 - j)])  # (k+1, V): target >= draft before j
        if j < k:
            target[j] = surely_rejected_row(int(proposed[j]))
        target[k] = one_hot([3])[0]  # the bonus position's law
        for seed in range(20):
            out = rejection_verify(target, draft, proposed, torch.Generator().manual_seed(seed))
            assert (out.n_accepted, out.next_token) == (j, 4 if j < k else 3)
            assert out.is_bonus(k) == (j == k)


def test_a_token_the_target_excludes_is_rejected_even_when_u_is_zero(monkeypatch):
    """torch.rand draws from [0, 1): u = 0 is possible and must not accept a token of target probability 0."""
    monkeypatch.setattr(torch, "rand", lambda *shape, generator=None, **kw: torch.zeros(*shape))
    target = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0], [0.2] * 5])  # (2, V): excludes token 0 (as top-k / top-p do)
    draft = torch.tensor([[0.9, 0.1, 0.0, 0.0, 0.0]])  # (1, V)
    out = rejection_verify(target, draft, torch.tensor([0]))
    assert (out.n_accepted, out.next_token) == (0, 1)  # residual max(0, target - draft) is a point mass on 1


def designed_ratios(k: int, j: int) -> list[float]:
    """target/draft at each proposal: likely accepted before j, likely rejected at j (j == k: bonus case)."""
    if j == k:
        return [1.0 if i % 2 else 0.95 for i in range(k)]  # every other proposal is accepted surely
    return [0.88] * j + [0.25] + [0.6] * (k - j - 1)


@pytest.mark.parametrize("k,j", [(k, j) for k in range(1, 7) for j in range(k + 1)])
def test_outcome_law_matches_exact(k, j):
    """(n_accepted, next_token) for fixed proposals: Monte Carlo against the exact law, rejection at j."""
    target, draft, proposed = hand_built_step(designed_ratios(k, j), seed=10 * k + j)
    law = exact_outcome_law(target, draft, proposed)
    counts = sampled_outcomes(target, draft, proposed, RULE_SAMPLES, seed=1000 + 10 * k + j)
    assert_same_law(counts, law, RULE_TV, f"k={k} designed rejection at {j}")
    assert sum(c for (n, _), c in counts.items() if n == j) > RULE_SAMPLES / 10  # the designed outcome is exercised


THEOREM_SAMPLES = 2900  # per position: detects a TV error of 0.06 over V = 5 tokens (df 4)


@pytest.mark.parametrize("k", range(1, 7))
def test_emitted_token_at_every_position_follows_target(k):
    """The core theorem: proposals drawn from the draft, the token emitted at position i follows target[i].

    Whole steps are simulated; rows do not depend on earlier tokens, so given that a step reaches
    position i (all earlier proposals accepted), its token there is the accepted proposal or the
    recovered / bonus token, and must be distributed as target[i], for every i = 0..k. The step
    count makes position k expect 1.2 * THEOREM_SAMPLES visits.
    """
    g = torch.Generator().manual_seed(k)
    target = torch.softmax(1.5 * torch.randn(k + 1, RULE_VOCAB, generator=g), -1)  # (k+1, V)
    draft = torch.softmax(target[:k].log() + 0.6 * torch.randn(k, RULE_VOCAB, generator=g), -1)  # (k, V)
    reach_bonus = float(acceptance_beta(target[:k], draft).prod())  # P(all k proposals accepted)
    assert reach_bonus > 0.2
    steps = math.ceil(1.2 * THEOREM_SAMPLES / reach_bonus)
    per_position = [Counter() for _ in range(k + 1)]
    for _ in range(steps):
        proposed = torch.multinomial(draft, 1, generator=g)[:, 0]  # (k,) one draw per row
        out = rejection_verify(target, draft, proposed, g)
        emitted = proposed[: out.n_accepted].tolist() + [out.next_token]
        for i, token in enumerate(emitted):
            per_position[i][token] += 1
    for i, counts in enumerate(per_position):
        exact = {y: float(t) for y, t in enumerate(target[i].double())}
        assert_same_law(counts, exact, THEOREM_TV, f"k={k} position {i}")


# --- 2. the engine end to end on tiny seeded models -----------------------------------------------

ENGINE_VOCAB = 8  # 8^3 sequences of 3 tokens: few enough cells
ENGINE_PROMPT = [2]
ENGINE_TOKENS = 3  # the law of the first 3 generated tokens is compared
ENGINE_SAMPLES = 600  # generations per (case, k)
ENGINE_TV = 0.18  # per (case, k): detected with probability >= 0.99 at ENGINE_SAMPLES (df <= 47 here)
ENGINE_POOLED_TV = 0.095  # per case, all k pooled (3600 samples)


class BigramDraft:
    """A cheap proposer whose draft logits depend on the last token: (V, V) table, row = last token.

    Warps each row with the request's settings (as DraftModelProposer does) and returns the rows it
    sampled from as draft_probs, which is all that rejection sampling needs from a draft.
    """

    name, version = "bigram", 0

    def __init__(self, logits: torch.Tensor):
        self.logits = logits  # (V, V)

    def begin(self, prompt_ids, prefill=True):
        pass

    def propose(self, tokens, k, sampling, generator=None) -> Proposal:
        last, proposed, rows = tokens[-1], [], []
        for _ in range(k):
            row = warp(self.logits[last], sampling)  # (V,)
            last = sample_from(row, generator)
            proposed.append(last)
            rows.append(row)
        return Proposal(proposed, torch.stack(rows))  # draft_probs (k, V)

    def rollback(self, length):
        pass


@torch.inference_mode()
def near_target_draft(target_model, noise: float = 0.6) -> BigramDraft:
    """Draft = the target's logits after the last token alone, plus noise: accepts often, not always."""
    logits = target_model(torch.arange(ENGINE_VOCAB)[:, None]).logits[:, -1]  # (V, V)
    g = torch.Generator().manual_seed(7)
    return BigramDraft(logits + noise * logits.std() * torch.randn(logits.shape, generator=g))


def rejecting_draft(target_model, sampling: SamplingConfig) -> BigramDraft:
    """Draft with 0.9 of its mass on the token the target likes least after the prompt: rejected almost always."""
    first = exact_next_law(target_model, ENGINE_PROMPT, sampling)  # (V,)
    skewed = torch.full((ENGINE_VOCAB,), 0.1 / (ENGINE_VOCAB - 1))
    skewed[int(first.argmin())] = 0.9
    return BigramDraft(skewed.log().expand(ENGINE_VOCAB, ENGINE_VOCAB))


@torch.inference_mode()
def exact_next_law(target_model, prompt: list[int], sampling: SamplingConfig) -> torch.Tensor:
    logits = target_model(torch.tensor([prompt])).logits[0, -1]  # (V,)
    return warp(logits, sampling)


@torch.inference_mode()
def exact_first_tokens_law(target_model, prompt: list[int], sampling: SamplingConfig) -> dict:
    """Exact law of the first 3 tokens of plain target sampling: P(t1) P(t2 | t1) P(t3 | t1, t2).

    One batched forward over all V^2 continuations (t1, t2) gives the three conditionals. Outcomes are
    what the engine returns: the tokens before an EOS (EOS ends generation and is not returned).
    """
    vocab = ENGINE_VOCAB
    pairs = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))  # (V^2, 2) rows (t1, t2)
    ids = torch.cat([torch.tensor(prompt).expand(vocab * vocab, -1), pairs], dim=1)  # (V^2, L + 2)
    logits = target_model(ids).logits[:, -3:]  # (V^2, 3, V)
    probs = warp(logits, sampling).double()
    first = probs[0, 0]  # (V,) P(t1)
    second = probs[::vocab, 1]  # (V, V) P(t2 | t1)
    third = probs[:, 2].reshape(vocab, vocab, vocab)  # (V, V, V) P(t3 | t1, t2)
    joint = first[:, None, None] * second[:, :, None] * third  # (V, V, V)
    law = Counter()
    for sequence, prob in zip(torch.cartesian_prod(*[torch.arange(vocab)] * 3).tolist(), joint.flatten().tolist()):
        law[before_eos(sequence)] += prob
    return dict(law)


def before_eos(tokens: list[int]) -> tuple:
    return tuple(tokens[: tokens.index(EOS)] if EOS in tokens else tokens)


def every_text_of_first_tokens(tokenizer) -> list[str]:
    """Stop strings that end a request at its 3rd token: ToyTokenizer decodes one character per token."""
    chars = [tokenizer.decode([t]) for t in range(ENGINE_VOCAB) if t != EOS]
    return ["".join(text) for text in itertools.product(chars, repeat=ENGINE_TOKENS)]


ENGINE_CASES = {
    "temperature": SamplingConfig(temperature=1.0),
    "temperature-top_k": SamplingConfig(temperature=0.7, top_k=3),
    "top_p": SamplingConfig(temperature=1.0, top_p=0.8),
    "forced-rejection": SamplingConfig(temperature=1.0),
}
ENGINE_KS = range(1, 7)


@dataclass(frozen=True)
class EngineRun:
    counts: Counter  # {first 3 tokens (fewer when EOS came first): generations}
    first_steps: Counter  # {(k, n_accepted) of the first step: generations}


@functools.lru_cache(maxsize=None)
def engine_target():
    return tiny_qwen2(seed=0, vocab=ENGINE_VOCAB)


@functools.lru_cache(maxsize=None)
def engine_run(case: str, k: int) -> EngineRun:
    """ENGINE_SAMPLES seeded generations at fixed k (cached: the pooled test reuses them).

    max_new_tokens = max(k + 1, 3), so the k policy's cap (remaining - 1) leaves the first step at k;
    stop strings end each request at its 3rd token (later tokens are not compared; this saves time).
    Seeds differ across (case, k), so runs pooled over k are independent samples.
    """
    target, tokenizer, base = engine_target(), ToyTokenizer(), ENGINE_CASES[case]
    draft = rejecting_draft(target, base) if case == "forced-rejection" else near_target_draft(target)
    engine = SpeculativeEngine(target, tokenizer, draft, SpeculationConfig(k=k, adaptive=False))
    stop, first_seed = every_text_of_first_tokens(tokenizer), (list(ENGINE_CASES).index(case) * 10 + k) * ENGINE_SAMPLES
    counts, first_steps = Counter(), Counter()
    for seed in range(first_seed, first_seed + ENGINE_SAMPLES):
        sampling = replace(base, max_new_tokens=max(k + 1, ENGINE_TOKENS), stop=stop, seed=seed)
        result = engine.generate(ENGINE_PROMPT, sampling)
        assert len(result.token_ids) == ENGINE_TOKENS or result.finish_reason == "stop"  # short only at EOS
        counts[tuple(result.token_ids)] += 1
        first_steps[result.steps[0]] += 1
    return EngineRun(counts, first_steps)


@pytest.mark.parametrize("k", ENGINE_KS)
@pytest.mark.parametrize("case", ENGINE_CASES)
def test_engine_first_tokens_follow_target_sampling(case, k):
    """SpeculativeEngine at fixed k: the first 3 tokens follow the target's own sampling law exactly.

    The near-target draft is rejected at every proposal position (in some steps) and reaches the
    bonus; the forced-rejection draft puts 0.9 of its mass on the target's least likely token, so
    nearly every step rejects its first proposal and emits a token drawn from the residual.
    """
    run = engine_run(case, k)
    assert {proposed for proposed, _ in run.first_steps} == {k}  # the cap never reduced the first step's k
    law = exact_first_tokens_law(engine_target(), ENGINE_PROMPT, ENGINE_CASES[case])
    assert_same_law(run.counts, law, ENGINE_TV, f"{case} k={k}")
    accepted = Counter(n for _, n in run.first_steps.elements())
    if case == "forced-rejection":
        assert accepted[0] > 0.8 * ENGINE_SAMPLES
    else:
        assert set(accepted) == set(range(k + 1))  # every rejection position and the bonus occurred


ENGINE_MARGINAL_TV = 0.14  # per (case, k) on the first token's law (<= 8 cells, df <= 7): detected with probability >= 0.99


def first_tokens(law: dict | Counter, m: int) -> dict:
    """The law (or counts) of the first m tokens, from that of the first ENGINE_TOKENS."""
    out = Counter()
    for outcome, weight in law.items():
        out[outcome[:m]] += weight
    return dict(out)


@pytest.mark.parametrize("k", ENGINE_KS)
@pytest.mark.parametrize("case", ENGINE_CASES)
def test_engine_first_token_follows_target_sampling_in_fine_cells(case, k):
    """The first token's law per (case, k): 8 cells, none pooled away, so a bug in what follows a rejection (the
    token drawn from the target instead of the residual) shows at every k, not only pooled over k."""
    run = engine_run(case, k)
    law = exact_first_tokens_law(engine_target(), ENGINE_PROMPT, ENGINE_CASES[case])
    assert_same_law(Counter(first_tokens(run.counts, 1)), first_tokens(law, 1), ENGINE_MARGINAL_TV,
                    f"{case} k={k}, first token")


@pytest.mark.parametrize("case", ENGINE_CASES)
def test_engine_first_tokens_pooled_over_k(case):
    """All k pooled (6 x ENGINE_SAMPLES): a bug present at every k is detected down to ENGINE_POOLED_TV."""
    pooled = sum((engine_run(case, k).counts for k in ENGINE_KS), Counter())
    law = exact_first_tokens_law(engine_target(), ENGINE_PROMPT, ENGINE_CASES[case])
    assert_same_law(pooled, law, ENGINE_POOLED_TV, f"{case} pooled over k = 1..6")


# --- 3. the real proposers: the draft model, the n-gram lookup and the lookup-then-draft chain -----------------------
# The engine tests above draft with a test-local BigramDraft; these run the same comparison through the proposers osd
# serves with, so a warping or reporting bug inside them (say, sampling from the top-k/top-p-warped draft but reporting
# the unwarped one as draft_probs) moves the law. Settings with top-k and top-p make that difference large.

REAL_CASES = {
    "draft-model": SamplingConfig(temperature=0.8, top_k=3, top_p=0.9),
    "lookup-then-draft": SamplingConfig(temperature=0.8, top_k=3, top_p=0.9),
    "lookup": SamplingConfig(temperature=1.0),
    # min-p goes through the same warp as top-k/top-p for target and draft: a draft warped differently (or not) would
    # have its proposals judged against the wrong q and move the law
    "draft-model-min_p": SamplingConfig(temperature=0.9, min_p=0.3),
}


@functools.lru_cache(maxsize=None)
def real_draft_model():
    """The target with noise on its LM head: close enough to be accepted often, different enough to be rejected."""
    import copy

    draft = copy.deepcopy(engine_target())
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        head = draft.lm_head.weight
        head.add_(0.1 * head.std() * torch.randn(head.shape, generator=g))
    return draft


def real_proposer(case: str):
    from osd.drafts import DraftRegistry
    from osd.propose import DraftModelProposer
    from osd.propose.ngram import LookupThenDraft, NgramProposer

    registry = DraftRegistry()
    registry.publish("d", real_draft_model())
    draft = DraftModelProposer(registry, "d", ENGINE_VOCAB)
    if case == "draft-model":
        return draft
    lookup = NgramProposer(ENGINE_VOCAB, min_n=1, max_n=2)
    sampler = SpeculativeEngine(engine_target(), ToyTokenizer(), None, SpeculationConfig(k=0, adaptive=False))
    for seed in range(40):  # traffic: the target's own samples, so lookups are right often enough, not always
        answer = sampler.generate(ENGINE_PROMPT, SamplingConfig(temperature=1.0, max_new_tokens=12, seed=10_000 + seed))
        lookup.observe_request(ENGINE_PROMPT + answer.token_ids)
    return lookup if case == "lookup" else LookupThenDraft(lookup, draft)


@functools.lru_cache(maxsize=None)
def real_run(case: str, k: int) -> EngineRun:
    target, tokenizer, base = engine_target(), ToyTokenizer(), REAL_CASES[case]
    engine = SpeculativeEngine(target, tokenizer, real_proposer(case), SpeculationConfig(k=k, adaptive=False))
    stop, first_seed = every_text_of_first_tokens(tokenizer), (100 + list(REAL_CASES).index(case) * 10 + k) * ENGINE_SAMPLES
    counts, first_steps = Counter(), Counter()
    for seed in range(first_seed, first_seed + ENGINE_SAMPLES):
        sampling = replace(base, max_new_tokens=max(k + 1, ENGINE_TOKENS), stop=stop, seed=seed)
        result = engine.generate(ENGINE_PROMPT, sampling)
        counts[tuple(result.token_ids)] += 1
        first_steps[result.steps[0]] += 1
    return EngineRun(counts, first_steps)


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("case", REAL_CASES)
def test_real_proposers_first_tokens_follow_target_sampling(case, k):
    """DraftModelProposer, NgramProposer and LookupThenDraft at fixed k: the first 3 tokens follow the target's own
    sampling law (ENGINE_TV per (case, k), ENGINE_SAMPLES generations); the draft model's proposals are accepted and
    rejected, the lookup's (a fixed continuation, outside the target's top-k more often than not) mostly rejected."""
    run = real_run(case, k)
    law = exact_first_tokens_law(engine_target(), ENGINE_PROMPT, REAL_CASES[case])
    assert_same_law(run.counts, law, ENGINE_TV, f"{case} k={k}")
    assert all(proposed > 0 for proposed, _ in run.first_steps)  # every first step verified proposals
    accepted = Counter(n for _, n in run.first_steps.elements())
    assert accepted[0] > 0  # rejections: tokens drawn from the residual
    if case == "draft-model":  # and acceptances (the lookup's one continuation of the prompt is mostly rejected)
        assert sum(v for n, v in accepted.items() if n > 0) > 0.5 * ENGINE_SAMPLES


@pytest.mark.parametrize("case", REAL_CASES)
def test_real_proposers_pooled_over_k(case):
    pooled = sum((real_run(case, k).counts for k in (1, 3, 6)), Counter())
    law = exact_first_tokens_law(engine_target(), ENGINE_PROMPT, REAL_CASES[case])
    assert_same_law(pooled, law, 0.12, f"{case} pooled over k = 1, 3, 6")


# --- drafting ahead by the draft's confidence (schedule/confidence.py) -------------------------------------------

@functools.lru_cache(maxsize=None)
def confidence_run():
    """600 seeded generations of 3 tokens with confidence drafting (the proposal's length set by the draft's own
    probabilities of what it sampled, then cut by the allocation)."""
    from osd.drafts import DraftRegistry
    from osd.propose import DraftModelProposer

    target, tokenizer = engine_target(), ToyTokenizer()
    registry = DraftRegistry()
    registry.publish("d", real_draft_model())
    spec = SpeculationConfig(k=6, adaptive=True, confidence=True)
    engine = SpeculativeEngine(target, tokenizer, DraftModelProposer(registry, "d", target.config.vocab_size), spec)
    for policy in engine.policies:
        policy.calibrate(1e-3, [1.0 + 0.3 * k for k in range(engine.k_max + 1)])  # rows dear enough to cut
    base = SamplingConfig(temperature=0.8, top_k=3, top_p=0.9)
    stop, counts, first_k = every_text_of_first_tokens(tokenizer), Counter(), Counter()
    for seed in range(ENGINE_SAMPLES):
        sampling = replace(base, max_new_tokens=7, stop=stop, seed=50_000 + seed)
        result = engine.generate(ENGINE_PROMPT, sampling)
        counts[tuple(result.token_ids)] += 1
        first_k[result.steps[0][0]] += 1
    return counts, first_k, base


def test_sampled_tokens_follow_the_target_law_when_the_draft_decides_how_far_to_propose():
    counts, first_k, base = confidence_run()
    assert len(first_k) >= 2  # proposals of several lengths: the rule did decide
    assert_same_law(counts, exact_first_tokens_law(engine_target(), ENGINE_PROMPT, base), ENGINE_TV,
                    "confidence drafting, sampled")
