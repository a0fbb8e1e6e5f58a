"""--chat-template: a Jinja template (a file, or the template itself) replaces the tokenizer's own for the prompts
of /v1/chat/completions; a broken one, or a file that is not there, fails at startup."""
from __future__ import annotations

import logging

import httpx
import pytest
from conftest import tiny_qwen2, tiny_tokenizer
from helpers import make_engine

from osd.data import chat_ids
from osd.errors import InvalidArgument
from osd.logs import configure_logging, uvicorn_options
from osd.serve.app import create_app
from osd.serve.chat_template import load_chat_template, with_chat_template
from osd.serve.settings import ServeSettings

TEMPLATE = ("{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}.{% endif %}")
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def test_the_template_replaces_the_tokenizers_own():
    tokenizer = tiny_tokenizer()
    own = chat_ids(tokenizer, MESSAGES)
    templated = with_chat_template(tokenizer, TEMPLATE.replace("<", "").replace(">", " "))
    assert chat_ids(templated, MESSAGES) == tokenizer("s be briefu hi.")["input_ids"] != own
    assert chat_ids(tokenizer, MESSAGES) == own  # the tokenizer itself is left as it was
    assert with_chat_template(tokenizer, None) is tokenizer
    assert templated("hi")["input_ids"] == tokenizer("hi")["input_ids"] and templated.eos_token == "<eos>"


def test_a_file_or_the_template_itself(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE == load_chat_template(TEMPLATE)
    with pytest.raises(InvalidArgument, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(InvalidArgument, match="does not compile"):
        load_chat_template("{% for m in messages %}{{ m['content'] }}")


def test_the_server_builds_chat_prompts_with_it():
    from serve_testing import live_server

    target, draft, tokenizer = tiny_qwen2(seed=0), tiny_qwen2(seed=1, layers=1), tiny_tokenizer()
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %} and more words."
    expected = len(tokenizer("hi and more words.")["input_ids"])
    for settings, n_prompt in ((ServeSettings(chat_template=template, stats_interval=0), expected),
                               (ServeSettings(stats_interval=0), len(chat_ids(tokenizer, [MESSAGES[1]])))):
        engine, _ = make_engine(target, draft, tokenizer, k=2)
        with live_server(create_app(engine, tokenizer, "m", settings=settings)) as url:
            body = {"model": "m", "messages": [MESSAGES[1]], "max_tokens": 2, "temperature": 0}
            response = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] == n_prompt
    assert expected != len(chat_ids(tokenizer, [MESSAGES[1]]))


def test_logging_is_configured_once_at_the_level_asked():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        configure_logging("warning")
        assert root.level == logging.WARNING and logging.getLogger("httpx").level == logging.WARNING
        configure_logging("debug")
        assert root.level == logging.DEBUG and logging.getLogger("httpx").level == logging.WARNING
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    assert uvicorn_options("debug") == {"log_level": "debug", "log_config": None}
