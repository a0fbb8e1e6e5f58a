"""The feature head's chains as training data and as a score: pure functions of tensors (the head:
models/feature_head.py).

A start t of a sequence is a place a proposal begins: the target's feature at t (the LM head's input there) and the
token at t + 1 (just emitted) are read; the chain's proposal d must hit the target's token at t + 2 + d. `Chains`
holds every start of many sequences with what its chain reads and must hit; `unrolled_loss` is EAGLE-3's
training-time test (the head trained on its own multi-step predictions, as it proposes when serving);
`head_chains` scores greedy chains. The online learner (learn/head.py) and `osd bench feature-head` both use them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from osd.models.feature_head import FeatureHead


@dataclass
class Chains:
    """Every start t of every sample, with what a chain of proposals from it reads and must hit.
    features (R, F): the target's features (`target_features`) at each sample's starts and the positions after them,
    samples concatenated; rows (N,): the row of start n's t, so the target's feature at t + 1 + d is row
    rows[n] + 1 + d;
    first_embedding (N, H): the embedding of the token at t + 1; labels (N, D): the map row of the target's token at
    t + 2 + d (-1 outside the map or past the answer's end: no chain can hit it)."""
    features: torch.Tensor
    rows: torch.Tensor
    first_embedding: torch.Tensor
    labels: torch.Tensor

    def blocks(self, keep: list[int], hidden: int) -> "Chains":
        """The same starts reading only the feature blocks `keep` (indices into the F / hidden blocks)."""
        cols = torch.cat([torch.arange(b * hidden, (b + 1) * hidden) for b in keep])
        return replace(self, features=self.features[:, cols])


def unrolled_loss(head: FeatureHead, chains: Chains, map_embeddings: torch.Tensor, j: torch.Tensor, steps: int,
                  feature_weight: float = 0.0) -> torch.Tensor:
    """The loss of a chain of `steps` proposals from starts j, the head reading its own predicted feature past the
    first (EAGLE-3's training-time test: trained on the inputs it will see when serving) and the target's token (a
    chain goes on only where it hit). Per proposal: cross entropy over the starts still alive (every label so far
    in the map), plus feature_weight x smooth L1 between the predicted feature and the target's at t + 1 + d."""
    hidden = chains.first_embedding.shape[-1]
    feature, embedding = head.first_feature(chains.features[chains.rows[j]]), chains.first_embedding[j]
    labels, alive, total = chains.labels[j], torch.ones(len(j), dtype=torch.bool), 0.0
    for d in range(steps):
        alive = alive & (labels[:, d] >= 0)
        if not alive.any():
            break
        logits, feature = head.step(feature, embedding)
        total = total + nn.functional.cross_entropy(logits[alive], labels[alive, d])
        if feature_weight:
            truth = chains.features[chains.rows[j][alive] + 1 + d, -hidden:]
            total = total + feature_weight * nn.functional.smooth_l1_loss(feature[alive].float(), truth)
        embedding = map_embeddings[labels[:, d].clamp(min=0)]
    return total


@torch.no_grad()
def head_chains(head: FeatureHead, chains: Chains, map_embeddings: torch.Tensor, depth: int) -> torch.Tensor:
    """(N, depth) hits of the head's own chain from every start. Proposal 0 reads the target's feature at t and its
    token at t + 1; proposal d > 0 reads the feature the head predicted at d - 1 and the token it proposed there, as it
    would in serving (a label outside the map or past the answer's end is a miss)."""
    feature = head.first_feature(chains.features[chains.rows])
    embedding, hits = chains.first_embedding, []
    for d in range(depth):
        logits, feature = head.step(feature, embedding)
        guess = logits.argmax(-1)
        hits.append(guess == chains.labels[:, d])
        embedding = map_embeddings[guess]
    return torch.stack(hits, dim=1)


@torch.no_grad()
def chain_lengths(head: FeatureHead, chains: Chains, map_embeddings: torch.Tensor, depth: int,
                  starts: torch.Tensor | None = None) -> torch.Tensor:
    """(n,) accepted length of the head's greedy chain from each of `starts` (default: all): leading_hits of
    head_chains, computed for the chains still alive only (past a miss nothing is run: at an acceptance of ~0.3 a
    4-deep score costs ~1.4 proposals a start instead of 4)."""
    starts = torch.arange(len(chains.rows)) if starts is None else starts
    feature = head.first_feature(chains.features[chains.rows[starts]])
    embedding, labels = chains.first_embedding[starts], chains.labels[starts]
    lengths, alive = torch.zeros(len(starts), dtype=torch.long), torch.arange(len(starts))
    for d in range(depth):
        if not len(alive):
            break
        logits, feature = head.step(feature, embedding)
        guess = logits.argmax(-1)
        hit = guess == labels[alive, d]
        lengths[alive[hit]] += 1
        alive, feature, embedding = alive[hit], feature[hit], map_embeddings[guess[hit]]
    return lengths


def leading_hits(hits: torch.Tensor) -> torch.Tensor:
    """(N, D) bool -> (N,) the hits before each row's first miss: a chain's accepted length."""
    return hits.long().cumprod(dim=1).sum(dim=1)


def chains_of_sequence(tokens: list[int], first: int, features: torch.Tensor, embed, index: torch.Tensor,
                       depth: int) -> Chains | None:
    """One sequence's starts: `features` (n, H) the target's features at positions first .. first + n - 1 (the
    verified ones); every t among them with t + 2 < len(tokens) starts a chain. embed: ids -> (m, H) embeddings;
    index (V,): target id -> map row (-1 outside the map). None where no start has a label."""
    last = min(first + len(features), len(tokens) - 1)  # features of positions first .. last - 1 are read
    ts = list(range(first, last - 1))  # a label at t + 2 <= last, its truth feature at t + 1 < last
    if not ts:
        return None
    labels = torch.tensor([[int(index[tokens[t + 2 + d]]) if t + 2 + d <= last else -1 for d in range(depth)]
                           for t in ts], dtype=torch.long)  # (N, depth)
    return Chains(features[: last - first], torch.tensor(ts) - first, embed([tokens[t + 1] for t in ts]), labels)


def concat_chains(pieces: list[Chains]) -> Chains:
    """Several sequences' Chains as one (each piece's rows offset past the features before it)."""
    offsets = torch.tensor([0] + [len(p.features) for p in pieces[:-1]]).cumsum(0)
    return Chains(torch.cat([p.features for p in pieces]), torch.cat([p.rows + o for p, o in zip(pieces, offsets)]),
                  torch.cat([p.first_embedding for p in pieces]), torch.cat([p.labels for p in pieces]))


def paired_mean_difference(base: torch.Tensor, other: torch.Tensor) -> dict:
    """Per-start accepted lengths, paired: mean of other - base and its z (mean over standard error; 0 when every
    difference is the same)."""
    d = (other.double() - base.double())
    if len(d) < 2:
        return {"mean_difference": float(d.mean()) if len(d) else 0.0, "z": 0.0, "n": len(d)}
    se = float(d.std(unbiased=True)) / len(d) ** 0.5
    return {"mean_difference": float(d.mean()), "z": float(d.mean()) / se if se > 0 else 0.0, "n": len(d)}
