"""Training sequences from installed third-party packages: windows of their code continued by the target.

The embedded drafter was trained on continuations of stdlib code only; this adds the target's own greedy
continuations of other packages' code (drafter v10, model card). The packages the third-party evaluation set
cuts its snippets from (`EVALUATION_PACKAGES`, used by `benchmarks/bench_pair_quality.py`) are never read, nor
are vendored copies (pip and setuptools vendor some of them), so that set stays unseen.

    python -m trtllm_dflash.train.packages --target DIR --out FILE [--count 3072] [--seed 23] [--threads 2]

writes a [count, prompt + response] tensor of token ids for `dflash-train --extra-sequences FILE PROMPT SHARE`.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import torch

from . import corpus
from .data import sample_windows

EVALUATION_PACKAGES = ("click", "rich", "pydantic", "jinja2", "yaml", "hypothesis", "safetensors", "packaging")
TRAINING_PACKAGES = ("sympy", "networkx", "numpy", "pygments", "matplotlib", "huggingface_hub", "_pytest", "fsspec",
                     "markdown_it", "tqdm", "anyio", "filelock", "dateutil", "pyparsing", "typer", "onnxscript",
                     "fontTools")
WINDOW_STRIDE, WINDOW_SHARE = 256, 0.25


def package_windows(tokenizer, count: int, length: int, seed: int, root: Path | None = None,
                    packages: tuple[str, ...] = TRAINING_PACKAGES) -> list[list[int]]:
    """`count` deterministic windows of `length` tokens of the packages' files (`sample_windows`: a random
    WINDOW_SHARE of the windows starting every WINDOW_STRIDE tokens). Packages that are not installed
    under `root` (default: site-packages) are skipped."""
    overlap = set(packages) & set(EVALUATION_PACKAGES)
    if overlap:
        raise ValueError(f"{sorted(overlap)} feed the third-party evaluation set; training on them would leak it")
    root = root or Path(sysconfig.get_paths()["purelib"])
    texts = (corpus.read_source(root / package / rel) for package in packages if (root / package).is_dir()
             for rel in corpus.list_files(root / package) if "_vendor" not in rel and "vendored" not in rel)
    return sample_windows(texts, tokenizer, count, length, seed, WINDOW_STRIDE, WINDOW_SHARE)


def main() -> None:
    from ..checkpoints.gpt_oss import load_hf_gpt_oss
    from ..models.target import GptOssTarget
    from ..prompts import load_tokenizer
    from .data import regenerate

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--count", type=int, default=3072)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--response-tokens", type=int, default=384)
    parser.add_argument("--seed", type=int, default=23)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = package_windows(load_tokenizer(args.target), args.count, args.prompt_tokens, args.seed)
    target = GptOssTarget(load_hf_gpt_oss(args.target, "cpu", torch.float32))
    sequences = torch.tensor(regenerate(target, prompts, args.response_tokens))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(sequences, args.out.with_suffix(".tmp"))  # never half a file under the final name
    args.out.with_suffix(".tmp").replace(args.out)
    print(f"{tuple(sequences.shape)} written to {args.out}")


if __name__ == "__main__":
    main()
