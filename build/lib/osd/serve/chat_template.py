"""--chat-template: a Jinja chat template that replaces the tokenizer's own when the server turns a chat's messages
into a prompt (as vLLM's and llama-server's --chat-template do).

The value is a file holding the template, or the template itself (it is a file when such a file exists; a value
that looks like a path, with no Jinja in it, must name one). The template is compiled at startup, so that a broken
one fails there rather than on the first request.
"""
from __future__ import annotations

from pathlib import Path

from osd.errors import InvalidArgument


def load_chat_template(value: str) -> str:
    """The template text of --chat-template (a file's contents, or the value itself); checked to compile."""
    if _is_file(value):
        value = Path(value).expanduser().read_text(encoding="utf-8")
    elif "{" not in value:  # no Jinja in it: it meant a file
        raise InvalidArgument(f"--chat-template {value!r}: no such file (give a template file, or the template "
                              "itself)")
    _compile(value)
    return value


def _is_file(value: str) -> bool:
    try:
        return "\n" not in value and Path(value).expanduser().is_file()
    except OSError:  # e.g. a name too long for the file system: a template, then
        return False


def _compile(template: str) -> None:
    """Compile as transformers does (a sandboxed environment with loop controls): syntax errors surface now."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=["jinja2.ext.loopcontrols"]).from_string(template)
    except TemplateError as e:
        raise InvalidArgument(f"--chat-template does not compile: {e}") from e


class TemplatedTokenizer:
    """The tokenizer with another chat template: apply_chat_template renders it; everything else is the tokenizer's
    (the engine keeps the plain tokenizer: only the prompt a chat becomes changes)."""

    def __init__(self, tokenizer, template: str):
        self.tokenizer, self.chat_template = tokenizer, template

    def apply_chat_template(self, messages, **kwargs):
        return self.tokenizer.apply_chat_template(messages, **{**kwargs, "chat_template": self.chat_template})

    def __call__(self, *args, **kwargs):
        return self.tokenizer(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def with_chat_template(tokenizer, value: str | None):
    """The tokenizer the server builds prompts with: the given one, or it with --chat-template's template."""
    return tokenizer if not value else TemplatedTokenizer(tokenizer, load_chat_template(value))
