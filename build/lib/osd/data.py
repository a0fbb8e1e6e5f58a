"""Prompt streams from JSONL files (../shared/datasets by default), and chat-template encoding."""
from __future__ import annotations

import json
import os
from pathlib import Path

from osd.errors import DatasetNotFound, InvalidArgument


def datasets_dir() -> Path:
    """$OSD_DATASETS, else the shared/datasets folder beside the repository or the working dir."""
    candidates = [os.environ.get("OSD_DATASETS")]
    here = Path(__file__).resolve()
    candidates += [str(p / "shared" / "datasets") for p in list(here.parents)[:5]]
    candidates += [str(Path.cwd().parent / "shared" / "datasets"), str(Path.cwd() / "shared" / "datasets")]
    for c in candidates:
        if c and Path(c).is_dir():
            return Path(c)
    raise DatasetNotFound("prompt datasets not found: set OSD_DATASETS to the folder holding *.jsonl")


def load_records(name: str, split: str | None = None, limit: int | None = None, offset: int = 0) -> list[dict]:
    """Records of a dataset (file name without .jsonl, or a path), in file order.

    name@lang keeps the records of one language (multilingual_qa@de): the language's own stream."""
    name, _, lang = name.rpartition("@") if "@" in name and not Path(name).exists() else (name, "", "")
    path = Path(name)
    if not path.exists():
        path = datasets_dir() / (name if name.endswith(".jsonl") else f"{name}.jsonl")
    if not path.exists():
        raise InvalidArgument(f"dataset not found: {name} (looked for {path})")
    out, seen = [], 0
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidArgument(f"{path}:{line_no}: not valid JSON ({e})") from e
            if (split and record.get("split") != split) or (lang and record.get("lang") != lang):
                continue
            if "prompt" not in record or not str(record["prompt"]).strip():
                continue
            seen += 1
            if seen <= offset:
                continue
            out.append(record)
            if limit is not None and len(out) >= limit:
                break
    return out


def spider_schema(db_id: str) -> str | None:
    """The CREATE TABLE statements of a Spider database (spider_tables.json beside the datasets), or None."""
    path = datasets_dir() / "spider_tables.json"
    if not path.exists():
        return None
    if "spider" not in _schemas:
        _schemas["spider"] = {t["db_id"]: t for t in json.loads(path.read_text(encoding="utf-8"))}
    table = _schemas["spider"].get(db_id)
    if table is None:
        return None
    columns = {i: [] for i in range(len(table["table_names_original"]))}
    for (owner, name), kind in zip(table["column_names_original"], table["column_types"]):
        if owner >= 0:
            columns[owner].append(f"{name} {kind}")
    return "\n".join(f"CREATE TABLE {t} ({', '.join(columns[i])});" for i, t in enumerate(table["table_names_original"]))


_schemas: dict = {}


def with_context(record: dict) -> str:
    """A record's prompt with the context it needs to be answerable: a Spider question gets its database's schema
    and the ask for one SQLite query (the dataset's `prompt` is the question alone); other prompts as they are."""
    db_id = (record.get("meta") or {}).get("db_id")
    schema = spider_schema(db_id) if record.get("source") == "spider" and db_id else None
    if schema is None:
        return record["prompt"]
    return f"Given this SQLite schema:\n{schema}\n\nWrite one SQL query that answers: {record['prompt']}"


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat (list of {role, content}) through the tokenizer's chat template."""
    if not messages or any(not isinstance(m, dict) or "role" not in m or "content" not in m for m in messages):
        raise InvalidArgument("messages must be a non-empty list of {role, content} objects")
    if getattr(tokenizer, "chat_template", True) is None:
        text = "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict):
        ids = ids["input_ids"]
    return list(ids)


def prompt_ids(tokenizer, prompt: str, chat: bool = True) -> list[int]:
    """A user prompt -> ids (through the chat template unless chat=False)."""
    if chat:
        return chat_ids(tokenizer, [{"role": "user", "content": prompt}])
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
