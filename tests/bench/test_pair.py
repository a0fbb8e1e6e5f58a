"""`osd bench pair`: two replays paired on the same held-out positions (osd_bench/pair.py)."""
import json

import pytest

from osd.errors import InvalidArgument
from osd_bench.pair import pair_replays, report_pair

CONFIG = {"stream": "code:test", "per_segment": 300, "heldout": 2, "heldout_split": "test", "k": 6,
          "teacher": {"max_new_tokens": 64}}


def replay(online: str, control: str = "0011001100", steps: int = 288, **config) -> dict:
    return {"config": {**CONFIG, **config}, "learner": {"optimizer_steps": steps},
            "heldout_matches": {"code": {"original": control, "online": online}}}


def test_pairs_b_against_a_position_by_position():
    a, b = replay("0111001100"), replay("1110101101")
    r = pair_replays(a, b)["code"]
    # b gains positions 0, 4, 9 and loses position 3 against a
    assert (r["b_vs_a"]["gained"], r["b_vs_a"]["lost"]) == (3, 1)
    assert r["a"] == 0.5 and r["b"] == 0.7 and r["control"] == 0.4 and r["positions"] == 10
    assert r["b_vs_a"]["z"] == pytest.approx((3 - 1) / 2.0)  # sign test: (gained - lost) / sqrt(gained + lost)


def test_refuses_replays_whose_positions_do_not_pair():
    with pytest.raises(InvalidArgument, match="stream"):
        pair_replays(replay("0111001100"), replay("0111001100", stream="chat:test"))
    with pytest.raises(InvalidArgument, match="controls disagree"):
        pair_replays(replay("0111001100"), replay("0111001100", control="1111001100"))
    with pytest.raises(InvalidArgument, match="same positions"):
        pair_replays(replay("0111001100"), replay("01110011"))


def test_report_writes_the_result(tmp_path):
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(replay("0111001100")))
    pb.write_text(json.dumps(replay("1110101101")))
    out = tmp_path / "pair.json"
    report_pair(str(pa), str(pb), str(out), None)
    written = json.loads(out.read_text())
    assert written["heldout"]["code"]["b_vs_a"]["gained"] == 3 and "git_revision" in written and "machine" in written
