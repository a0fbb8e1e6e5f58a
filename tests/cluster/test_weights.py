"""A version on the wire (cluster/weights.py): a replica's new serving copy, made from the copy it serves plus the
shipped tensors, computes exactly what a serving copy built from the learner's master computes; a payload that does
not fit is refused whole, and the copy being served is never touched."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_qwen2

from osd.cluster.weights import DraftLoadError, changed_prefixes, serving_arrays, with_arrays
from osd.learn.trainable import configure_trainable
from osd.models.serving_draft import make_serving_draft


def _trained(quantize: str):
    master = tiny_qwen2(seed=1, layers=2)
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
