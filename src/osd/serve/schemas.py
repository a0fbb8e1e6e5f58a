"""Request bodies (OpenAI shapes). Types only: value ranges are the library's to check
(SamplingConfig, chat_ids, engine.generate), so one rule lives in one place.

Unknown fields are ignored, as OpenAI-compatible servers usually do; fields we know (OpenAI's and vLLM's) but do not
honour are refused by name when they ask for anything (`UNSUPPORTED`: each with the values that ask nothing, which
pass), so a client never gets output that silently ignored what it asked for.
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


# field -> the values that ask nothing of the server (accepted and ignored); any other value is refused by name.
# Why each is not honoured: penalties and logit_bias change the target's distribution per context, which the
# verification (greedy argmax, rejection sampling against the draft) does not apply; the rest need features this
# server does not have (beam search, structured output, tools, prompt logprobs, several completions).
UNSUPPORTED: dict[str, tuple] = {
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0),
    "length_penalty": (None, 1, 1.0), "logit_bias": (None, {}), "min_tokens": (None, 0), "typical_p": (None, 1, 1.0),
    "top_a": (None, 0, 0.0), "use_beam_search": (None, False), "best_of": (None, 1), "prompt_logprobs": (None,),
    "bad_words": (None, []), "allowed_token_ids": (None,), "logits_processors": (None, []),
    "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,), "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "structured_outputs": (None,), "tools": (None, []), "functions": (None, []),
    "tool_choice": (None, "none"), "function_call": (None, "none"), "prediction": (None,), "audio": (None,),
    "modalities": (None, ["text"]),
}
CHAT_ONLY = ("tools", "functions", "tool_choice", "function_call", "prediction", "audio", "modalities")


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are kept only to be looked up in UNSUPPORTED

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (as in vLLM); 0 or -1 = off
    min_p: float | None = None  # extension (as in vLLM); 0 = off
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension (as in vLLM): these tokens end generation as EOS does
    ignore_eos: bool | None = None  # extension (as in vLLM)
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    osd: OsdRequestOptions | None = None  # extension: pin a draft

    def unsupported(self) -> list[str]:
        """The fields that ask for something this server does not do, by name."""
        values = {**(self.model_extra or {}), **{name: getattr(self, name) for name in type(self).model_fields}}
        chat = isinstance(self, ChatCompletionRequest)
        return [name for name, neutral in UNSUPPORTED.items()
                if name in values and (chat or name not in CHAT_ONLY) and not _neutral(values[name], neutral)]


def _neutral(value, neutral: tuple) -> bool:
    return any(value == n and type(value) is not bool or value is n for n in neutral)


class ChatCompletionRequest(_Request):
    messages: list[Any]  # checked by translate.chat_messages (400 with a clear message, not 422)
    max_completion_tokens: int | None = None  # newer name for max_tokens
    logprobs: bool | None = None  # the output tokens' log-probabilities (choice.logprobs.content)
    top_logprobs: int | None = None  # with logprobs: this many likeliest tokens at each position (0-20)
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> list[str]:
        out = super().unsupported()
        if self.response_format and self.response_format.get("type", "text") != "text":
            out.append("response_format")
        return out


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int]
    logprobs: int | None = None  # the output tokens' log-probabilities, with this many likeliest tokens each (0-20)
    echo: bool | None = False
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        return super().unsupported() + (["echo"] if self.echo else []) + (["suffix"] if self.suffix else [])
