"""Who drafts. A proposer turns (tokens so far, k) into k proposed tokens (+ their draft probabilities)."""
from osd.propose.base import Proposal, Proposer
from osd.propose.draft_model import DraftModelProposer, RunnerProposer

__all__ = ["Proposal", "Proposer", "DraftModelProposer", "RunnerProposer"]
