"""`osd bench target-quant` (bench/target_quant.py): the agreement metric on constructed logits, and the whole
command end to end on a tiny model directory."""
import json
import math

import pytest
from conftest import skip_or_fail
import torch
from conftest import save_tiny_pair

from osd_bench.target_quant import agreement, rates, teacher_forced_logits
from osd.cli import main
from osd.errors import KernelUnavailable
from osd.models import kernels


def test_agreement_counts_argmax_matches_and_sums_kl_reference_to_quantized():
    log = math.log
    reference = torch.tensor([[log(0.75), log(0.25)],  # argmax 0 in both, same distribution up to a shift: KL 0
                              [log(0.75), log(0.25)],  # argmax flips: KL(ref||q) = 0.75 ln 3 - 0.25 ln 3 = 0.5 ln 3
                              [2.0, 0.0],  # same argmax, q flatter: KL = p0 ln(2 p0) + p1 ln(2 p1)
                              [0.0, 5.0]], dtype=torch.float64)
    quantized = torch.tensor([[log(0.75) + 3.0, log(0.25) + 3.0],
                              [log(0.25), log(0.75)],
                              [1.0, 1.0],
                              [0.0, 5.0]], dtype=torch.float64)
    counts = agreement(reference, quantized)
    p0 = math.exp(2) / (math.exp(2) + 1)
    expected_kl = 0.5 * math.log(3) + p0 * math.log(2 * p0) + (1 - p0) * math.log(2 * (1 - p0))
    assert counts["positions"] == 4 and counts["argmax_agree"] == 3
    assert counts["kl_sum"] == pytest.approx(expected_kl, rel=1e-9)
    swapped = agreement(quantized, reference)  # the direction matters: KL(quantized || reference) differs
    assert swapped["kl_sum"] != pytest.approx(expected_kl, rel=1e-3)
    derived = rates({**counts, "prompts": 2, "identical_answers": 1, "reference_tokens": 10,
                     "reference_decode_seconds": 0.5, "quantized_tokens": 0, "quantized_decode_seconds": 0.0})
    assert derived == {"argmax_agreement": 0.75, "mean_kl": pytest.approx(expected_kl / 4), "answer_identity": 0.5,
                       "reference_ms_per_token": 50.0, "quantized_ms_per_token": None}


def test_teacher_forced_logits_are_the_ones_greedy_decoding_saw(target_model):
    from helpers import plain_greedy

    prompt = [5, 6, 7]
    answer = plain_greedy(target_model, prompt, 6)
    logits = teacher_forced_logits(target_model, prompt, answer)  # (7, V): each answer token, then the next one
    assert logits.shape == (7, target_model.config.vocab_size)
    assert logits[:-1].argmax(-1).tolist() == answer
    assert int(logits[-1].argmax()) == plain_greedy(target_model, prompt, 7)[-1]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    try:
        kernels.load()
    except KernelUnavailable as e:
        skip_or_fail(f"the compiled kernels cannot be built here: {e}")
    root = tmp_path_factory.mktemp("target-quant")
    save_tiny_pair(root)
    for name, words in (("one", ["add two numbers", "sort a list"]), ("two", ["select all rows", "count the apples"])):
        rows = [{"id": f"{name}{i}", "split": "test", "prompt": w} for i, w in enumerate(words * 2)]
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_bench_target_quant_end_to_end_on_a_tiny_model(workspace, capsys):
    root = workspace
    out, md = root / "tq.json", root / "B.md"
    argv = ["bench", "target-quant", "--target", str(root / "target"), "--datasets",
            f"{root / 'one.jsonl'},{root / 'two.jsonl'}", "--limit", "3", "--max-new-tokens", "12", "--out", str(out),
            "--markdown", str(md)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    rows, overall = result["per_prompt"], result["overall"]
    assert len(rows) == 6 and set(result["per_dataset"]) == {str(root / "one.jsonl"), str(root / "two.jsonl")}
    assert overall["positions"] == sum(r["reference_tokens"] + 1 for r in rows)  # answer positions + the one after
    assert overall["argmax_agreement"] == sum(r["argmax_agree"] for r in rows) / overall["positions"]
    assert 0.5 <= overall["argmax_agreement"] <= 1.0 and 0.0 < overall["mean_kl"] < 0.5  # int8: close, not equal
    assert overall["answer_identity"] == sum(r["identical_answers"] for r in rows) / 6
    assert overall["reference_ms_per_token"] > 0 and overall["quantized_ms_per_token"] > 0
    assert result["weight_gib"]["quantized"] < result["weight_gib"]["reference"] / 3
    assert result["warmup_excluded"] and result["machine"]["cores"] > 0 and result["git_revision"]
    assert "Target quantization (`osd bench target-quant`)" in md.read_text()
    assert "argmax agreement" in capsys.readouterr().out


def test_bench_target_quant_refuses_bad_arguments(workspace, capsys):
    root = workspace
    assert main(["bench", "target-quant", "--target", str(root / "target"), "--datasets", str(root / "one.jsonl"),
                 "--limit", "0", "--markdown", ""]) == 2
    assert "--limit >= 1" in capsys.readouterr().err
