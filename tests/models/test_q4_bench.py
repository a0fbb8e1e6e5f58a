"""`osd bench kernel`'s pieces (bench/kernel.py) on tiny settings: the matrices it times, the weights it makes."""
import pytest
from conftest import kernels_required
import torch

from osd_bench import kernel as bench
from osd.models import q4


def test_fallback_matrices_are_the_bundled_q4_k_m_target():
    matrices = bench.target_matrices(None)
    assert len(matrices) == 28 * 7 + 1
    q6 = [m for m in matrices if m["type"] == "Q6_K"]
    assert sorted({m["role"] for m in q6}) == ["attn_v", "ffn_down", "output"] and len(q6) == 29
    head = matrices[-1]
    assert (head["name"], head["n"], head["k"]) == ("output.weight", 151936, 1536)
    down = next(m for m in matrices if m["role"] == "ffn_down")
    assert (down["n"], down["k"]) == (1536, 8960)


@pytest.mark.skipif(not q4.available() and not kernels_required(), reason="Q4 kernel unavailable on this machine")
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_random_weights_are_valid_kernel_input(type_name):
    w = bench.random_weight(type_name, 20, 512, torch.Generator().manual_seed(0))
    assert w.shape == (20, 512)
    y = q4.matmul(q4.quantize_activations(torch.randn(3, 512)), w)
    assert y.shape == (3, 20) and torch.isfinite(y).all() and y.abs().sum() > 0


def test_glue_estimate_runs():
    gen = torch.Generator().manual_seed(0)
    small = bench.glue_costs(max_rows=2, context=8, repeats=1, gen=gen)
    assert small["context"] == 8 and len(small["ms"]) == 2 and all(t > 0 for t in small["ms"])
