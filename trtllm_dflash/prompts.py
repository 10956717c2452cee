"""Prompt files and tokenizers, shared by the run, bench and training commands."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import InputError


def read_prompts_file(path: Path) -> list[str | list[int]]:
    """Plain text (one prompt per line) or JSONL objects with `prompt` (text) or `prompt_token_ids`."""
    if path.is_dir():
        raise InputError("is a directory; expected a text or JSONL file of prompts.", path=path)
    if not path.is_file():
        raise InputError("file not found.", path=path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); expected "
                         "text lines or JSONL.", path=path) from None
    prompts: list[str | list[int]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if not line.lstrip().startswith("{"):
            prompts.append(line)
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"line {number} is not valid JSON ({exc}).", path=path) from None
        if isinstance(record.get("prompt"), str):
            prompts.append(record["prompt"])
        elif isinstance(record.get("prompt_token_ids"), list):
            ids = record["prompt_token_ids"]
            if not all(type(t) is int for t in ids):  # not bool, float or str: no silent coercion
                raise InputError(f"line {number}: expected a list of integer token ids, got {ids[:8]}.", path=path,
                                 field="prompt_token_ids")
            prompts.append(ids)
        else:
            raise InputError(f"line {number} has neither a string 'prompt' nor a list 'prompt_token_ids'.",
                             path=path, field="prompt")
    if not prompts:
        raise InputError("no prompts in the file.", path=path)
    return prompts


def load_tokenizer(target_dir: Path):
    from transformers import AutoTokenizer

    if not any((target_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise InputError("no tokenizer (tokenizer.json) next to the target; text prompts need one "
                         "(or give token ids with a JSONL 'prompt_token_ids' field).", path=target_dir,
                         field="tokenizer.json")
    return AutoTokenizer.from_pretrained(target_dir)
