"""The feature head (models/feature_head.py): its int8 serving copy proposes what it proposes; its file round-trips
and refuses a target it does not fit."""
from __future__ import annotations

import pytest
import torch

from osd.errors import InvalidArgument
from osd.models.feature_head import FeatureHead, int8_head, load_head, save_head


def test_the_int8_copy_proposes_what_the_head_proposes_and_leaves_the_head_alone():
    torch.manual_seed(0)
    hidden = 64  # the int8 kernel wants widths in multiples of 8
    head = FeatureHead(hidden, 128, torch.randn(256, hidden), inputs=2)
    served = int8_head(head)
    if served is None:
        pytest.skip("osd's int8 kernel cannot build here")
    features, embeddings = torch.randn(32, 2 * hidden), torch.randn(32, hidden)
    with torch.no_grad():
        want, got = head(features, embeddings), served(features, embeddings)
    assert type(head.fc) is torch.nn.Linear and type(served.fc) is not torch.nn.Linear  # a copy, quantized
    assert type(served.fuse) is not torch.nn.Linear and type(served.head) is not torch.nn.Linear
    assert (want.argmax(-1) == got.argmax(-1)).float().mean() >= 0.9
    assert (want - got).abs().max() < 0.05 * want.abs().max()


def test_a_saved_head_loads_with_its_map_and_proposes_the_same(tmp_path):
    torch.manual_seed(1)
    head = FeatureHead(16, 32, torch.randn(40, 16))
    vocab_ids = torch.arange(100, 140)
    path = save_head(tmp_path / "h.pt", head, vocab_ids, {"arm": "2-deep"})
    saved = load_head(path, hidden=16, vocab_size=200)
    assert torch.equal(saved.vocab_ids, vocab_ids) and saved.meta == {"arm": "2-deep"}
    x, e = torch.randn(5, 16), torch.randn(5, 16)
    with torch.no_grad():
        assert torch.equal(saved.head(x, e), head(x, e))


def test_a_head_that_does_not_fit_the_target_is_refused_by_name(tmp_path):
    path = save_head(tmp_path / "h.pt", FeatureHead(16, 32, torch.randn(40, 16)), torch.arange(100, 140))
    with pytest.raises(InvalidArgument, match="width 16, the target's are 32"):
        load_head(path, hidden=32)
    with pytest.raises(InvalidArgument, match="past the target's vocabulary"):
        load_head(path, hidden=16, vocab_size=120)
    (tmp_path / "junk.pt").write_bytes(b"not a head")
    with pytest.raises(InvalidArgument, match="junk.pt"):
        load_head(tmp_path / "junk.pt")
    with pytest.raises(InvalidArgument, match="no such file"):
        load_head(tmp_path / "missing.pt")
