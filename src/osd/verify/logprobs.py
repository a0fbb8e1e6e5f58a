"""Log-probabilities of emitted tokens, from the target's own logits at the positions that emitted them.

Which distribution: the target's raw log-softmax at each position, before temperature, top-k, top-p or min-p (what
vLLM returns by default, its "raw_logprobs" mode). So a token's logprob does not depend on how it was drawn: greedy or
sampled, speculating or not, it is the target's at that position. Under speculation the target scores every emitted
position in its verification pass (accepted tokens at their rows, the recovered or bonus token at the row after
them), so the figures are those target-only decoding gives, not the draft's.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class TokenLogprob(NamedTuple):
    token: int  # the emitted token id
    logprob: float  # its log-probability under the target at its position
    top: list[tuple[int, float]]  # the likeliest tokens there and theirs, best first (as many as asked)


def token_logprobs(logits: torch.Tensor, tokens: list[int], n_top: int) -> list[TokenLogprob]:
    """logits (n, V) raw target logits, row i at the position that emitted tokens[i] (n,) -> n TokenLogprobs with
    the n_top likeliest tokens each (0: none)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (n, V)
    chosen = logp.gather(-1, torch.tensor(tokens, dtype=torch.long)[:, None])[:, 0].tolist()  # (n,)
    if n_top:
        values, ids = torch.topk(logp, min(n_top, logp.shape[-1]), dim=-1)  # (n, n_top)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [[] for _ in tokens]
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(tokens, chosen, tops)]
