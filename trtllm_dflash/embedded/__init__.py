"""The embedded default pair: a tiny trained gpt-oss target and its DFlash drafter, shipped in the
package so every command works with no arguments on any machine."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import InputError

ROOT = Path(__file__).parent
TARGET_DIR, DRAFTER_DIR, PROMPTS_FILE = ROOT / "target", ROOT / "drafter", ROOT / "heldout_prompts.jsonl"


def pair_paths() -> tuple[Path, Path]:
    """(target_dir, drafter_dir) of the shipped pair."""
    if not ((TARGET_DIR / "config.json").is_file() and (DRAFTER_DIR / "config.json").is_file()):
        raise InputError("the embedded default pair is not shipped in this build yet; pass ENGINE_DIR or "
                         "--target DIR --drafter DIR.", path=ROOT)
    return TARGET_DIR, DRAFTER_DIR


def heldout_prompts(limit: int = 4) -> list[str]:
    """A few prompts from files the embedded pair never trained on."""
    if not PROMPTS_FILE.is_file():
        raise InputError("no prompts given (use --prompt TEXT or --prompts-file FILE); the embedded held-out "
                         "prompts are not shipped in this build yet.", path=PROMPTS_FILE, field="--prompt")
    lines = PROMPTS_FILE.read_text().splitlines()[:limit]
    return [json.loads(line)["prompt"] for line in lines]
