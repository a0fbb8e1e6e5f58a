"""`osd serve --no-learn` learns nothing from the traffic it serves: with --lookup, the n-gram lookup reads the
request's own tokens only (the traffic's lookup keeps an empty index); learning on (the default), every finished
request enters the lookup's traffic index, so a later request that repeats an earlier answer's words is proposed its
continuation."""
from __future__ import annotations

import pytest

from osd_bench.tiny_pair import write_tiny_pair
from osd.build import build_system
from osd.cli import build_parser
from osd.config import ModelConfig, SamplingConfig, SpeculationConfig
from osd.propose.ngram import TrafficIndex
from osd.serve.cli import serving_spec


def serve_args(*argv):
    return build_parser().parse_args(["serve", *argv])


def test_the_lookup_traffic_index_follows_learn_and_is_no_flag_of_its_own():
    assert serving_spec(serve_args("--lookup")).lookup_traffic is True
    assert serving_spec(serve_args("--lookup", "--no-learn")).lookup_traffic is False
    assert serving_spec(serve_args("--lookup", "--no-learn")).lookup is True  # the request's own lookup stays
    with pytest.raises(SystemExit):  # --learn decides it: no flag of its own to contradict it
        serve_args("--lookup", "--no-learn", "--lookup-traffic")


def test_a_server_that_does_not_learn_keeps_no_traffic_and_answers_the_same(tmp_path):
    target, draft = write_tiny_pair(tmp_path)
    models = ModelConfig(target=target, draft=draft, target_backend="torch", draft_quantize="none")
    answers = {}
    for learn in (True, False):
        system = build_system(models, SpeculationConfig(k=3, adaptive=False, lookup=True, lookup_traffic=learn))
        prompt = system.tokenizer.encode("hello world")
        first = system.engine.generate(prompt, SamplingConfig(max_new_tokens=12)).token_ids
        assert system.engine.proposer.lookup.traffic is None  # the request's lookup reads the request only
        traffic = system.engine.proposer.traffic.index  # the traffic's lookup, a source of its own (propose/ngram.py)
        assert [s.name for s in system.engine.sources][:2] == ["ngram", "traffic"]  # learning on or off
        if learn:  # the finished request's prompt and answer, indexed
            expected = TrafficIndex(traffic.min_n, traffic.max_n)
            expected.add(prompt + first)
            assert traffic.table and list(traffic.table.items()) == list(expected.table.items())
        else:
            assert not traffic.table
        second = system.engine.generate(prompt + first[:4], SamplingConfig(max_new_tokens=8)).token_ids
        answers[learn] = (first, second)
    assert answers[True] == answers[False]  # learning changes how fast, never what
