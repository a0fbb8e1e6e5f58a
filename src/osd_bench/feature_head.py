"""`osd bench feature-head`: would a draft that reads the target's features (EAGLE / Hydra family) propose better
than the shipped cheap draft? A feasibility study, measured before the serving path is built.

The target (bundled GGUF on osd's Q4 kernel) answers train-split prompts greedily; a second pass over each prompt +
answer keeps its final hidden state (after the output norm: the LM head's input) at every answer position. A small
head is distilled on them: from the target's feature at position t and the embedding of the token at t + 1 (the one
the target has just emitted) it predicts the target's token at t + 2, over the cheap draft's vocabulary map. That is
the first proposal of a speculative step, so its top-1 agreement with the target's greedy answer on held-out
prompts is the first proposal's acceptance; the cheap draft is scored on the same held-out positions, teacher-forced
(its argmax after the same prefix). Also timed: one head forward against one draft token (both fp32 torch here; the
serving copies would be int8). Deeper proposals: from every held-out start both propose a chain of --depth tokens,
the draft greedily (teacher-forced: a chain reaches proposal d only on the target's prefix), the head reading at
proposal d > 0 the feature it predicted at d - 1 and the token it proposed there (EAGLE), and the mean accepted
length per step is compared, paired by start; so is a chain whose first proposal is the head's and the rest the
draft's (the draft fed the head's token).

Head (`FeatureHead`): Linear(2H -> H) over [feature; embedding], one SiLU-gated MLP block with a residual, RMSNorm
(its output is the predicted feature at t + 1), and an LM head over the map initialised from the target's own output
rows (dequantized from the GGUF). Loss: cross entropy on the target's greedy token (positions whose token is outside
the map are left out of training and count as misses in the agreement, as they are for the draft, which cannot
propose them either), plus --feature-weight x smooth L1 between the predicted feature and the target's at t + 1.

EAGLE-3's two changes, as arms of one run on the same data (`--arms`): the training-time test (a head trained on
chains of N proposals, reading its own predicted features past the first, as it will when serving, instead of only
on the target's feature) and features from several of the target's layers (low, middle, high), fused by a first
projection. The run itself, its CLI and its report: `feature_head_run.py`.
"""
from __future__ import annotations

import time
import warnings

import numpy as np
import torch

from osd.errors import InvalidArgument
from osd.learn.head_chains import (Chains, head_chains, leading_hits, paired_mean_difference,  # noqa: F401 - used,
                                   unrolled_loss)  # and re-exported to the run
from osd.models.feature_head import FeatureHead


def target_features(runner, ids: list[int], layers: tuple[int, ...] = ()) -> torch.Tensor:
    """(len(ids), (len(layers) + 1) H): at every position, the output of each of `layers` (RMS-normalised, no
    weight: the residual stream's scale grows with depth), then the target's LM-head input (the final hidden state
    after the output norm), last."""
    runner.reset()
    norm = runner._glue.rms_norm
    rows, taps = [], {i: [] for i in layers}
    for i in range(0, len(ids), runner.chunk_rows):
        rows.append(runner._forward(ids[i : i + runner.chunk_rows], taps))
    final = norm(torch.cat(rows), runner.output_norm, runner.shape.eps)
    unit = torch.ones(final.shape[-1])
    return torch.cat([norm(torch.cat(taps[i]), unit, runner.shape.eps) for i in layers] + [final], dim=-1)


def head_rows_of(gguf_path, vocab_ids: torch.Tensor) -> torch.Tensor:
    """(len(vocab_ids), H) float32 rows of the target's output matrix (the embedding table where it is tied)."""
    from gguf import GGUFReader, dequantize

    tensors = {t.name: t for t in GGUFReader(str(gguf_path)).tensors}
    t = tensors.get("output.weight") or tensors["token_embd.weight"]
    rows = dequantize(np.asarray(t.data)[vocab_ids.numpy()], t.tensor_type)
    return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32)).reshape(len(vocab_ids), -1)


def starts(prompt: list[int], answer: list[int]) -> range:
    """The positions t a proposal starts from: t + 1 is the prompt's end or an answer position, t + 2 an answer one."""
    return range(len(prompt) - 1, len(prompt) + len(answer) - 2)


def chain_examples(runner, samples: list[tuple[list[int], list[int]]], index: torch.Tensor, depth: int,
                   layers: tuple[int, ...] = (), progress=None) -> Chains:
    """samples [(prompt, answer)] -> their `Chains` with labels `depth` deep (a sample with no start adds none)."""
    feats, rows, embs, labels, offset = [], [], [], [], 0
    for prompt, answer in (progress(samples, desc="target features", unit="req") if progress else samples):
        seq, ts = prompt + answer, list(starts(prompt, answer))
        if not ts:
            continue
        f = target_features(runner, seq[:-1], layers)[ts[0]:]  # rows t0 .. len(seq) - 2
        feats.append(f)
        rows.append(torch.tensor(ts) - ts[0] + offset)
        offset += len(f)
        embs.append(runner.embed([seq[t + 1] for t in ts]))
        labels.append(torch.tensor([[int(index[seq[t + 2 + d]]) if t + 2 + d < len(seq) else -1 for d in range(depth)]
                                    for t in ts], dtype=torch.long))
    if not feats:
        raise InvalidArgument("no sample has a position to propose from")
    return Chains(torch.cat(feats), torch.cat(rows), torch.cat(embs), torch.cat(labels))


def train_head(head: FeatureHead, chains: Chains, map_embeddings: torch.Tensor, epochs: int, lr: float, batch: int,
               steps: int = 1, feature_weight: float = 0.0, seed: int = 0, progress=None,
               dtype: torch.dtype = torch.float32) -> list[float]:
    """AdamW on `unrolled_loss` over the starts whose first label is in the map, its matrix products in `dtype`
    (bf16 autocast where the CPU has it) -> mean loss per epoch."""
    from osd.learn.precision import compute_in

    pool = (chains.labels[:, 0] >= 0).nonzero().squeeze(1)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    losses = []
    epoch_range = range(epochs)
    for _ in (progress(epoch_range, desc=f"feature head ({steps} deep)", unit="epoch") if progress else epoch_range):
        order, total, n = pool[torch.randperm(len(pool), generator=g)], 0.0, 0
        for i in range(0, len(order), batch):
            j = order[i : i + batch]
            with compute_in(dtype), warnings.catch_warnings():  # RMSNorm's fp32 weight on bf16 rows: unfused, right
                warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
                loss = unrolled_loss(head, chains, map_embeddings, j, steps, feature_weight)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total, n = total + loss.item() * len(j), n + len(j)
        losses.append(total / max(n, 1))
    return losses


def agreement(hits: list[bool]) -> float:
    """The share of positions hit (0 where there are none)."""
    return sum(hits) / max(len(hits), 1)


def head_agreement(head: FeatureHead, chains: Chains, map_embeddings: torch.Tensor) -> float:
    """The share of starts whose first proposal hits."""
    return agreement(head_chains(head, chains, map_embeddings, 1)[:, 0].tolist())


def accepted_by_depth(hits: torch.Tensor) -> list[float]:
    """(N, D) chain hits -> mean accepted proposals per step for a chain of 1 .. D proposals."""
    lengths = leading_hits(hits)
    return [float(lengths.clamp(max=d).float().mean()) if len(lengths) else 0.0 for d in range(1, hits.shape[1] + 1)]


def head_then_draft(head_chain: torch.Tensor, draft_chain: torch.Tensor) -> torch.Tensor:
    """(N, D) hits of a chain whose first proposal is the head's and the rest the draft's: after the head's hit the
    prefix is the target's, where the draft's teacher-forced proposals are exactly its chain's."""
    return torch.cat([head_chain[:, :1], draft_chain[:, 1:]], dim=1)


@torch.no_grad()
def draft_chains(draft, samples, index: torch.Tensor, depth: int) -> torch.Tensor:
    """(N, depth) the draft's greedy chain from the same starts: proposal d is its argmax after seq[:t + 2 + d].
    Teacher forcing is exact here: a chain reaches proposal d only when 0 .. d - 1 hit, i.e. on the target's prefix."""
    rows = []
    for prompt, answer in samples:
        seq, ts = prompt + answer, list(starts(prompt, answer))
        if not ts:
            continue
        logits = draft(torch.tensor([seq[:-1]])).logits[0]  # row i predicts seq[i + 1] (over the map)
        hit = torch.cat([logits.argmax(-1) == index[torch.tensor(seq[1:])], torch.zeros(depth, dtype=torch.bool)])
        rows.append(hit[torch.tensor(ts)[:, None] + 1 + torch.arange(depth)[None, :]])
    return torch.cat(rows) if rows else torch.zeros(0, depth, dtype=torch.bool)


def source_slices(entries, split: str, per_domain: int) -> list[tuple[str, str, int, int]]:
    """'name[@lang][:split][[start:end]]' entries -> (name, split, start, end): a plain name takes the first
    `per_domain` records of `split`; a slice names its own (multilingual_qa has a test split only, so its study
    trains on `multilingual_qa@de:test[0:100]` and holds out `multilingual_qa@de:test[300:306]`)."""
    from osd.models.derived import parse_text_source

    out = []
    for entry in entries:
        name, own_split, start, end = parse_text_source(entry, split)
        out.append((name, own_split, start, start + per_domain if end is None else end))
    return out


def check_disjoint(train: list[tuple[str, str, int, int]], heldout: list[tuple[str, str, int, int]]) -> None:
    """Held-out records must not be trained on: the same dataset and split may appear on both sides only with
    ranges that do not meet."""
    for name, split, start, end in heldout:
        for t_name, t_split, t_start, t_end in train:
            if (name, split) == (t_name, t_split) and start < t_end and t_start < end:
                raise InvalidArgument(f"held-out {name}:{split}[{start}:{end}] overlaps the training slice "
                                      f"[{t_start}:{t_end}]: give the held-out source a later slice")


def seconds_per_token(fn, repeats: int = 20) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats
