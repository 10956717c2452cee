"""Assemble the embedded default pair that ships inside the package.

    python -m trtllm_dflash.train.embedded --target runs/target/export --drafter runs/drafter/drafter

Copies the exported target (gpt-oss HF layout, MXFP4 experts, tokenizer), the trained drafter
(z-lab layout, stored in bf16 like the published drafters), the corpus split record, and a set of
held-out prompts into `trtllm_dflash/embedded/`. The model card there records how each part was
made and what was measured.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .. import embedded
from ..train import corpus

NUM_PROMPTS = 64


def copy_target(export: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for file in sorted(export.iterdir()):
        if file.is_file():
            shutil.copy(file, dest / file.name)


def copy_drafter_bf16(drafter: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(drafter / "config.json", dest / "config.json")
    state = {k: v.to(torch.bfloat16) for k, v in load_file(drafter / "model.safetensors").items()}
    save_file(state, dest / "model.safetensors", metadata={"format": "pt"})
    (dest / "model.safetensors").chmod(0o644)  # save_file creates 0600; package data must be world-readable


def write_prompts(dest: Path, count: int = NUM_PROMPTS) -> None:
    lines = [json.dumps({"prompt": p.text, "source": f"{p.path}:{p.line}"}) for p in corpus.heldout_prompts()[:count]]
    dest.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True, help="exported target directory")
    parser.add_argument("--drafter", type=Path, required=True, help="drafter directory written by dflash-train")
    parser.add_argument("--split-record", type=Path, default=Path("runs/target/corpus_split.json"))
    args = parser.parse_args()
    copy_target(args.target, embedded.TARGET_DIR)
    copy_drafter_bf16(args.drafter, embedded.DRAFTER_DIR)
    shutil.copy(args.split_record, embedded.ROOT / "corpus_split.json")
    write_prompts(embedded.PROMPTS_FILE)
    size = sum(f.stat().st_size for f in embedded.ROOT.rglob("*") if f.is_file())
    print(f"embedded pair written to {embedded.ROOT} ({size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
