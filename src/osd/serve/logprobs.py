"""The `logprobs` of a choice, in OpenAI's two shapes, from the engine's per-token figures (verify/logprobs.py: the
target's raw log-softmax at each emitted position, as vLLM returns by default).

Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}.
Completions (legacy): {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}, ...], "text_offset"}; each
top_logprobs dict holds the N likeliest tokens and the chosen one (so up to N + 1, as OpenAI's).
A token's text is the tokenizer's decoding of it alone (special tokens included); `bytes` is that text's UTF-8.
Limitation: a token that holds part of a multi-byte character decodes to U+FFFD, so its `bytes` are those of U+FFFD,
not the token's raw bytes.
"""
from __future__ import annotations


class LogprobShapes:
    """Renders one request's logprobs, chunk after chunk (text offsets run on across a stream's chunks)."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer, self.chat = tokenizer, chat
        self._texts: dict[int, str] = {}
        self.offset = 0  # completions: characters of the token texts rendered so far

    def text(self, token: int) -> str:
        if token not in self._texts:
            self._texts[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return self._texts[token]

    def render(self, entries) -> dict:
        """entries: verify/logprobs.TokenLogprob, in output order -> the choice's `logprobs` value."""
        return self._chat(entries) if self.chat else self._completion(entries)

    def _chat(self, entries) -> dict:
        def one(token: int, logprob: float) -> dict:
            text = self.text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [one(e.token, e.logprob) | {"top_logprobs": [one(t, lp) for t, lp in e.top]}
                            for e in entries], "refusal": None}

    def _completion(self, entries) -> dict:
        tokens = [self.text(e.token) for e in entries]
        offsets = []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        tops = [{self.text(t): lp for t, lp in e.top} | {self.text(e.token): e.logprob} for e in entries]
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
                "text_offset": offsets}
