"""Learning's effect seen from outside (serve/prom.py): per draft version, acceptance and tokens per step derived
from the monotonic counters, the newest version against the first, on /metrics and as the stats line's phrase."""
from prometheus_client.parser import text_string_to_metric_families

from osd.metrics import SpecCounters, SpecMetrics
from osd.serve.prom import ServeMetrics, learning_effect, learning_summary


def _served(metrics: SpecMetrics, version: int, steps: int, k: int, accepted: int) -> None:
    for _ in range(steps):
        c = SpecCounters()
        c.add_step(k, accepted, accepted + 1, [1.0] * accepted, 0.0, 0.0)
        metrics.record(("draft", version), c)


def test_per_version_acceptance_and_tokens_per_step_against_the_first_version():
    metrics = SpecMetrics()
    _served(metrics, 0, 40, 4, 1)  # acceptance 0.25, 2 tokens per step
    _served(metrics, 1, 40, 4, 2)  # 0.5, 3
    _served(metrics, 2, 3, 4, 4)  # too few steps to count as the latest yet
    effect = learning_effect(metrics.counters())["draft"]
    assert effect["versions"][0] == {"acceptance": 0.25, "tokens_per_step": 2.0, "steps": 40}
    assert effect["first"] == 0 and effect["latest"] == 1
    assert effect["acceptance_vs_first"] == 2.0 and effect["tokens_per_step_vs_first"] == 1.5
    assert learning_summary({"draft": effect}) == "draft v1 acc 0.50 (2.00x v0) tok/step 3.00 (1.50x)"


def test_the_per_version_figures_appear_on_metrics():
    spec = SpecMetrics()
    _served(spec, 0, 40, 4, 1)
    _served(spec, 1, 40, 4, 3)
    metrics = ServeMetrics()
    metrics.attach(spec, kernel_status=lambda: {"compiled": None, "fallback": []})
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    by_version = {s.labels["draft_version"]: s.value for s in families["osd_learning_tokens_per_step"].samples}
    assert by_version == {"0": 2.0, "1": 4.0}
    assert families["osd_learning_acceptance_vs_first"].samples[0].value == 3.0
    assert families["osd_learning_tokens_per_step_vs_first"].samples[0].labels == {"draft": "draft"}
