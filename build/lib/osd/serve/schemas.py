"""Request bodies (OpenAI shapes). Types only: value ranges are the library's to check
(SamplingConfig, chat_ids, engine.generate), so one rule lives in one place.

Unknown fields are ignored, as OpenAI-compatible servers usually do; fields we know but cannot
honour (penalties, logprobs, tools, ...) are refused loudly by `unsupported()`.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class StreamOptions(BaseModel):
    include_usage: bool = False


class OsdRequestOptions(BaseModel):
    """The request's `osd` extension field (the response's carries the speculative figures)."""

    model_config = ConfigDict(extra="forbid")  # our own field: a misspelt key is a 400, not silently ignored

    draft: str | None = None  # serve with this draft (GET /v1/models lists them); unknown -> 404 draft_not_found


class LearnerControl(BaseModel):
    """POST /v1/osd/learner: pause (true) or resume (false) online learning; serving goes on either way."""

    model_config = ConfigDict(extra="forbid", strict=True)

    paused: bool


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (as in vLLM); 0 = off
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    osd: OsdRequestOptions | None = None  # extension: pin a draft
    # known but unsupported: refused when set to anything but their neutral value
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None

    def unsupported(self) -> list[str]:
        out = [name for name in ("presence_penalty", "frequency_penalty") if getattr(self, name)]
        out += [name for name in ("logit_bias", "logprobs") if getattr(self, name)]
        return out


class ChatCompletionRequest(_Request):
    messages: list[Any]  # checked by translate.chat_messages (400 with a clear message, not 422)
    max_completion_tokens: int | None = None  # newer name for max_tokens
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> list[str]:
        out = super().unsupported() + [name for name in ("top_logprobs", "tools") if getattr(self, name)]
        if self.response_format and self.response_format.get("type", "text") != "text":
            out.append("response_format")
        return out


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int]
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        out = super().unsupported() + (["echo"] if self.echo else []) + (["suffix"] if self.suffix else [])
        return out + (["best_of"] if self.best_of not in (None, 1) else [])
