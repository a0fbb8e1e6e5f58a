"""HTTP <-> library translation: request bodies -> (prompt ids, SamplingConfig); results -> OpenAI shapes."""
from __future__ import annotations

import re
import time
import uuid

from osd.config import SamplingConfig
from osd.data import chat_ids
from osd.engine import GenerationResult
from osd.errors import DraftNotFound, InvalidArgument
from osd.serve.errors import BadParam, UnknownModel
from osd.serve.schemas import ChatCompletionRequest, CompletionRequest, _Request
from osd.serve.settings import ServeSettings

# SamplingConfig field -> request field (for error messages that name what the client sent)
FIELD_NAMES = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "max_new_tokens": "max_tokens",
               "stop": "stop", "seed": "seed"}


def check_common(req: _Request, model_name: str) -> None:
    if req.model is not None and req.model != model_name:
        raise UnknownModel(f"model {req.model!r} does not exist; this server serves {model_name!r}", param="model")
    if req.n not in (None, 1):
        raise BadParam(f"n must be 1 (one completion per request), got {req.n}", param="n")
    bad = req.unsupported()
    if bad:
        raise BadParam(f"not supported by this server: {', '.join(bad)}", param=bad[0])


def pinned_draft(req: _Request, drafts: dict[str, int]) -> str | None:
    """The draft the request pins in its `osd` extension (None: routed); one this server does not have -> 404."""
    name = req.osd.draft if req.osd is not None else None
    if name is not None and name not in drafts:
        error = DraftNotFound(f"draft {name!r} does not exist; this server's drafts: {sorted(drafts)} (GET /v1/models)")
        error.param = "osd.draft"
        raise error
    return name


def sampling_from(req: _Request, settings: ServeSettings, max_tokens: int | None = None) -> SamplingConfig:
    values = {
        "temperature": settings.default_temperature if req.temperature is None else req.temperature,
        "top_k": req.top_k or 0,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "max_new_tokens": settings.default_max_tokens if max_tokens is None else max_tokens,
        "stop": [] if req.stop is None else req.stop,
        "seed": req.seed,
    }
    try:
        return SamplingConfig(**values)
    except InvalidArgument as e:
        param = _offending_field(values)
        raise BadParam(f"invalid {param}: {e}" if param else str(e), param=param) from e


def _offending_field(values: dict) -> str | None:
    """The first field that SamplingConfig refuses on its own (error path only)."""
    for name, value in values.items():
        try:
            SamplingConfig(**{name: value})
        except InvalidArgument:
            return FIELD_NAMES[name]
    return None


# request role -> the role given to the chat template ("developer" is OpenAI's newer name for "system")
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
TOOL_ROLES = ("tool", "function")  # OpenAI roles that need tools, which this server does not support
BAD_TEXT = re.compile("[\ud800-\udfff\x00]")  # lone UTF-16 surrogates (not encodable text), NUL
try:
    from jinja2 import TemplateError  # a chat template that refuses the conversation (e.g. role order)
except ImportError:  # pragma: no cover - transformers brings jinja2
    TemplateError = ValueError
TOKENIZER_ERRORS = (ValueError, TypeError, KeyError, UnicodeError, TemplateError)


def chat_prompt(req: ChatCompletionRequest, tokenizer) -> list[int]:
    messages = []
    for i, m in enumerate(req.messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise BadParam(f"messages[{i}] must be an object with a string role and a content", param="messages")
        content = check_text(_text_content(m["content"], i), f"messages[{i}].content")
        messages.append({"role": _role(m["role"], i), "content": content})
    try:
        return chat_ids(tokenizer, messages)
    except InvalidArgument as e:
        raise BadParam(str(e), param="messages") from e
    except TOKENIZER_ERRORS as e:
        raise BadParam(f"the tokenizer cannot take these messages ({type(e).__name__}: {e})", param="messages") from e


def _role(role: str, i: int) -> str:
    if role in TOOL_ROLES:
        raise BadParam(f"messages[{i}].role {role!r} needs tools, which this server does not support",
                       param=f"messages[{i}].role")
    if role not in ROLES:
        raise BadParam(f"invalid value for messages[{i}].role: {role!r}; supported values are "
                       f"{', '.join(map(repr, ROLES))}", param=f"messages[{i}].role")
    return ROLES[role]


def check_text(text: str, param: str) -> str:
    """Text a tokenizer can take, as a 400 otherwise: no lone UTF-16 surrogates (valid JSON such as "\\ud800"
    decodes to one; it is not Unicode text and cannot be encoded) and no NUL characters."""
    bad = BAD_TEXT.search(text)
    if bad is not None:
        what = "a NUL character" if bad.group() == "\x00" else f"a lone UTF-16 surrogate (U+{ord(bad.group()):04X})"
        raise BadParam(f"{param} holds {what} at character {bad.start()}: not text the tokenizer can take", param=param)
    return text


def _text_content(content, i: int) -> str:
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise BadParam(f"messages[{i}].content must be a string or a list of text parts", param="messages")


def completion_prompt(req: CompletionRequest, tokenizer) -> list[int]:
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise BadParam("prompt: one prompt per request (a list of several strings is not supported)", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        try:
            return list(tokenizer(check_text(prompt, "prompt"), add_special_tokens=False)["input_ids"])
        except TOKENIZER_ERRORS as e:
            raise BadParam(f"the tokenizer cannot take this prompt ({type(e).__name__}: {e})", param="prompt") from e
    return list(prompt)  # token ids; the engine checks the range


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(result: GenerationResult) -> dict:
    n_prompt, n_new = len(result.prompt_ids), len(result.token_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_new, "total_tokens": n_prompt + n_new}


def osd_stats(result: GenerationResult) -> dict:
    """The `osd` extension field: this request's own speculative decoding figures."""
    s = result.stats
    return {"accepted": s["accepted"], "proposed": s["proposed"], "steps": s["steps"], "alpha": s["alpha"],
            "acceptance_rate": s["acceptance_rate"], "tokens_per_step": s["tokens_per_step"],
            "draft": s["draft"], "draft_version": s["draft_version"], "seconds": s["seconds"]}


class Shapes:
    """OpenAI response and chunk bodies for one request (chat or text completion)."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _body(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}

    def response(self, result: GenerationResult) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                      "logprobs": None, "finish_reason": result.finish_reason}
        else:
            choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": result.finish_reason}
        obj = "chat.completion" if self.chat else "text_completion"
        return self._body(obj, [choice], usage=usage(result), osd=osd_stats(result))

    def chunk(self, text: str | None = None, finish_reason: str | None = None, role: bool = False, **extra) -> dict:
        if self.chat:
            delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return self._body("chat.completion.chunk", [choice], **extra)
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return self._body("text_completion", [choice], **extra)

    def usage_chunk(self, result: GenerationResult) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._body(obj, [], usage=usage(result))
