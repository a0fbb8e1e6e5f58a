"""`osd bench scale --replay N`: does one learner fed by N replicas beat N replicas each learning alone? A fast greedy
replay (bench/replay_fast.py, the evidence recipe) splits one stream across N simulated replicas:

- pooled: one learner sees every replica's samples, interleaved as they arrive: the whole stream, in order;
- alone: replica i learns only from its own share (stream[i::N]), as N separate one-process servers would.

After the same traffic per replica (R requests each; N x R in all), every draft is measured on the same held-out
requests (no draft trained on them), paired with the never-trained control and with each other (sign-test z on the
same positions). Updates are synchronous here (the fast path): a live cluster's learner publishes later, by its
training time and a publish-to-swap latency (measured by `osd bench scale`)."""
from __future__ import annotations

from osd_bench.replay_fast import _matches, fast_replay, paired_difference
from osd.distill.cache import DecodeSettings
from osd.distill.evaluate import sample_item
from osd.distill.target_outputs import dataset_samples
from osd.learn.trainable import split_index
from osd.models.loading import load_model


def run_split_replay(models, learn, dataset: str, per_replica: int, replicas: int, heldout: int = 40, k: int = 6,
                     max_new_tokens: int = 64, progress=None) -> dict:
    settings = DecodeSettings(max_new_tokens=max_new_tokens, top_k=learn.top_k)
    stream = dataset_samples(models, dataset, "train", per_replica * replicas, settings, progress=progress)[0]
    unseen_samples = dataset_samples(models, dataset, "test", heldout, settings, progress=progress)[0]
    unseen = {dataset: unseen_samples}
    base = load_model(models.draft, models.draft_dtype)
    split = split_index(base, learn.train_layers)
    items = [sample_item(s) for s in unseen_samples]
    control = _matches(base, items, unseen_samples, split)

    def replay(samples):
        out = fast_replay(samples, [dataset] * len(samples), base, learn, k, baselines=False, heldout=unseen,
                          progress=progress, max_new_tokens=max_new_tokens, keep_online=True)
        return out, _matches(out.pop("online_draft"), items, unseen_samples, split)

    pooled, pooled_matches = replay(stream)
    alone = [replay(stream[i::replicas]) for i in range(replicas)]
    rate = lambda m: sum(m) / max(1, len(m))
    return {"dataset": dataset, "replicas": replicas, "per_replica": per_replica, "heldout_positions": len(control),
            "control_alpha": rate(control),
            "pooled": {"alpha": rate(pooled_matches), "vs_control": paired_difference(control, pooled_matches),
                       "optimizer_steps": pooled["learner"]["optimizer_steps"],
                       "updates_published": pooled["learner"]["updates_published"],
                       "replay_seconds": pooled["timings"].get("replay_seconds")},
            "alone": [{"replica": i, "alpha": rate(m), "vs_control": paired_difference(control, m),
                       "pooled_vs_this": paired_difference(m, pooled_matches),
                       "optimizer_steps": out["learner"]["optimizer_steps"],
                       "updates_published": out["learner"]["updates_published"],
                       "replay_seconds": out["timings"].get("replay_seconds")} for i, (out, m) in enumerate(alone)]}
