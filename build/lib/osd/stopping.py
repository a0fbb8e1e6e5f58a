"""When generation ends: EOS, max_new_tokens and stop strings. Also incremental text for streaming."""
from __future__ import annotations


class StopChecker:
    """Accumulates emitted tokens and decides when, and where exactly, generation stops."""

    def __init__(self, tokenizer, eos_ids: set[int], max_new_tokens: int, stop: list[str]):
        self.tokenizer, self.eos_ids, self.max_new_tokens, self.stop = tokenizer, eos_ids, max_new_tokens, stop
        self.token_ids: list[int] = []
        self.text_cut: int | None = None  # text length to keep when a stop string matched
        self.finish_reason: str | None = None

    def extend(self, emitted: list[int]) -> str | None:
        """Add a step's tokens; return "stop" / "length" when generation is over, else None."""
        for token in emitted:
            if token in self.eos_ids:
                self.finish_reason = "stop"
                return self.finish_reason
            self.token_ids.append(token)
            if self.stop and self._match_stop():
                self.finish_reason = "stop"
                return self.finish_reason
            if len(self.token_ids) >= self.max_new_tokens:
                self.finish_reason = "length"
                return self.finish_reason
        return None

    def _match_stop(self) -> bool:
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.text_cut = min(hits)
        return bool(hits)

    @property
    def text(self) -> str:
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        return text[: self.text_cut] if self.text_cut is not None else text

    def stable_text(self) -> str:
        """Text safe to stream now: no partial UTF-8 char, no possible start of a stop string."""
        text = self.text
        if self.finish_reason:
            return text
        text = text.rstrip("\ufffd")
        hold = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return text[: len(text) - hold]
