"""The derived draft: construction (kept layers, vocabulary map), save/load round trips, the map in losses and
evaluation, and lossless serving (speculative greedy == target greedy) through the restricted-vocabulary path."""
import copy
from dataclasses import asdict

import pytest
import torch
from conftest import EOS, VOCAB, ToyTokenizer, tiny_qwen2
from helpers import make_engine, plain_greedy

from osd.config import ModelConfig, SamplingConfig, SpeculationConfig
from osd.errors import InvalidArgument, ModelNotFound
from osd.learn.compact import CompactDist
from osd.learn.losses import forward_kl, bucket_log_probs
from osd.learn.trainable import _run_layers
from osd.models.derived import (DeriveConfig, add_lora, choose_vocab, derive_copy, derive_model, load_derived,
                                parse_layers, save_derived)
from osd.models.loading import load_model
from osd.models.serving_draft import make_serving_draft
from osd.models.vocab_map import (in_target_vocab, restrict_compact, restrict_to_draft, target_to_draft, to_target_ids,
                                  vocab_ids_of)

KEPT = [0, 3]
MAP = torch.tensor(sorted({0, EOS} | set(range(2, 48, 2)) | {3, 5, 7}))  # 27 of the 48 ids, EOS included


def base_model(seed=1, layers=4):
    return tiny_qwen2(seed=seed, layers=layers)


def reference_logits(base, ids, layers, vocab_ids):
    """What a derived draft must compute: base embedding -> listed base layers -> final norm -> head rows."""
    hidden = _run_layers(base, base.model.embed_tokens(ids), [base.model.layers[i] for i in layers])
    return base.lm_head(base.model.norm(hidden))[..., vocab_ids]


def test_parse_layers_and_its_errors():
    assert parse_layers("0,1,20-23", 24) == [0, 1, 20, 21, 22, 23]
    for bad in ("", "a", "1,1", "-1", "3-x"):
        with pytest.raises(InvalidArgument):
            parse_layers(bad, 24)
    with pytest.raises(InvalidArgument, match="does not exist"):
        parse_layers("0,24", 24)


def test_choose_vocab_takes_specials_then_counts_then_lowest_ids():
    counts = torch.zeros(20, dtype=torch.long)
    counts[[9, 15, 12]] = torch.tensor([5, 9, 5])  # 15 most frequent; 9 and 12 tie (lower id first)
    assert choose_vocab(counts, 5, [19], count_share=1.0).tolist() == [0, 9, 12, 15, 19]
    assert choose_vocab(counts, 4, [19], count_share=1.0).tolist() == [9, 12, 15, 19]
    assert choose_vocab(counts, 4, [19], count_share=0.5).tolist() == [0, 9, 15, 19]  # 2 by count, then id 0
    assert choose_vocab(counts, 3, [19], count_share=0.0).tolist() == [0, 1, 19]
    with pytest.raises(InvalidArgument, match="special tokens"):
        choose_vocab(counts, 1, [18, 19])


def test_construction_keeps_the_listed_layers_and_the_vocabulary_map():
    base = base_model()
    reference = copy.deepcopy(base)
    draft = derive_model(base, KEPT, MAP)
    assert len(draft.model.layers) == 2 and draft.config.num_hidden_layers == 2
    for new, old in enumerate(KEPT):
        mine, theirs = draft.model.layers[new].state_dict(), reference.model.layers[old].state_dict()
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
        assert draft.model.layers[new].self_attn.layer_idx == new
    assert torch.equal(vocab_ids_of(draft), MAP)
    assert torch.equal(draft.lm_head.weight, reference.lm_head.weight[MAP])
    ids = torch.tensor([[2, 9, 4, 30, 7, 11]])
    assert torch.allclose(draft(ids).logits, reference_logits(reference, ids, KEPT, MAP), atol=1e-5)
    again = derive_copy(reference, KEPT, MAP)  # the copying variant leaves its base whole
    assert len(reference.model.layers) == 4 and torch.equal(again(ids).logits, draft(ids).logits)


def test_the_kv_cache_of_a_derived_draft_matches_a_full_forward():
    from osd.models.cached import CachedModel

    draft = derive_model(base_model(), KEPT, MAP)
    ids = [2, 9, 4, 30, 7, 11, 5]
    runner = CachedModel(draft)
    stepped = torch.cat([runner.feed(ids[:4])] + [runner.feed([t]) for t in ids[4:]])
    assert torch.allclose(stepped, draft(torch.tensor([ids])).logits[0, [3, 4, 5, 6]], atol=1e-5)


def saved_base(tmp_path, seed=1, layers=4):
    base = base_model(seed, layers)
    where = tmp_path / f"base{seed}"
    base.save_pretrained(where)
    return str(where)


def recipe_for(base_dir, layers=KEPT):
    return {"derive": asdict(DeriveConfig(base=base_dir, layers=",".join(map(str, layers)), vocab=len(MAP)))}


def test_save_load_round_trip_untrained_gives_identical_logits(tmp_path):
    base_dir = saved_base(tmp_path)
    draft = derive_model(load_model(base_dir), KEPT, MAP)
    out = save_derived(tmp_path / "derived", draft, recipe_for(base_dir))
    loaded = load_model(f"derived:{out}")
    ids = torch.tensor([[2, 9, 4, 30, 7, 11]])
    assert torch.equal(loaded(ids).logits, draft(ids).logits)
    assert torch.equal(vocab_ids_of(loaded), MAP)
    assert loaded.config.osd_derived["layers"] == KEPT


def test_save_load_round_trip_with_a_lora_delta(tmp_path):
    base_dir = saved_base(tmp_path)
    draft = derive_model(load_model(base_dir), KEPT, MAP)
    add_lora(draft, rank=4, alpha=8.0)
    torch.manual_seed(3)
    delta = {}
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "lora_b" in name or name == "model.norm.weight":
                p.add_(0.3 * torch.randn_like(p))  # a trained-looking delta: B != 0 changes the function
            if "lora_" in name or name == "model.norm.weight":
                delta[name] = p.detach().clone()
    ids = torch.tensor([[2, 9, 4, 30, 7, 11]])
    expected = draft(ids).logits
    out = save_derived(tmp_path / "healed", draft, recipe_for(base_dir), delta,
                       {"mode": "lora", "lora_rank": 4, "lora_alpha": 8.0})
    loaded = load_model(f"derived:{out}")
    assert not any("lora_" in n for n, _ in loaded.named_parameters())  # adapters folded in: a plain model
    assert torch.allclose(loaded(ids).logits, expected, atol=1e-5)
    untrained = load_derived(f"derived:{out}", with_delta=False)
    assert not torch.allclose(untrained(ids).logits, expected, atol=1e-3)
    (tmp_path / "other").mkdir()
    import safetensors.torch as st

    st.save_file({"vocab_ids": MAP.to(torch.int32), "delta.model.nope.weight": torch.zeros(2)}, str(tmp_path / "other" / "derived.safetensors"))
    (tmp_path / "other" / "derived.json").write_text((out / "derived.json").read_text())
    with pytest.raises(ModelNotFound, match="does not have"):
        load_model(f"derived:{tmp_path / 'other'}")


def test_a_saved_pretrained_derived_draft_loads_as_a_plain_directory(tmp_path):
    draft = derive_model(base_model(), KEPT, MAP)
    draft.save_pretrained(tmp_path / "hf")
    loaded = load_model(str(tmp_path / "hf"))
    ids = torch.tensor([[2, 9, 4, 30, 7, 11]])
    assert torch.equal(loaded(ids).logits, draft(ids).logits) and torch.equal(vocab_ids_of(loaded), MAP)


def test_unknown_derived_spec_names_what_exists(tmp_path):
    with pytest.raises(ModelNotFound, match="no derived draft"):
        load_model(f"derived:{tmp_path / 'missing'}")


def test_restrict_compact_conditions_the_target_on_the_map():
    lut = target_to_draft(torch.tensor([2, 5, 9]), 10)  # target 2 -> 0, 5 -> 1, 9 -> 2
    target = CompactDist(torch.tensor([[5, 7, 2], [7, 8, 3]]), torch.tensor([[0.5, 0.3, 0.1], [0.6, 0.3, 0.05]]))
    out = restrict_compact(target, lut)
    assert out.ids.tolist() == [[1, 1, 0], [0, 0, 0]]  # 7 is outside: id of the first in-map entry, no mass
    assert torch.allclose(out.probs[0], torch.tensor([0.5, 0.0, 0.1]) / 0.7)
    assert torch.allclose(out.tail, torch.tensor([0.1 / 0.7, 1.0]))  # no in-map entry: only the tail is left
    # a draft equal to the conditioned target scores KL 0; the bucket arithmetic stays exact with the repeat
    logits = torch.log(torch.tensor([[0.1 / 0.7, 0.5 / 0.7, 0.1 / 0.7 - 1e-9]]))
    assert float(forward_kl(*bucket_log_probs(logits, out.select(slice(0, 1))))) == pytest.approx(0.0, abs=1e-6)


def test_logits_map_back_to_target_ids_with_nothing_outside_the_map():
    draft = derive_model(base_model(), KEPT, MAP)
    logits = torch.randn(3, len(MAP))
    full = in_target_vocab(draft, logits)
    assert full.shape == (3, VOCAB) and torch.isfinite(full[:, EOS]).all()  # EOS is in the map
    assert torch.equal(full.argmax(-1), to_target_ids(draft, logits.argmax(-1)))
    assert torch.isinf(full[:, 9]).all()  # 9 is not in the map
    assert torch.allclose(torch.softmax(full, -1)[:, MAP], torch.softmax(logits, -1), atol=1e-7)
    target = CompactDist(torch.tensor([[4, 9]]), torch.tensor([[0.5, 0.5]]))
    assert restrict_to_draft(draft, target).probs[0, 1] == 0.0


def test_serving_copy_carries_the_map_and_refuses_a_second_truncation():
    draft = derive_model(base_model(), KEPT, MAP)
    serving, vocab_ids = make_serving_draft(draft, "int8")
    assert torch.equal(vocab_ids, MAP) and serving.lm_head.out_features == len(MAP)
    with pytest.raises(InvalidArgument, match="already covers"):
        make_serving_draft(draft, "none", draft_vocab=16)


@pytest.mark.parametrize("layers,quantize", [([0, 1], "none"), ([0, 1], "int8"), ([1], "none")])
def test_speculative_greedy_with_a_derived_draft_equals_target_greedy(layers, quantize):
    target = tiny_qwen2(seed=0, layers=2)
    draft = derive_copy(target, layers, MAP)  # the target cut down: agrees where the target's token is in the map
    serving, vocab_ids = make_serving_draft(draft, quantize)
    engine, _ = make_engine(target, serving, ToyTokenizer(), k=4, vocab_ids=vocab_ids)
    proposed = []
    engine.observers.append(lambda record: proposed.extend(record.proposed))
    accepted = 0
    for prompt in ([2, 5, 9], [7, 7, 3, 20], [11], [30, 4, 4, 8, 2]):
        result = engine.generate(prompt, SamplingConfig(max_new_tokens=24))
        expected = plain_greedy(target, prompt, 24, eos=EOS)
        assert result.token_ids == expected
        accepted += result.counters.accepted
    assert proposed and set(proposed) <= set(MAP.tolist())  # the draft proposes in its map only
    if layers == [0, 1]:
        assert accepted > 0  # the test exercises acceptance, not only rejections


def test_build_system_serves_a_derived_draft_by_name(tmp_path, monkeypatch):
    import osd.build as build

    target_dir = saved_base(tmp_path, seed=0, layers=2)
    draft = derive_model(load_model(target_dir), [0, 1], MAP)
    out = save_derived(tmp_path / "derived", draft, recipe_for(target_dir, [0, 1]))
    monkeypatch.setattr(build, "load_tokenizer", lambda spec: ToyTokenizer())
    models = ModelConfig(target=target_dir, draft=f"derived:{out}", target_backend="torch", prepack_target=False)
    system = build.build_system(models, SpeculationConfig(k=3, adaptive=False))
    snap = system.registry.get(build.DEFAULT_DRAFT)
    assert torch.equal(snap.vocab_ids, MAP)
    target = load_model(target_dir)
    prompt = [2, 5, 9, 14]
    result = system.engine.generate(prompt, SamplingConfig(max_new_tokens=20))
    expected = plain_greedy(target, prompt, 20, eos=EOS)
    assert result.token_ids == expected
    assert result.counters.accepted > 0


def test_a_shipped_draft_resolves_by_name(tmp_path, monkeypatch):
    import osd.models.derived as derived

    base_dir = saved_base(tmp_path)
    draft = derive_model(load_model(base_dir), KEPT, MAP)
    monkeypatch.setattr(derived, "ASSETS", tmp_path / "assets")
    save_derived(tmp_path / "assets" / "cheap", draft, recipe_for(base_dir))
    ids = torch.tensor([[2, 9, 4]])
    assert torch.equal(load_model("derived:cheap")(ids).logits, draft(ids).logits)
    with pytest.raises(ModelNotFound, match="shipped: cheap"):
        load_model("derived:dear")


def test_the_online_learning_paths_take_a_derived_draft():
    """acceptance_on (the guard's measure) and items_loss (the learner's loss) on a draft with a vocabulary map: the
    draft equal to the target on its map agrees exactly where the target's token is in the map, and the loss against
    a target with mass outside the map stays finite with finite gradients."""
    from osd.learn.batch import acceptance_on, items_loss
    from osd.learn.buffer import ReplayItem
    from osd.learn.compact import compress

    target = tiny_qwen2(seed=0, layers=2)
    draft = derive_copy(target, [0, 1], MAP)
    sequences = [[2, 5, 9, 14, 3, 8, 20, 11, 41], [7, 43, 30, 4, 4, 45, 2]]
    items, in_map = [], []
    for seq in sequences:
        logits = target(torch.tensor([seq])).logits[0]  # (T, V): row p predicts token p + 1
        positions = list(range(2, len(seq)))
        dist = compress(logits[[p - 1 for p in positions]], VOCAB)  # the whole distribution: restriction is exact
        items.append(ReplayItem(seq[:-1], positions, dist, "r", 0, 0.0))
        in_map += [bool((MAP == t).any()) for t in dist.ids[:, 0].tolist()]
    assert not all(in_map)  # some target tokens fall outside the map
    result = acceptance_on(draft, items)
    assert result["correct"] == in_map
    draft.lm_head.weight.requires_grad_(True)
    loss = items_loss(draft, items)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(draft.lm_head.weight.grad).all()
    assert loss.item() < 1e-5  # the draft is the target conditioned on its map: nothing left to learn
    top16 = [ReplayItem(it.tokens, it.positions, CompactDist(it.target.ids[:, :16], it.target.probs[:, :16]), "r", 0, 0.0)
             for it in items]
    assert 0 < items_loss(draft, top16).item() < 0.2  # top-K + tail: the tail counts as in-map (an approximation)


def test_text_sources_name_their_split_and_slice():
    from osd.models.derived import parse_text_source

    assert parse_text_source("gsm8k") == ("gsm8k", "train", 0, None)
    assert parse_text_source("finance:test") == ("finance", "test", 0, None)
    assert parse_text_source("multilingual_qa@de:test[600:]") == ("multilingual_qa@de", "test", 600, None)
    assert parse_text_source("code[10:20]", "test") == ("code", "test", 10, 20)
    for bad in ("code[a:b]", "code[5:2]", "code[-1:]", ":test"):
        with pytest.raises(InvalidArgument):
            parse_text_source(bad)


def test_source_records_take_each_entrys_split_and_slice_under_the_limit():
    """What `osd draft build --datasets` distils on: a test-only dataset by its slice (multilingual_qa has no train
    split), the limit capping each entry, records in file order."""
    from osd.data import load_records
    from osd.models.derived import source_records

    german = load_records("multilingual_qa@de", "test", 12)
    got = source_records("multilingual_qa@de:test[4:10],multilingual_qa@de[0:3]", "train", limit=5)
    assert [r["id"] for r in got] == [r["id"] for r in german[4:9]]  # the train split it defaults to has none
    assert [r["id"] for r in source_records("gsm8k[2:4],spider", limit=2)] == \
        [r["id"] for r in load_records("gsm8k", "train", 4)[2:4] + load_records("spider", "train", 2)]
    assert source_records("multilingual_qa@de:test[3:3]") == []


class _BatchToyTokenizer(ToyTokenizer):
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [self.encode(t) for t in text] if isinstance(text, list) else self.encode(text)}


def test_widening_keeps_the_trained_rows_and_adds_the_counted_tokens_with_base_rows(tmp_path):
    import json

    from osd.models.derived import widen_derived, widen_vocab_ids

    counts = torch.zeros(12, dtype=torch.long)
    counts[[9, 11, 4, 10]] = torch.tensor([4, 7, 50, 1])
    assert widen_vocab_ids(torch.tensor([1, 4, 5]), counts, 2).tolist() == [1, 4, 5, 9, 11]  # 4 already in; by count
    assert widen_vocab_ids(torch.tensor([1, 4, 5]), counts, 9).tolist() == [1, 4, 5, 9, 10, 11]  # zero counts never

    base_dir = saved_base(tmp_path)
    draft = derive_model(load_model(base_dir), KEPT, MAP)
    add_lora(draft, rank=4, alpha=8.0)
    torch.manual_seed(5)
    delta = {}
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "lora_b" in name:
                p.add_(0.3 * torch.randn_like(p))
            if "lora_" in name:
                delta[name] = p.detach().clone()
    healed = save_derived(tmp_path / "healed", draft, recipe_for(base_dir), delta,
                          {"mode": "lora", "lora_rank": 4, "lora_alpha": 8.0})
    texts = tmp_path / "texts.jsonl"  # 'h' = id 9 and 'j' = id 11 lie outside MAP; 'l' = 13 counted once
    rows = [{"prompt": "hhhhjjjl", "split": "test"}, {"prompt": "jjjj", "split": "test"},
            {"prompt": "nnnnnnnnnnnn", "split": "test"}]  # the third record lies outside the slice below
    texts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    wider_dir = widen_derived(f"derived:{healed}", tmp_path / "wider", f"{texts}:test[0:2]", 2,
                              tokenizer=_BatchToyTokenizer())

    before, wider = load_model(f"derived:{healed}"), load_model(f"derived:{wider_dir}")
    wide_ids = vocab_ids_of(wider)
    assert wide_ids.tolist() == sorted(MAP.tolist() + [9, 11])  # 'n' (15) was past the slice, 'l' (13) counted less
    ids = torch.tensor([[2, 9, 4, 30, 7, 11]])
    old_cols = torch.searchsorted(wide_ids, MAP)
    assert torch.allclose(wider(ids).logits[..., old_cols], before(ids).logits, atol=1e-5)  # trained rows kept
    hidden = before.model(ids).last_hidden_state
    base_head = load_model(base_dir).lm_head.weight
    new_cols = torch.searchsorted(wide_ids, torch.tensor([9, 11]))
    assert torch.allclose(wider(ids).logits[..., new_cols], hidden @ base_head[[9, 11]].t(), atol=1e-5)
    recipe = json.loads((wider_dir / "derived.json").read_text())
    assert recipe["derive"]["vocab"] == len(MAP) + 2 and recipe["widened"][-1]["added"] == 2
    assert recipe["widened"][-1]["coverage_of_counted_after"] > recipe["widened"][-1]["coverage_of_counted_before"]
