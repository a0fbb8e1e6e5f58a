"""The serving copy of a draft: independent of the master it came from, int8 without any fp32 matrix left."""
from __future__ import annotations

import pytest
from conftest import skip_or_fail
import torch

from osd.learn.trainable import LoRALinear, configure_trainable
from osd.models.kernels import rows_linear_int8
from osd.models.serving_draft import Int8Embedding, make_serving_draft
from tests.conftest import tiny_qwen2

IDS = torch.tensor([[3, 7, 9, 11, 2, 5]])


def _storages(model) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers()) if t.numel()}


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_serving_copy_shares_no_tensor_with_the_master_and_ignores_later_training(quantize):
    if quantize == "int8" and rows_linear_int8() is None:
        skip_or_fail("the int8 kernel cannot be built here")
    master = tiny_qwen2(1, tied=True)
    configure_trainable(master, "all")
    serving, _ = make_serving_draft(master, quantize)
    assert not (_storages(serving) & _storages(master))
    before = serving(IDS).logits.clone()
    with torch.no_grad():  # the learner updates the master in place, every parameter
        for p in master.parameters():
            p.add_(0.5)
    assert torch.equal(serving(IDS).logits, before)
    assert all(p.requires_grad for p in master.parameters())  # building the copy froze nothing of the master


def test_int8_copy_embeds_with_the_tied_head_rows_and_keeps_no_float_matrix():
    if rows_linear_int8() is None:
        skip_or_fail("the int8 kernel cannot be built here")
    master = tiny_qwen2(1, tied=True)
    serving, _ = make_serving_draft(master, "int8")
    embedding, head = serving.get_input_embeddings(), serving.get_output_embeddings()
    assert isinstance(embedding, Int8Embedding) and embedding.weight_int8 is head.weight_int8
    assert not [n for n, t in serving.named_parameters() if t.dim() == 2]  # every matrix is int8
    reference = master(IDS).logits
    assert (serving(IDS).logits - reference).abs().max() < 0.05 * reference.std()  # int8: close, not equal
    untied, _ = make_serving_draft(tiny_qwen2(1, tied=False), "int8")
    assert untied.get_input_embeddings().weight_int8 is not untied.get_output_embeddings().weight_int8


def test_lora_master_is_merged_into_the_copy_but_not_into_itself():
    master = tiny_qwen2(1)
    configure_trainable(master, "lora", lora_rank=4)
    loras = [m for m in master.modules() if isinstance(m, LoRALinear)]
    assert loras
    with torch.no_grad():
        for m in loras:
            m.lora_b.normal_()
    base_before = [m.base.weight.clone() for m in loras]
    want = master(IDS).logits
    serving, _ = make_serving_draft(master, "none")
    assert torch.allclose(serving(IDS).logits, want, atol=1e-5)
    assert not [m for m in serving.modules() if isinstance(m, LoRALinear)]
    assert all(torch.equal(m.base.weight, b) for m, b in zip(loras, base_before))  # the master's base untouched
