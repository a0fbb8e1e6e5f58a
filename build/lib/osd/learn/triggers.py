"""When to update the draft (PAPER.md section 4): every I requests, buffer size >= S, or age >= T."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class UpdateTrigger:
    every_requests: int = 8  # I: update after this many finished requests (0 = off)
    min_positions: int = 0  # S: update when the buffer holds this many positions (0 = off)
    max_age_seconds: float = 0.0  # T: update when the oldest entry is this old (0 = off)
    min_positions_to_train: int = 1  # never update on fewer positions than this

    def due(self, requests_since_update: int, buffer_positions: int, oldest_age: float) -> str | None:
        """The reason an update is due now, or None."""
        if buffer_positions < max(1, self.min_positions_to_train):
            return None
        if self.every_requests and requests_since_update >= self.every_requests:
            return "requests"
        if self.min_positions and buffer_positions >= self.min_positions:
            return "size"
        if self.max_age_seconds and oldest_age >= self.max_age_seconds:
            return "age"
        return None
