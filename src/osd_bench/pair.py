"""`osd bench pair A B`: two finished fast replays of the same stream, paired on the same held-out positions.

A replay (`osd replay --fast --heldout N`) records, per held-out position, whether each draft agreed with the target
(`heldout_matches`). Two replays that differ in one setting of the learner (a recipe, `--vocab-swap`) and share the
stream, the held-out requests and the target's outputs, are compared position by position: B's online draft against
A's (gained, lost, the sign-test z of learn/guard.py), each against its never-trained control. Re-measures nothing.
"""
from __future__ import annotations

from pathlib import Path

from osd.errors import InvalidArgument
from osd.learn.guard import paired_flips, paired_z

SAME = ("stream", "per_segment", "heldout", "heldout_split", "teacher", "k")  # config keys both replays must share


def _bits(text: str) -> list[bool]:
    return [ch == "1" for ch in text]


def pair_replays(a: dict, b: dict) -> dict:
    """Per held-out dataset: both runs' online (and control) agreement and B's online draft paired with A's."""
    differ = [key for key in SAME if a["config"].get(key) != b["config"].get(key)]
    if differ:
        raise InvalidArgument(f"the two replays differ in {', '.join(differ)}: their held-out positions do not pair")
    out = {}
    for dataset, arms_a in a["heldout_matches"].items():
        arms_b = b["heldout_matches"].get(dataset)
        if arms_b is None or len(arms_a["online"]) != len(arms_b["online"]):
            raise InvalidArgument(f"held-out {dataset!r}: not the same positions in both replays")
        if arms_a["original"] != arms_b["original"]:
            raise InvalidArgument(f"held-out {dataset!r}: the controls disagree (another draft or target outputs)")
        online_a, online_b, control = (_bits(arms_a["online"]), _bits(arms_b["online"]), _bits(arms_a["original"]))
        lost, gained = paired_flips(online_a, online_b)
        n = len(control)
        out[dataset] = {"positions": n, "control": sum(control) / n, "a": sum(online_a) / n, "b": sum(online_b) / n,
                        "b_vs_a": {"gained": gained, "lost": lost, "z": paired_z(online_a, online_b)},
                        "optimizer_steps": {"a": a["learner"].get("optimizer_steps"),
                                            "b": b["learner"].get("optimizer_steps")}}
    return out


def report_pair(path_a: str, path_b: str, out: str, markdown: str | None) -> dict:
    from osd.records import emit_report, read_result, write_result

    needs = ("config", "heldout_matches", "learner")
    a, b = read_result(path_a, needs), read_result(path_b, needs)
    paired = pair_replays(a, b)
    result = {"a": {"source": path_a, "command": a.get("command"), "git_revision": a.get("git_revision")},
              "b": {"source": path_b, "command": b.get("command"), "git_revision": b.get("git_revision")},
              "heldout": paired}
    written = write_result(result, out)
    lines = ["| held-out | positions | control | A online | B online | B vs A gained / lost | z | steps A / B |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for dataset, r in paired.items():
        lines.append(f"| {dataset} | {r['positions']} | {r['control']:.4f} | {r['a']:.4f} | {r['b']:.4f} | "
                     f"{r['b_vs_a']['gained']} / {r['b_vs_a']['lost']} | {r['b_vs_a']['z']:.2f} | "
                     f"{r['optimizer_steps']['a']} / {r['optimizer_steps']['b']} |")
    emit_report("Two replays paired on held-out positions (`osd bench pair`)",
                f"`osd bench pair {path_a} {path_b}`: A = {Path(path_a).name}, B = {Path(path_b).name}",
                ["\n".join(lines)], written, markdown)
    return result
