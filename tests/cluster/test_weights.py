"""A version on the wire (cluster/weights.py): a replica's new serving copy, made from the copy it serves plus the
shipped tensors, computes exactly what a serving copy built from the learner's master computes; a payload that does
not fit is refused whole, and the copy being served is never touched."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import require_q4, tiny_qwen2

from osd.cluster.weights import DraftLoadError, changed_prefixes, q4_keys, serving_arrays, with_arrays
from osd.learn.trainable import configure_trainable
from osd.models.serving_draft import make_serving_draft


def _trained(quantize: str):
    master = tiny_qwen2(seed=1, layers=2, hidden=64 if quantize == "q4" else 32)  # the Q4 copy needs head dim 16
    base, _ = make_serving_draft(master, quantize)
    configure_trainable(master, "no_embeddings", train_layers=1)
    with torch.no_grad():  # an "update": the top layer's trainable weights move
        for p in master.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.05)
    learned, _ = make_serving_draft(master, quantize)
    return master, base, learned


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_a_replica_copy_from_shipped_tensors_equals_the_learners_serving_copy(quantize, request):
    if quantize == "int8":
        request.getfixturevalue("compiled")  # the int8 kernels (fail where required, skip elsewhere)
    master, base, learned = _trained(quantize)
    prefixes = changed_prefixes(master)
    assert prefixes and all(p.startswith("model.layers.1.") or p == "model.norm." for p in prefixes)
    arrays = serving_arrays(learned, prefixes)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    before = base(ids).logits.clone()
    replica = with_arrays(base, arrays)
    with torch.no_grad():
        assert torch.equal(replica(ids).logits, learned(ids).logits)  # bitwise what one process would serve
        assert torch.equal(base(ids).logits, before)  # the copy in service is untouched
        assert not torch.equal(replica(ids).logits, before)  # and the version did change something
    shared = {id(t) for t in base.parameters()} | {id(t) for t in base.buffers()}
    assert any(id(t) in shared for t in replica.buffers()) or any(id(t) in shared for t in replica.parameters())


def test_a_payload_that_does_not_fit_is_refused_whole():
    master, base, learned = _trained("none")
    arrays = serving_arrays(learned, changed_prefixes(master))
    name = sorted(arrays)[0]
    state = {k: v.clone() for k, v in base.state_dict().items()}
    for bad, why in (({**arrays, "model.nope.weight": arrays[name]}, "does not have"),
                     ({**arrays, name: arrays[name][..., :1]}, "published"),
                     ({**arrays, name: arrays[name].astype(np.float64)}, "float64"),
                     ({**arrays, name: np.full_like(arrays[name], np.nan)}, "non-finite"),
                     ({}, "no weights")):
        with pytest.raises(DraftLoadError, match=why):
            with_arrays(base, bad)
    assert all(torch.equal(v, state[k]) for k, v in base.state_dict().items())


def _q4_logits(copy, ids: list[int]) -> torch.Tensor:
    runner = copy.runner()
    return runner.feed(ids, n_logits=len(ids))


def test_a_q4_replica_copy_from_shipped_blocks_equals_the_learners_q4_copy():
    """A Q4 copy ships the whole changed layer's kernel blocks (q|k|v and gate|up are fused) and the final norm: the
    replica's copy, built from the one it serves, computes bitwise what the learner's own Q4 copy computes."""
    require_q4()
    master, base, learned = _trained("q4")
    prefixes = changed_prefixes(master)
    arrays = serving_arrays(learned, prefixes)
    assert {name.split(".")[1] for name in arrays} <= {"blk", "output_norm"}
    assert {name for name in arrays if ".blk.0." in name} == set()  # the untouched layer stays home
    assert any(name.startswith("matrices.blk.1.gate_up.") for name in arrays)  # a fused matrix goes whole
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    before = _q4_logits(base, ids)
    replica = with_arrays(base, arrays)
    assert torch.equal(_q4_logits(replica, ids), _q4_logits(learned, ids))
    assert torch.equal(_q4_logits(base, ids), before)  # the copy in service is untouched
    assert not torch.equal(_q4_logits(replica, ids), before)
    assert replica.weights.matrices["blk.0.qkv"] is not base.weights.matrices["blk.0.qkv"]  # a new list ...
    assert replica.weights.matrices["blk.0.qkv"][0] is base.weights.matrices["blk.0.qkv"][0]  # ... of shared blocks
    name = next(n for n in arrays if n.endswith(".qs"))
    for bad, why in (({**arrays, "matrices.blk.9.qkv.0.qs": arrays[name]}, "does not have"),
                     ({**arrays, name: arrays[name][:1]}, "published"),
                     ({**arrays, "vectors.output_norm": np.full_like(arrays["vectors.output_norm"], np.inf)}, "non-finite")):
        with pytest.raises(DraftLoadError, match=why):
            with_arrays(base, bad)
    assert torch.equal(_q4_logits(base, ids), before)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_a_q4_replica_of_another_family_gets_the_layers_qk_and_post_norms(arch):
    """Qwen3's q/k norms and Gemma 3's post-attention / post-MLP norms are a layer's tensors too: an update of the
    top layer ships them, and the replica computes bitwise what the learner's copy computes."""
    require_q4()
    from tests.models.tiny_arch_gguf import hf_model

    master = hf_model(arch, seed=1)
    base, _ = make_serving_draft(master, "q4")
    configure_trainable(master, "no_embeddings", train_layers=1)
    top = master.config.num_hidden_layers - 1
    with torch.no_grad():  # an update of the top layer's norms only
        for name, p in master.named_parameters():
            if p.requires_grad and name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.2)
    learned, _ = make_serving_draft(master, "q4")
    arrays = serving_arrays(learned, changed_prefixes(master))
    norms = ("q_norm", "k_norm") + (("attn_post_norm", "ffn_post_norm") if arch == "gemma3" else ())
    assert {f"vectors.blk.{top}.{n}" for n in norms} <= set(arrays)
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    replica = with_arrays(base, arrays)
    assert torch.equal(_q4_logits(replica, ids), _q4_logits(learned, ids))
    assert not torch.equal(_q4_logits(replica, ids), _q4_logits(base, ids))


def test_q4_keys_map_changed_modules_to_the_copys_tensors():
    assert q4_keys(["model.layers.1.mlp.down_proj."], 2) == {f"blk.1.{n}" for n in (
        "attn_norm", "ffn_norm", "qkv_bias", "qkv", "attn_output", "gate_up", "ffn_down", "q_norm", "k_norm",
        "attn_post_norm", "ffn_post_norm")}  # the last four where the family has them (Qwen3, Gemma 3)
    assert q4_keys(["model.norm.", "lm_head."], 2) == {"output_norm", "output"}
    assert q4_keys(["model.embed_tokens."], 2) == {"embd", "output"}  # a tied head is quantized from the table
    with pytest.raises(DraftLoadError, match="no place"):
        q4_keys(["model.layers.7.mlp.down_proj."], 2)
