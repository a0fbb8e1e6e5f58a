"""The glue's joint calls over several sequences (qkv_rope_many, attention_many: one call per layer for every
sequence's rows) are bitwise the per-sequence calls, caches written included; a row naming no cache is refused."""
from __future__ import annotations

import pytest
from conftest import require_glue
import torch

require_glue()

from osd.models.q4_runner import glue  # noqa: E402

H, G, D, T = 4, 2, 16, 40


def caches(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(G, T, D, generator=g), torch.randn(G, T, D, generator=g)) for _ in range(n)]


def tables():
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    angles = torch.arange(T).float()[:, None] * inv[None, :]
    return angles.cos().contiguous(), angles.sin().contiguous()


def test_joint_calls_are_bitwise_the_per_sequence_calls():
    g = glue()
    cos, sin = tables()
    rows = [3, 1, 2]  # rows per sequence (a prompt chunk, one decode row, a pending token and a proposal)
    starts = [5, 17, 30]  # each sequence's first position: caches of different lengths
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(sum(rows), (H + 2 * G) * D, generator=gen)
    bias = torch.randn((H + 2 * G) * D, generator=gen)
    pos = [torch.arange(s, s + n) for s, n in zip(starts, rows)]
    alone, joint = caches(3, seed=1), caches(3, seed=1)
    expected, at = [], 0
    for (k, v), p, n in zip(alone, pos, rows):
        q = g.qkv_rope(qkv[at : at + n].contiguous(), bias, cos, sin, p, k, v, H)
        expected.append(g.attention(q, k, v, p))
        at += n
    cache_of = torch.cat([torch.full((n,), j) for j, n in enumerate(rows)])
    ks, vs = [k for k, _ in joint], [v for _, v in joint]
    q = g.qkv_rope_many(qkv, bias, cos, sin, torch.cat(pos), ks, vs, cache_of, H)
    got = g.attention_many(q, ks, vs, cache_of, torch.cat(pos))
    assert torch.equal(got, torch.cat(expected))
    for (k1, v1), (k2, v2) in zip(alone, joint):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_a_row_naming_no_cache_or_a_position_past_its_cache_is_refused():
    g = glue()
    cos, sin = tables()
    qkv, bias = torch.randn(2, (H + 2 * G) * D), torch.randn((H + 2 * G) * D)
    (k, v), = caches(1, seed=2)
    with pytest.raises(RuntimeError, match="names no cache"):
        g.qkv_rope_many(qkv, bias, cos, sin, torch.tensor([1, 2]), [k], [v], torch.tensor([0, 1]), H)
    with pytest.raises(RuntimeError, match="outside the cache"):
        g.qkv_rope_many(qkv, bias, cos, sin, torch.tensor([1, T]), [k], [v], torch.tensor([0, 0]), H)
    q = torch.randn(2, H, D)
    with pytest.raises(RuntimeError, match="outside the cache"):
        g.attention_many(q, [k], [v], torch.tensor([0, 0]), torch.tensor([1, T]))
