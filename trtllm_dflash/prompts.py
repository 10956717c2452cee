"""Prompt files, tokenizers and token ids, shared by the run, bench, build and training commands."""

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


def encode_prompts(prompts: list[str | list[int]], tokenizer, chat: bool = False,
                   target_dir: Path | None = None) -> list[list[int]]:
    """Token ids per prompt: ids as given, text through `tokenizer`; with `chat` (--chat) through its
    chat template (`target_dir` names the tokenizer's config when it has none)."""
    if chat and not getattr(tokenizer, "chat_template", None):
        raise InputError("--chat needs a chat template in the target tokenizer's config, and there is none.",
                         path=target_dir / "tokenizer_config.json", field="chat_template")
    encoded = []
    for prompt in prompts:
        if not isinstance(prompt, str):
            encoded.append(prompt)
        elif chat:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                tokenize=True)
            encoded.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
        else:
            encoded.append(tokenizer.encode(prompt))
    return encoded


def prompt_token_ids(prompts: list[str | list[int]], target_dir: Path) -> list[list[int]]:
    """Token ids per prompt without a chat template: ids as given, text through the target's
    tokenizer, which is only loaded when some prompt is text."""
    tokenizer = load_tokenizer(target_dir) if any(isinstance(p, str) for p in prompts) else None
    return encode_prompts(prompts, tokenizer)
