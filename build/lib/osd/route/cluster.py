"""Unsupervised modes of the traffic (pure functions): IDF weighting and spherical k-means.

The router (route/policy.py) gives each draft one mode of the traffic to learn. The modes come from the prompts'
hashed unigram counts, weighted by inverse document frequency (so that what every prompt holds, a chat
template or a system prompt, weighs nothing) and compared by cosine.
Measured on real prompts with the bundled tokenizer (no model; 200 per label, interleaved, 512 buckets; a
request is right when its mode is its label's, labels matched one-to-one to modes): nearest-centroid with the
true labels' centroids 0.95 (gsm8k / spider / code / finance) and 1.00 (six multilingual_qa languages); the
router's clustering (k-means++, best of 32, on the first 128 requests, then online nearest-centroid) 0.70-0.87
and 0.79-0.98 over five seeds; greedy leader clustering from the first request 0.27-0.53 and 0.44-0.64.
Unsupervised modes are the weak link: the paper split its streams with a classifier.
"""
from __future__ import annotations

import random

import torch


def idf_weights(document_frequency: torch.Tensor, documents: int) -> torch.Tensor:
    """(B,) smoothed inverse document frequency: log((N + 2) / (df + 1)); ~0 for what every document holds."""
    return torch.log((documents + 2) / (document_frequency + 1))


def normalised(x: torch.Tensor) -> torch.Tensor:
    """Rows scaled to unit length (zero rows stay zero)."""
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def spherical_kmeans(points: torch.Tensor, k: int, seed: int = 0, restarts: int = 32, iters: int = 20):
    """(N, F) unit rows -> ((k, F) unit centroids, (N,) cluster of each row), the best of `restarts` k-means++
    seedings by total cosine similarity. k is capped at N."""
    k = min(k, len(points))
    rng = random.Random(seed)
    best = None
    for _ in range(restarts):
        centroids = _seed(points, k, rng)
        for _ in range(iters):
            assign = (points @ centroids.T).argmax(1)  # (N,)
            centroids = normalised(torch.stack([points[assign == j].mean(0) if (assign == j).any() else centroids[j]
                                                for j in range(k)]))
        assign = (points @ centroids.T).argmax(1)
        score = float((points @ centroids.T).max(1).values.sum())
        if best is None or score > best[0]:
            best = (score, centroids, assign)
    return best[1], best[2]


def _seed(points: torch.Tensor, k: int, rng: random.Random) -> torch.Tensor:
    """k-means++: each next seed drawn with probability proportional to its cosine distance from the chosen ones."""
    chosen = [points[rng.randrange(len(points))]]
    for _ in range(1, k):
        distance = (1 - torch.stack([points @ c for c in chosen]).max(0).values).clamp_min(0).tolist()
        total = sum(distance)
        if total <= 0:
            chosen.append(points[rng.randrange(len(points))])
            continue
        r, acc = rng.random() * total, 0.0
        for i, d in enumerate(distance):
            acc += d
            if acc >= r:
                break
        chosen.append(points[i])
    return torch.stack(chosen)
