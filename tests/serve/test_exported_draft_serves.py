"""A learned draft carried to another server: a learning server's checkpoint -> `osd export-draft` -> a plain draft
directory that a second server loads with `--draft <exported>` and serves from, greedy answers unchanged."""
import copy

import httpx
from conftest import save_tiny_pair
from serve_testing import MODEL, learning_server, live_server

from osd.config import SamplingConfig


def test_an_exported_draft_loads_and_serves(tmp_path):
    from osd.build import build_system
    from osd.cli import build_parser
    from osd.config import ModelConfig, SpeculationConfig
    from osd.serve.app import create_app

    save_tiny_pair(tmp_path, draft_layers=1)
    ckpt = tmp_path / "ckpt"
    with learning_server(tmp_path, ckpt) as (served, system):
        for i in range(6):
            served.engine.generate([5 + i, 9, 20], SamplingConfig(max_new_tokens=12))
        served.learner.stop()  # writes the checkpoint
        learned = copy.deepcopy(served.learner.master)
    assert served.learner.version >= 1
    out = tmp_path / "exported"
    args = build_parser().parse_args(["export-draft", "--checkpoint", str(ckpt), "--draft", str(tmp_path / "draft"),
                                      "--out", str(out)])
    args.func(args)

    models = ModelConfig(target=str(tmp_path / "target"), draft=str(out / "draft"), draft_quantize="none",
                         prepack_target=False)
    other = build_system(models, SpeculationConfig(k=3, adaptive=False))
    import torch

    ids = torch.tensor([[5, 9, 20, 7, 11]])
    with torch.no_grad():  # the second server's draft is the learned one
        assert torch.allclose(other.registry.get("default").model(ids).logits, learned(ids).logits, atol=1e-4)
    reference = build_system(ModelConfig(target=str(tmp_path / "target"), draft="", prepack_target=False),
                             SpeculationConfig(k=0), with_draft=False)
    app = create_app(other.engine, other.tokenizer, MODEL)
    with live_server(app) as url:
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 12, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["osd"]["proposed"] > 0  # the exported draft proposed
    want = reference.engine.generate(reference.tokenizer.encode("abc"), SamplingConfig(max_new_tokens=12)).text
    assert r.json()["choices"][0]["text"] == want  # greedy: the target's own answer
