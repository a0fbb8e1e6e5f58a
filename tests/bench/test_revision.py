"""A result records the revision its command started with, and the one at the end when commits landed meanwhile."""
import osd.revision as revision
from osd.cli import main


def test_the_revision_is_read_at_the_start_and_the_end_is_added_when_it_differs(monkeypatch):
    heads = iter(["abc1234", "abc1234", "def5678"])
    monkeypatch.setattr(revision, "_at_start", None)
    monkeypatch.setattr(revision, "read", lambda: next(heads))
    assert revision.at_start() == "abc1234"
    assert revision.git_revision() == "abc1234"  # unchanged during the run
    assert revision.git_revision() == "abc1234 (at the end: def5678)"


def test_the_cli_reads_the_revision_before_the_command_runs(monkeypatch, tmp_path):
    monkeypatch.setattr(revision, "_at_start", None)
    monkeypatch.setattr(revision, "read", lambda: "abc1234")
    assert main(["replay", "--from-result", str(tmp_path / "missing.json"), "--out", str(tmp_path / "o.json")]) == 2
    assert revision._at_start == "abc1234"


def test_read_names_a_real_revision_here():
    rev = revision.read()
    assert rev == "unknown" or len(rev.split("-")[0]) >= 7
