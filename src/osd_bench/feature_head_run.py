"""`osd bench feature-head`'s run: the target answers train and held-out prompts, its features are read, one head is
trained per arm on the same data (`--arms`: the training-time test's depth and the target layers read), and each
head's chains are scored against the cheap draft's from the same held-out starts. The head and its math:
`feature_head.py`.

`--data-cache FILE` keeps the target's answers and features (the slow part: about 25 minutes for 400 prompts on 2
cores) so that more arms can be trained on them later; a cache made for another configuration is not read.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from osd.data import load_records, prompt_ids, with_context
from osd.errors import InvalidArgument
from osd.models.feature_head import FeatureHead, int8_head, save_head
from osd_bench.feature_head import (accepted_by_depth, agreement, chain_examples, check_disjoint,
                                    draft_chains, head_agreement, head_chains, head_rows_of, head_then_draft,
                                    leading_hits, paired_mean_difference, seconds_per_token, source_slices,
                                    train_head)


def parse_arms(text: str) -> list[tuple[int, tuple[int, ...]]]:
    """'1,3,3@2+14+25' -> [(1, ()), (3, ()), (3, (2, 14, 25))]: per arm, the training-time test's depth (1: the
    single-step head) and the target layers read besides the last (none: the LM head's input only)."""
    arms = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        steps, _, layers = item.partition("@")
        try:
            arm = (int(steps), tuple(int(x) for x in layers.split("+") if x))
        except ValueError:
            raise InvalidArgument(f"an arm is STEPS[@LAYER+LAYER...], e.g. 3@2+14+25; got {item!r}") from None
        if arm[0] < 1 or any(i < 0 for i in arm[1]):
            raise InvalidArgument(f"an arm's steps must be >= 1 and its layers >= 0; got {item!r}")
        arms.append(arm)
    if not arms:
        raise InvalidArgument("--arms names no arm")
    return arms


def arm_name(steps: int, layers: tuple[int, ...]) -> str:
    return f"{steps} deep" + (f", layers {'+'.join(map(str, layers))} + last" if layers else "")


def _data(runner, tokenizer, target, train_slices, heldout_slices, max_new_tokens, index, depth, layers, cache,
          progress):
    """-> (layers read, train samples, held-out samples, train Chains, held-out Chains, seconds), from `cache` when it
    holds this configuration's with at least these layers (then its layers are the ones read)."""
    from osd.models.q4_batch import greedy_many
    from osd.models.runner import eos_ids_of

    key = json.dumps([target, train_slices, heldout_slices, max_new_tokens, depth])
    if cache and Path(cache).exists():
        saved = torch.load(cache, weights_only=False)
        if saved["key"] == key and set(layers) <= set(saved["layers"]):
            return (tuple(saved["layers"]), *saved["data"])
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
    train = chain_examples(runner, train_samples, index, depth, layers, progress)
    heldout = chain_examples(runner, heldout_samples, index, depth, layers, progress)
    data = (train_samples, heldout_samples, train, heldout, time.perf_counter() - t0)
    if cache:
        Path(cache).parent.mkdir(parents=True, exist_ok=True)
        torch.save({"key": key, "layers": list(layers), "data": data}, cache)
    return (layers, *data)


def run_feature_head(target: str, draft: str, train_domains, train_per_domain: int, heldout_domains,
                     heldout_per_domain: int, max_new_tokens: int, epochs: int, lr: float, batch: int, inter: int,
                     progress=None, depth: int = 4, feature_weight: float = 1.0, arms=((1, ()),),
                     precision: str = "auto", data_cache: str = "", save_head_to: str = "") -> dict:
    """save_head_to: write the last arm's head there (osd serve --head reads it); it must read the last layer only."""
    from osd.learn.precision import training_dtype
    from osd.models.loading import gguf_file, load_model, load_tokenizer
    from osd.models.q4_runner import Q4Runner
    from osd.models.vocab_map import target_to_draft, vocab_ids_of
    from osd_bench.replay_fast import paired_difference

    train_slices, heldout_slices = source_slices(train_domains, "train", train_per_domain), \
        source_slices(heldout_domains, "test", heldout_per_domain)
    check_disjoint(train_slices, heldout_slices)  # before any model loads
    if save_head_to and arms[-1][1]:
        raise InvalidArgument("--save-head saves the last arm, which must read the last layer only (the serving path "
                              f"keeps that one): {arm_name(*arms[-1])} reads layers {list(arms[-1][1])} too")
    if max(steps for steps, _ in arms) > depth:
        raise InvalidArgument(f"an arm trains chains deeper than --depth {depth}: raise --depth")
    gguf = gguf_file(target)
    runner, tokenizer = Q4Runner(gguf, n_ctx=2048), load_tokenizer(target)
    if any(i >= len(runner.layers) for _, layers in arms for i in layers):
        raise InvalidArgument(f"the target has layers 0 .. {len(runner.layers) - 1}")
    draft_model = load_model(draft)
    vocab_ids = vocab_ids_of(draft_model)
    index = target_to_draft(vocab_ids, runner.vocab_size)  # target id -> row of the map (-1 off it)
    tapped = tuple(sorted({i for _, layers in arms for i in layers}))
    tapped, train_samples, heldout_samples, train, heldout, data_seconds = _data(
        runner, tokenizer, target, train_slices, heldout_slices, max_new_tokens, index, depth, tapped, data_cache,
        progress)
    map_embeddings, head_rows, hidden = runner.embed(vocab_ids.tolist()), head_rows_of(gguf, vocab_ids), \
        runner.shape.hidden
    dtype = training_dtype(precision)
    draft_chain = draft_chains(draft_model, heldout_samples, index, depth)
    draft_hit = draft_chain[:, 0].tolist()
    results = []
    for steps, layers in arms:
        keep = [tapped.index(i) for i in layers] + [len(tapped)]  # the arm's blocks, the last layer's last
        arm_train, arm_heldout = train.blocks(keep, hidden), heldout.blocks(keep, hidden)
        torch.manual_seed(0)
        head = FeatureHead(hidden, inter, head_rows, inputs=len(keep))
        before = head_agreement(head, arm_heldout, map_embeddings)
        t0 = time.perf_counter()
        losses = train_head(head, arm_train, map_embeddings, epochs, lr, batch, steps=steps,
                            feature_weight=feature_weight, progress=progress, dtype=dtype)
        train_seconds = time.perf_counter() - t0
        head_chain = head_chains(head.eval(), arm_heldout, map_embeddings, depth)
        head_hit = head_chain[:, 0].tolist()
        hybrid = head_then_draft(head_chain, draft_chain)
        first = arm_heldout.features[arm_heldout.rows[:1]], arm_heldout.first_embedding[:1]
        served = int8_head(head)
        with torch.no_grad():
            head_s = seconds_per_token(lambda: head(*first))
            head_int8_s = min(seconds_per_token(lambda: served(*first)) for _ in range(3)) if served else None
        results.append({
            "name": arm_name(steps, layers), "steps": steps, "layers": list(layers),
            "head_parameters": sum(p.numel() for p in head.parameters()),
            "loss_by_epoch": losses, "train_seconds": train_seconds,
            "first_proposal_agreement": {"untrained": before, "trained": agreement(head_hit)},
            "first_proposal_vs_draft": paired_difference(draft_hit, head_hit),  # sign test, flips
            "accepted_by_depth": accepted_by_depth(head_chain),  # the head reads its own predicted features
            "accepted_vs_draft": paired_mean_difference(leading_hits(draft_chain), leading_hits(head_chain)),
            "head_then_draft_accepted_by_depth": accepted_by_depth(hybrid),
            "head_then_draft_vs_draft": paired_mean_difference(leading_hits(draft_chain), leading_hits(hybrid)),
            "seconds_per_proposal_fp32": head_s, "seconds_per_proposal_int8": head_int8_s})
    if save_head_to:
        save_head(save_head_to, head, vocab_ids, {"trained_by": "osd bench feature-head", "arm": results[-1]["name"],
                                                  "target": target, "map_from": draft, "epochs": epochs,
                                                  "train_slices": [list(x) for x in train_slices],
                                                  "first_proposal_agreement": results[-1]["first_proposal_agreement"]})
    one = torch.tensor([[heldout_samples[0][0][-1]]])
    with torch.no_grad():
        draft_s = seconds_per_token(lambda: draft_model(one))
    serving_cost = _serving_cost(draft_model, runner, results)
    return {
        "config": {"target": target, "draft": draft, "train_domains": list(train_domains), "train_per_domain":
                   train_per_domain, "heldout_domains": list(heldout_domains), "heldout_per_domain": heldout_per_domain,
                   "train_slices": [list(x) for x in train_slices], "heldout_slices": [list(x) for x in heldout_slices],
                   "max_new_tokens": max_new_tokens, "epochs": epochs, "lr": lr, "batch": batch, "inter": inter,
                   "map_rows": len(vocab_ids), "depth": depth, "feature_weight": feature_weight,
                   "arms": [[s, list(layers)] for s, layers in arms], "precision": precision,
                   "training_dtype": str(dtype).removeprefix("torch.")},
        "train_positions": int(len(train.labels)), "train_positions_in_map": int((train.labels[:, 0] >= 0).sum()),
        "heldout_positions": int(len(heldout.labels)),
        "heldout_positions_in_map": int((heldout.labels[:, 0] >= 0).sum()),
        "arms": results,
        "cheap_draft": {"first_proposal_agreement": agreement(draft_hit),
                        "accepted_by_depth": accepted_by_depth(draft_chain), "seconds_per_proposal_fp32": draft_s},
        "data_seconds": data_seconds, "serving_cost": serving_cost,
    }


def _serving_cost(draft_model, runner, arms: list[dict]) -> dict:
    """One proposal's cost as served, as a share c of one target token (a proposal pays only when c is small):
    the cheap draft's int8 serving copy on its glue runner (one token after a 64-token context) against each
    head's int8 copy, the target's single-token feed measured beside them (minimum of 3 rounds each)."""
    from osd.distill.draft_cost import draft_token_seconds, target_token_seconds
    from osd.models.serving_draft import make_serving_draft

    serving, vocab_ids = make_serving_draft(draft_model, "int8", allow_kernel_fallback=True)
    target = min(target_token_seconds(runner) for _ in range(3))
    draft = min(draft_token_seconds(serving, vocab_ids, runner.vocab_size) for _ in range(3))
    return {"target_ms": target * 1e3, "cheap_draft_int8_ms": draft * 1e3, "cheap_draft_c": draft / target,
            "heads": {arm["name"]: {"int8_ms": arm["seconds_per_proposal_int8"] * 1e3,
                                    "c": arm["seconds_per_proposal_int8"] / target}
                      for arm in arms if arm["seconds_per_proposal_int8"] is not None}}


def register(bench) -> None:
    p = bench.add_parser("feature-head", help="feasibility: heads on the target's features (EAGLE family) vs the "
                         "cheap draft, chains of proposals scored on held-out prompts")
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
                   help="weight of the smooth-L1 fit of the predicted feature to the target's next one "
                        "(0 = tokens only)")
    p.add_argument("--arms", default="1,2",
                   help="heads to train on the same data, comma-separated, each STEPS[@LAYER+...]: the training-time "
                        "test's chain length (1: single-step) and the target layers read besides the last "
                        "(EAGLE-3 reads a low, a middle and a high one, e.g. 3@2+14+25; default: the single-step "
                        "head and the one trained 2 deep, which docs/feature-head.md found pays)")
    p.add_argument("--precision", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="the heads' training matrix products (auto: bf16 where the CPU multiplies it natively)")
    p.add_argument("--data-cache", default="", help="keep the target's answers and features in this file and reuse "
                   "them when it holds the same configuration's (default: none)")
    p.add_argument("--save-head", default="", help="write the last arm's trained head to this file, which `osd serve "
                   "--head` serves (default: none)")
    p.add_argument("--out", default="benchmarks/drafts/feature-head.json")
    p.add_argument("--markdown", default="", help="also append the tables to this markdown file (default: none)")
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
                              feature_weight=args.feature_weight, arms=parse_arms(args.arms),
                              precision=args.precision, data_cache=args.data_cache, save_head_to=args.save_head)
    path = write_result(result, args.out)
    draft = result["cheap_draft"]
    rows = [[f"cheap draft ({args.draft})", draft["first_proposal_agreement"], *draft["accepted_by_depth"], None, None,
             draft["seconds_per_proposal_fp32"] * 1e3]]
    for arm in result["arms"]:
        vs = arm["accepted_vs_draft"]
        rows.append([f"head, {arm['name']}", arm["first_proposal_agreement"]["trained"], *arm["accepted_by_depth"],
                     f"{vs['mean_difference']:+.3f} (z {vs['z']:.1f})", round(arm["train_seconds"]),
                     arm["seconds_per_proposal_fp32"] * 1e3])
        rows.append([f"head ({arm['name']}) first, then the draft", arm["first_proposal_agreement"]["trained"],
                     *arm["head_then_draft_accepted_by_depth"], None, None, None])
    notes = (f"{result['train_positions']} training starts ({result['train_positions_in_map']} in the map), "
             f"{result['heldout_positions']} held-out ({result['heldout_positions_in_map']} in the map); training in "
             f"{result['config']['training_dtype']}; data {result['data_seconds']:.0f} s")
    cost = result["serving_cost"]
    notes += (f"; served int8, a proposal against one target token on the Q4 kernel ({cost['target_ms']:.1f} ms): "
              f"cheap draft "
              f"{cost['cheap_draft_int8_ms']:.2f} ms (c {cost['cheap_draft_c']:.3f})"
              + "".join(f", head {name} {h['int8_ms']:.2f} ms (c {h['c']:.3f})" for name, h in cost["heads"].items()))
    emit_report("Drafts that read the target's features (`osd bench feature-head`)",
                f"`{redacted_command(sys.argv[1:])}`",
                [table(rows, ["proposer", "first-proposal agreement (held-out)",
                              *[f"accepted per step, chain of {d}" for d in range(1, args.depth + 1)],
                              f"accepted at {args.depth} minus the draft's", "training s", "ms per proposal (fp32)"]),
                 notes], path, args.markdown)
