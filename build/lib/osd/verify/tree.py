"""Verification of a token tree, pure functions: greedy (the longest path the target agrees with) and lossless
sampling (recursive rejection sampling down the tree)."""
from __future__ import annotations

import torch

from osd.propose.tree import Tree
from osd.verify.sampling import sample_from


def greedy_tree_verify(target_logits: torch.Tensor, tree: Tree) -> tuple[list[int], int]:
    """target_logits (1 + tree.size, V): row 0 at the root (the pending token), row 1 + j at node j
    -> (accepted nodes, root's child first; the target's next token after them).
    From the root, the target's argmax at the current row is taken; where a child of the current node holds that
    token the walk moves to it, else it stops and that argmax is the next token: exactly the tokens target-only
    greedy decoding emits, as many as the tree holds of them."""
    argmax = target_logits.argmax(dim=-1).tolist()  # first maximum, as torch's greedy everywhere here
    children: dict[int, dict[int, int]] = {}
    for j, (parent, token) in enumerate(zip(tree.parents, tree.tokens)):
        children.setdefault(parent, {}).setdefault(token, j)
    node, path = -1, []
    while True:
        token = argmax[node + 1]
        child = children.get(node, {}).get(token)
        if child is None:
            return path, token
        path.append(child)
        node = child


def sampled_tree_verify(target_probs: torch.Tensor, tree: Tree, chain_probs: torch.Tensor | None,
                        generator=None) -> tuple[list[int], int]:
    """Lossless verification of a tree at T > 0 (recursive rejection sampling, SpecInfer / SpecTr): the emitted
    tokens are distributed exactly as the target's sampling.

    target_probs (1 + tree.size, V) warped target probabilities (row 0: the root); chain_probs (tree.chain, V): the
    warped draft distributions the chain's tokens were drawn from (None: no chain). At each node the children are
    tried in turn against what is left of the target's distribution there: the chain's child first with the usual
    rule (accept with min(1, p / q); after a rejection p becomes norm(max(p - q, 0))), then every other child, which
    is deterministic given the context (a recycled or runner-up token: a one-hot draft), accepted with its
    probability under that p (after a rejection it is removed from p and p renormalised). The first child accepted
    is taken and the walk goes on from it; where none is, the next token is drawn from what is left. Each rule leaves
    the output at that position distributed as p, so the whole walk samples the target exactly."""
    children: dict[int, list[int]] = {}
    for j, parent in enumerate(tree.parents):
        children.setdefault(parent, []).append(j)
    node, path = -1, []
    while True:
        p = target_probs[node + 1].clone()
        for child in children.get(node, []):
            token = tree.tokens[child]
            u = float(torch.rand((), generator=generator))
            if child < tree.chain and chain_probs is not None:  # drawn from the draft's q
                q = chain_probs[child]
                if u * float(q[token]) < float(p[token]):
                    break
                residual = (p - q).clamp_min(0.0)
                p = residual / residual.sum() if residual.sum() > 0 else p
            else:  # a deterministic candidate: accept with its probability under what is left of p
                if u < float(p[token]):
                    break
                p[token] = 0.0
                if float(p.sum()) <= 0.0:  # all the mass was on it (rounding made u >= p): it is the token
                    break
                p = p / p.sum()
        else:
            return path, sample_from(p, generator)
        path.append(child)
        node = child
