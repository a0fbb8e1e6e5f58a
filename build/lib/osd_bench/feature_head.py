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
"""
from __future__ import annotations

import time

import numpy as np
import torch
from torch import nn

from osd.data import load_records, prompt_ids, with_context
from osd.errors import InvalidArgument


class FeatureHead(nn.Module):
    def __init__(self, hidden: int, inter: int, head_rows: torch.Tensor):
        super().__init__()
        self.fc = nn.Linear(2 * hidden, hidden)
        self.norm_in = nn.RMSNorm(hidden, eps=1e-6)
        self.gate_up = nn.Linear(hidden, 2 * inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)
        self.norm_out = nn.RMSNorm(hidden, eps=1e-6)
        self.head = nn.Linear(hidden, head_rows.shape[0], bias=False)
        with torch.no_grad():
            self.head.weight.copy_(head_rows)
            self.down.weight.mul_(0.1)

    def step(self, feature: torch.Tensor, embedding: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logits of the token at t + 2, the predicted feature at t + 1): the LM head's input, which the next
        proposal reads in place of the target's feature it does not have yet (EAGLE)."""
        x = self.fc(torch.cat([feature, embedding], dim=-1))
        gate, up = self.gate_up(self.norm_in(x)).chunk(2, dim=-1)
        predicted = self.norm_out(x + self.down(nn.functional.silu(gate) * up))
        return self.head(predicted), predicted

    def forward(self, feature: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        return self.step(feature, embedding)[0]


def target_features(runner, ids: list[int]) -> torch.Tensor:
    """(len(ids), H): the target's LM-head input (final hidden state after the output norm) at every position."""
    runner.reset()
    rows = [runner._forward(ids[i : i + runner.chunk_rows]) for i in range(0, len(ids), runner.chunk_rows)]
    return runner._glue.rms_norm(torch.cat(rows), runner.output_norm, runner.shape.eps)


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


def sample_features(runner, samples: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """Per sample (prompt, answer): the target's features over prompt + answer[:-1] (row t predicts token t + 1)."""
    return [target_features(runner, (prompt + answer)[:-1]) for prompt, answer in samples]


def examples(runner, samples: list[tuple[list[int], list[int]]], index: torch.Tensor, features=None):
    """samples [(prompt, answer)] -> (features (N, H), embeddings (N, H), labels (N,) map index or -1, next features
    (N, H)): one example per answer position t + 2 whose t + 1 is an answer position or the prompt's end; the next
    feature (the target's at t + 1) is what the head's predicted feature is fitted to. `features`: sample_features'
    result, when already computed."""
    features = features if features is not None else sample_features(runner, samples)
    feats, embs, labels, nexts = [], [], [], []
    for (prompt, answer), f in zip(samples, features):
        seq, ts = prompt + answer, list(starts(prompt, answer))
        if not ts:
            continue
        feats.append(f[ts])
        nexts.append(f[[t + 1 for t in ts]])
        embs.append(runner.embed([seq[t + 1] for t in ts]))
        labels.append(index[torch.tensor([seq[t + 2] for t in ts])])
    return torch.cat(feats), torch.cat(embs), torch.cat(labels), torch.cat(nexts)


def train_head(head: FeatureHead, data, epochs: int, lr: float, batch: int, seed: int = 0, progress=None,
               feature_weight: float = 0.0) -> list[float]:
    """AdamW on cross entropy (positions outside the map left out), plus feature_weight x smooth L1 between the
    predicted feature and the target's next one (EAGLE: what deeper proposals read) -> mean loss per epoch."""
    feats, embs, labels, nexts = data
    keep = labels >= 0
    feats, embs, labels, nexts = feats[keep], embs[keep], labels[keep], nexts[keep]
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in (progress(range(epochs), desc="feature head", unit="epoch") if progress else range(epochs)):
        order, total, n = torch.randperm(len(labels), generator=g), 0.0, 0
        for i in range(0, len(order), batch):
            j = order[i : i + batch]
            logits, predicted = head.step(feats[j], embs[j])
            loss = nn.functional.cross_entropy(logits, labels[j])
            if feature_weight:
                loss = loss + feature_weight * nn.functional.smooth_l1_loss(predicted, nexts[j])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total, n = total + loss.item() * len(j), n + len(j)
        losses.append(total / max(n, 1))
    return losses


@torch.no_grad()
def head_hits(head: FeatureHead, data) -> list[bool]:
    """Per example: does the head's top-1 equal the target's token (a token outside the map is a miss)?"""
    feats, embs, labels = data[:3]
    return (head(feats, embs).argmax(-1) == labels).tolist()


def agreement(hits: list[bool]) -> float:
    """The share of positions hit (0 where there are none)."""
    return sum(hits) / max(len(hits), 1)


def head_agreement(head: FeatureHead, data) -> float:
    return agreement(head_hits(head, data))


def leading_hits(hits: torch.Tensor) -> torch.Tensor:
    """(N, D) bool -> (N,) the hits before each row's first miss: a chain's accepted length."""
    return hits.long().cumprod(dim=1).sum(dim=1)


def accepted_by_depth(hits: torch.Tensor) -> list[float]:
    """(N, D) chain hits -> mean accepted proposals per step for a chain of 1 .. D proposals."""
    lengths = leading_hits(hits)
    return [float(lengths.clamp(max=d).float().mean()) if len(lengths) else 0.0 for d in range(1, hits.shape[1] + 1)]


def head_then_draft(head_chain: torch.Tensor, draft_chain: torch.Tensor) -> torch.Tensor:
    """(N, D) hits of a chain whose first proposal is the head's and the rest the draft's: after the head's hit the
    prefix is the target's, where the draft's teacher-forced proposals are exactly its chain's."""
    return torch.cat([head_chain[:, :1], draft_chain[:, 1:]], dim=1)


def paired_mean_difference(base: torch.Tensor, other: torch.Tensor) -> dict:
    """Per-start accepted lengths, paired: mean of other - base and its z (mean over standard error; 0 when every
    difference is the same)."""
    d = (other.double() - base.double())
    if len(d) < 2:
        return {"mean_difference": float(d.mean()) if len(d) else 0.0, "z": 0.0, "n": len(d)}
    se = float(d.std(unbiased=True)) / len(d) ** 0.5
    return {"mean_difference": float(d.mean()), "z": float(d.mean()) / se if se > 0 else 0.0, "n": len(d)}


@torch.no_grad()
def head_chains(head: FeatureHead, runner, samples, features, index: torch.Tensor, vocab_ids: torch.Tensor,
                depth: int) -> torch.Tensor:
    """(N, depth) hits of the head's own chain from every start `examples` makes, in its order. Proposal 0 reads the
    target's feature at t and its token at t + 1; proposal d > 0 reads the feature the head predicted at d - 1 and
    the token it proposed there, as it would in serving (past the answer's end a proposal misses)."""
    rows = []
    for (prompt, answer), f in zip(samples, features):
        seq, ts = prompt + answer, list(starts(prompt, answer))
        if not ts:
            continue
        feature, embedding, hits = f[ts], runner.embed([seq[t + 1] for t in ts]), []
        for d in range(depth):
            logits, feature = head.step(feature, embedding)
            guess = logits.argmax(-1)
            truth = torch.tensor([int(index[seq[t + 2 + d]]) if t + 2 + d < len(seq) else -2 for t in ts])
            hits.append(guess == truth)
            embedding = runner.embed(vocab_ids[guess].tolist())
        rows.append(torch.stack(hits, dim=1))
    return torch.cat(rows) if rows else torch.zeros(0, depth, dtype=torch.bool)


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


def run_feature_head(target: str, draft: str, train_domains, train_per_domain: int, heldout_domains,
                     heldout_per_domain: int, max_new_tokens: int, epochs: int, lr: float, batch: int, inter: int,
                     progress=None, depth: int = 4, feature_weight: float = 1.0) -> dict:
    from osd_bench.replay_fast import paired_difference
    from osd.models.loading import gguf_file, load_model, load_tokenizer
    from osd.models.q4_batch import greedy_many
    from osd.models.q4_runner import Q4Runner
    from osd.models.runner import eos_ids_of
    from osd.models.vocab_map import vocab_ids_of

    train_slices, heldout_slices = source_slices(train_domains, "train", train_per_domain), \
        source_slices(heldout_domains, "test", heldout_per_domain)
    check_disjoint(train_slices, heldout_slices)  # before any model loads
    gguf = gguf_file(target)
    runner, tokenizer = Q4Runner(gguf, n_ctx=2048), load_tokenizer(target)
    draft_model = load_model(draft)
    vocab_ids = vocab_ids_of(draft_model)
    index = torch.full((runner.vocab_size,), -1, dtype=torch.long)  # target id -> row of the map
    index[vocab_ids] = torch.arange(len(vocab_ids))
    eos = runner.eos_ids | eos_ids_of(tokenizer)

    def answered(slices, split):
        prompts = [prompt_ids(tokenizer, with_context(r)) for name, own, start, end in slices
                   for r in load_records(name, own, end - start, offset=start)]
        prompts = [p for p in prompts if len(p) <= 512]
        out = [None] * len(prompts)
        it = greedy_many(runner, prompts, [max_new_tokens] * len(prompts), eos, lambda logits: None, 8)
        for i, answer, _ in (progress(it, total=len(prompts), desc=f"target answers ({split})", unit="req")
                             if progress else it):
            out[i] = (prompts[i], [t for t in answer if t not in eos])
        return out

    t0 = time.perf_counter()
    train_samples, heldout_samples = answered(train_slices, "train"), answered(heldout_slices, "test")
    heldout_features = sample_features(runner, heldout_samples)
    train, heldout = examples(runner, train_samples, index), examples(runner, heldout_samples, index, heldout_features)
    data_seconds = time.perf_counter() - t0
    torch.manual_seed(0)
    head = FeatureHead(runner.shape.hidden, inter, head_rows_of(gguf, vocab_ids))
    before = head_agreement(head, heldout)
    t0 = time.perf_counter()
    losses = train_head(head, train, epochs, lr, batch, progress=progress, feature_weight=feature_weight)
    train_seconds = time.perf_counter() - t0
    head_chain = head_chains(head.eval(), runner, heldout_samples, heldout_features, index, vocab_ids, depth)
    draft_chain = draft_chains(draft_model, heldout_samples, index, depth)
    head_hit, draft_hit = head_chain[:, 0].tolist(), draft_chain[:, 0].tolist()
    hybrid = head_then_draft(head_chain, draft_chain)
    f1, e1 = heldout[0][:1], heldout[1][:1]
    one = torch.tensor([[heldout_samples[0][0][-1]]])
    with torch.no_grad():
        head_s = seconds_per_token(lambda: head(f1, e1))
        draft_s = seconds_per_token(lambda: draft_model(one))
        target_s = seconds_per_token(lambda: (runner.reset(), runner.feed([1], n_logits=1)), repeats=5)
    return {
        "config": {"target": target, "draft": draft, "train_domains": list(train_domains), "train_per_domain":
                   train_per_domain, "heldout_domains": list(heldout_domains), "heldout_per_domain": heldout_per_domain,
                   "train_slices": [list(x) for x in train_slices], "heldout_slices": [list(x) for x in heldout_slices],
                   "max_new_tokens": max_new_tokens, "epochs": epochs, "lr": lr, "batch": batch, "inter": inter,
                   "map_rows": len(vocab_ids), "depth": depth, "feature_weight": feature_weight},
        "train_positions": int(len(train[2])), "train_positions_in_map": int((train[2] >= 0).sum()),
        "heldout_positions": int(len(heldout[2])), "heldout_positions_in_map": int((heldout[2] >= 0).sum()),
        "head_parameters": sum(p.numel() for p in head.parameters()),
        "loss_by_epoch": losses,
        "first_proposal_agreement": {"feature_head_untrained": before, "feature_head": agreement(head_hit),
                                     "cheap_draft": agreement(draft_hit)},
        "head_vs_draft": paired_difference(draft_hit, head_hit),  # same positions: a sign test on the flips
        # a chain of d proposals from every held-out start: mean accepted (the head reads its own predicted features)
        "accepted_by_depth": {"feature_head": accepted_by_depth(head_chain), "cheap_draft": accepted_by_depth(draft_chain),
                              "head_then_draft": accepted_by_depth(hybrid)},
        "accepted_head_vs_draft": paired_mean_difference(leading_hits(draft_chain), leading_hits(head_chain)),
        "accepted_head_then_draft_vs_draft": paired_mean_difference(leading_hits(draft_chain), leading_hits(hybrid)),
        "seconds_per_token_fp32": {"feature_head": head_s, "cheap_draft_torch": draft_s, "target_q4": target_s},
        "data_seconds": data_seconds, "train_seconds": train_seconds,
    }


def register(bench) -> None:
    p = bench.add_parser("feature-head", help="feasibility: a head on the target's features vs the cheap draft, "
                         "first-proposal agreement on held-out prompts")
    p.add_argument("--target", default="bundled:qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="derived:cheap-0.5b-v3", help="the draft to compare with; its map is the head's")
    p.add_argument("--train-domains", default="gsm8k,spider,code,support",
                   help="datasets, each optionally name[@lang][:split][[start:end]] (default split train, the first "
                        "--train-per-domain records)")
    p.add_argument("--train-per-domain", type=int, default=40)
    p.add_argument("--heldout-domains", default="code,gsm8k,spider,chat",
                   help="as --train-domains (default split test); a slice may not overlap a training one")
    p.add_argument("--heldout-per-domain", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--inter", type=int, default=2048, help="the head's MLP width")
    p.add_argument("--depth", type=int, default=4, help="chain length scored on the held-out starts (the head reads "
                   "its own predicted feature past the first proposal)")
    p.add_argument("--feature-weight", type=float, default=1.0,
                   help="weight of the smooth-L1 fit of the predicted feature to the target's next one (0 = tokens only)")
    p.add_argument("--out", default="benchmarks/feature-head.json")
    p.add_argument("--markdown", default="BENCHMARKS.md", help="append a summary here ('' = no)")
    p.set_defaults(func=_cmd)


def _cmd(args) -> None:
    import sys

    from tqdm import tqdm

    from osd.records import emit_report, redacted_command, write_result
    from osd_bench.report import table

    split = lambda s: tuple(x for x in s.split(",") if x)  # noqa: E731
    result = run_feature_head(args.target, args.draft, split(args.train_domains), args.train_per_domain,
                              split(args.heldout_domains), args.heldout_per_domain, args.max_new_tokens, args.epochs,
                              args.lr, args.batch, args.inter, progress=tqdm, depth=args.depth,
                              feature_weight=args.feature_weight)
    path = write_result(result, args.out)
    a, s, acc = result["first_proposal_agreement"], result["seconds_per_token_fp32"], result["accepted_by_depth"]
    rows = [["feature head (trained)", a["feature_head"], *acc["feature_head"], s["feature_head"] * 1e3],
            ["feature head (untrained)", a["feature_head_untrained"], *[None] * args.depth, None],
            [f"cheap draft ({args.draft})", a["cheap_draft"], *acc["cheap_draft"], s["cheap_draft_torch"] * 1e3],
            ["head's first proposal, then the draft's", a["feature_head"], *acc["head_then_draft"], None]]
    vs, mixed = result["accepted_head_vs_draft"], result["accepted_head_then_draft_vs_draft"]
    notes = (f"{result['train_positions']} training positions ({result['train_positions_in_map']} in the map), "
             f"{result['heldout_positions']} held-out ({result['heldout_positions_in_map']} in the map); head "
             f"{result['head_parameters'] / 1e6:.1f}M parameters; loss by epoch "
             + ", ".join(f"{x:.2f}" for x in result["loss_by_epoch"])
             + f"; head vs draft on the same positions: {result['head_vs_draft']['gained']} gained, "
             f"{result['head_vs_draft']['lost']} lost, z {result['head_vs_draft']['z']:.2f}"
             + f"; accepted per step at depth {args.depth}, head minus draft: {vs['mean_difference']:+.3f} "
             f"(z {vs['z']:.2f}, {vs['n']} starts); head's first proposal then the draft's, minus the draft: "
             f"{mixed['mean_difference']:+.3f} (z {mixed['z']:.2f})"
             + f"; target one token on the Q4 kernel {s['target_q4'] * 1e3:.1f} ms; data {result['data_seconds']:.0f} s, "
             f"training {result['train_seconds']:.0f} s")
    emit_report("A draft that reads the target's features (`osd bench feature-head`)",
                f"`{redacted_command(sys.argv[1:])}`",
                [table(rows, ["proposer", "first-proposal agreement (held-out)",
                              *[f"accepted per step, chain of {d}" for d in range(1, args.depth + 1)],
                              "ms per proposal (fp32 torch)"]), notes],
                path, args.markdown)
