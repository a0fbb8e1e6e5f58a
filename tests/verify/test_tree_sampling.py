"""Lossless sampling over token trees (verify/tree.py sampled_tree_verify): the first emitted token follows the
target's law at the root, and the token after an accepted node follows the target's law at that node, for a tree of
a sampled chain (drawn from the draft's q) and deterministic siblings (recycled / runner-up tokens, chosen among the
likeliest). Chi-square at significance 1e-3 (tests/verify/test_lossless_sampling.py's statistics) on 40,000 draws
(detects a TV error of ~0.03 with power 0.99 at 5 degrees of freedom); the mutant below, which skips renormalising
after a rejected sibling, is caught on 20,000. (Treating the sampled chain token as one more one-hot candidate is
not a mutant: any candidate chosen independently of the verification's own draws keeps the law.)"""
from __future__ import annotations

import pytest
import torch

from osd.propose.tree import Tree
from osd.verify.tree import sampled_tree_verify
from tests.verify.test_lossless_sampling import chi2_critical

V, N = 6, 40_000


def chi2(counts: torch.Tensor, law: torch.Tensor) -> float:
    expected = law * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0  # nothing outside the law's support
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def draw(seed: int, n: int = N, verify=sampled_tree_verify):
    """-> counts of (first token), (token after chain node 0), (token after sibling node 2), and the laws."""
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(5, V, generator=g) * 1.5, dim=-1)  # rows: root, nodes 0..3
    q = torch.softmax(torch.randn(2, V, generator=g) * 1.5, dim=-1)  # the draft's law at chain depths 0, 1
    likely = target[0].argsort(descending=True).tolist()
    first, after_chain, after_sibling = torch.zeros(V), torch.zeros(V), torch.zeros(V)
    for _ in range(n):
        t0, t1 = int(torch.multinomial(q[0], 1, generator=g)), int(torch.multinomial(q[1], 1, generator=g))
        s1, s2 = [t for t in likely if t != t0][:2]
        # grow_tree's layout: the chain first (node 0 under the root, node 1 under node 0), then siblings 2, 3
        tree = Tree([t0, t1, s1, s2], [-1, 0, -1, -1], chain=2)
        path, nxt = verify(target, tree, q, g)
        emitted = [tree.tokens[j] for j in path] + [nxt]
        first[emitted[0]] += 1
        if path[:1] == [0]:
            after_chain[emitted[1]] += 1
        elif path[:1] == [2]:
            after_sibling[emitted[1]] += 1
    return (first, after_chain, after_sibling), (target[0], target[1], target[3])


@pytest.mark.parametrize("seed", [0, 1])
def test_tree_sampling_follows_the_targets_law_at_every_accepted_node(seed):
    counts, laws = draw(seed)
    critical = chi2_critical(V - 1, 1e-3)
    for c, law in zip(counts, laws):
        assert c.sum() > 1000
        assert chi2(c, law) < critical


def unrenormalised(target_probs, tree, chain_probs, generator=None):
    """Mutant of sampled_tree_verify: after a rejected sibling, p is not renormalised, so the next sibling is accepted
    with its unrenormalised chance (too rarely) and the last draw comes from an unnormalised residual."""
    children: dict[int, list[int]] = {}
    for j, parent in enumerate(tree.parents):
        children.setdefault(parent, []).append(j)
    node, path = -1, []
    while True:
        p = target_probs[node + 1].clone()
        for child in children.get(node, []):
            token, u = tree.tokens[child], float(torch.rand((), generator=generator))
            if child < tree.chain:
                q = chain_probs[child]
                if u * float(q[token]) < float(p[token]):
                    break
                p = (p - q).clamp_min(0.0)
                p = p / p.sum()
            else:
                if u < float(p[token]):
                    break
                p[token] = 0.0  # the bug: no renormalisation
        else:
            return path, int(torch.multinomial(p, 1, generator=generator))
        path.append(child)
        node = child


def test_the_test_catches_a_sibling_accepted_with_its_unrenormalised_chance():
    counts, laws = draw(0, 20_000, verify=unrenormalised)
    assert chi2(counts[0], laws[0]) > chi2_critical(V - 1, 1e-3)
