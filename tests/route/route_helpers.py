"""Two-mode synthetic traffic on tiny models: prompts of two token ranges, and drafts distilled on each."""
from __future__ import annotations

import random

import torch
from conftest import EOS, tiny_qwen2
from helpers import plain_greedy

from osd.drafts_multi import AdapterConfig, AdapterDrafts

MODES = {"A": range(2, 22), "B": range(24, 44)}  # disjoint token ranges: two "languages"


def mode_prompts(mode: str, n: int, seed: int = 0, length: int = 6) -> list[list[int]]:
    rng = random.Random(f"{mode}-{seed}")
    return [[rng.choice(MODES[mode]) for _ in range(length)] for _ in range(n)]


def greedy_outputs(target, prompts, n: int) -> list[list[int]]:
    return [plain_greedy(target, p, n, eos=EOS) for p in prompts]


def distill(drafts: AdapterDrafts, name: str, prompts, outputs, steps: int = 200, lr: float = 1e-2) -> None:
    """Teacher-forced cross-entropy on the target's greedy outputs, into `name`'s adapter only; then publish."""
    seqs = [(p + o, len(p)) for p, o in zip(prompts, outputs) if o]
    width = max(len(t) for t, _ in seqs) - 1
    ids = torch.zeros(len(seqs), width, dtype=torch.long)  # (B, T) right-padded: causal, so padding changes nothing
    labels = torch.full((len(seqs), width), -100)  # (B, T) the token each position predicts; -100 = not scored
    for b, (tokens, n) in enumerate(seqs):
        ids[b, : len(tokens) - 1] = torch.tensor(tokens[:-1])
        labels[b, n - 1 : len(tokens) - 1] = torch.tensor(tokens[n:])
    with drafts.use(name) as master:
        optimizer = torch.optim.Adam(drafts.parameters(name), lr=lr)
        master.train()
        for _ in range(steps):
            optimizer.zero_grad()
            logits = master(ids).logits  # (B, T, V)
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
            optimizer.step()
        master.eval()
    drafts.publish(name)


def two_mode_drafts(target, n_prompts: int = 6, n_out: int = 10, serving: str = "adapter", base_layers: int = 2):
    """Drafts "a" (distilled on mode A) and "b" (on mode B) as adapters on one tiny base; the prompts used."""
    candidates = {m: mode_prompts(m, 4 * n_prompts) for m in MODES}
    prompts = {m: [p for p in ps if len(greedy_outputs(target, [p], n_out)[0]) == n_out][:n_prompts]  # no early EOS
               for m, ps in candidates.items()}
    drafts = AdapterDrafts(tiny_qwen2(seed=1, layers=base_layers), AdapterConfig(rank=8, train_layers=0, serving=serving))
    for name, mode in (("a", "A"), ("b", "B")):
        drafts.create(name)
        distill(drafts, name, prompts[mode], greedy_outputs(target, prompts[mode], n_out))
    return drafts, prompts
