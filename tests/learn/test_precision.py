import copy

import pytest
import torch
from conftest import tiny_qwen2
from helpers import make_engine

from osd.config import SamplingConfig
from osd.errors import InvalidArgument
from osd.learn.online import LearnConfig, OnlineLearner
from osd.learn.precision import training_dtype

STREAM = [[5 + i % 7, 9 + i % 5, 20 + i % 3] for i in range(6)]


def test_auto_precision_is_bf16_only_where_the_cpu_multiplies_bf16_natively():
    assert training_dtype("auto", native=True) == torch.bfloat16
    assert training_dtype("auto", native=False) == torch.float32  # AVX2-only: bf16 would be emulated, slower
    assert training_dtype("bfloat16", native=False) == torch.bfloat16  # asked for: as asked
    assert training_dtype("float32", native=True) == torch.float32
    with pytest.raises(InvalidArgument, match="precision"):
        LearnConfig(precision="fp16")


def _gradients(draft, items, precision):
    """The trained layer's gradients of one batch (all the items) under `precision`."""
    config = LearnConfig(mode="all", every_requests=0, batch_size=len(items), train_layers=1, precision=precision)
    learner = OnlineLearner(copy.deepcopy(draft), lambda master, version=None: None, config)
    assert learner.dtype == training_dtype(precision)
    loss = learner._accumulate_gradients([copy.copy(it) for it in items])
    acceptance = learner._acceptance([copy.copy(it) for it in items])["expected_acceptance"]
    return loss, torch.cat([p.grad.flatten() for p in learner.params]), acceptance


def test_a_bf16_step_computes_in_bf16_and_its_gradients_follow_fp32s(target_model, tokenizer):
    """bf16 autocast: the step's products round to bf16 (the gradients differ from fp32's) but point the same way
    (within a few percent); weights and gradients stay fp32. The guards' held-out evaluations run in it too."""
    draft = tiny_qwen2(seed=1, layers=2, hidden=64)
    engine, _ = make_engine(target_model, copy.deepcopy(draft), tokenizer, k=4)
    observer = OnlineLearner(copy.deepcopy(draft), lambda master, version=None: None,
                             LearnConfig(mode="all", every_requests=0)).attach(engine)
    for prompt in STREAM:
        engine.generate(prompt, SamplingConfig(max_new_tokens=12))
    items = observer.buffer.snapshot()
    assert len(items) >= 4
    loss32, grad32, acceptance32 = _gradients(draft, items, "float32")
    loss16, grad16, acceptance16 = _gradients(draft, items, "bfloat16")
    assert grad16.dtype == torch.float32
    assert not torch.equal(grad16, grad32)  # it did compute in bf16
    assert abs(loss16 - loss32) < 0.02 * abs(loss32)
    assert (grad16 - grad32).norm() < 0.05 * grad32.norm()
    assert acceptance16 != acceptance32 and abs(acceptance16 - acceptance32) < 0.02
