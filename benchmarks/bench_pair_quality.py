"""How well a DFlash pair drafts where the runtime drafts: pooled tau, tau by context length, losslessness.

    python benchmarks/bench_pair_quality.py [--target DIR] [--drafter [LABEL=]DIR ...] [--threads 1]
                                            [--max-tokens 128] [--json FILE]
                                            [--drafter-gemm-dtype float32|auto|bfloat16|float16|int8]

Greedy decoding with the reference runtime, DFlash alone, on four prompt sets:
- `heldout-16`, `heldout-64`: the embedded pair's held-out prompts (stdlib files never trained on);
- `third-party`: 64 snippets of the same shape (8-20 whole lines) from installed third-party packages
  (site-packages; the corpus is the standard library only, so this code is unseen);
- `long`: 16 snippets of 60-100 lines of held-out stdlib files, cut to their last 896 tokens, so that
  with 128 new tokens the contexts reach 1024.
Pooled tau = all tokens / all verify steps (a step makes its accepted drafts + 1). Tau by context
length pools the blocks by their anchor position (= context length) in 128-token buckets over
`heldout-64` and `long`. Every DFlash output is compared with the autoregressive one (batch 1), and
`heldout-16` is also decoded at batch 3 and 8. Acceptance does not depend on timing, so the numbers
are exact for the pair and runtime; no speed is measured here (see bench_reference_runtime.py).
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

import torch

from trtllm_dflash.checkpoints.gpt_oss import load_hf_gpt_oss
from trtllm_dflash.embedded import PROMPTS_FILE, pair_paths
from trtllm_dflash.models.drafter import load_drafter
from trtllm_dflash.models.linear import DRAFTER_GEMM_DTYPES, drafter_gemm_dtype
from trtllm_dflash.models.target import GptOssTarget
from trtllm_dflash.prompts import encode_prompts, load_tokenizer, read_prompts_file
from trtllm_dflash.runtime.proposers import DFlashProposer
from trtllm_dflash.runtime.reference import ReferenceRuntime
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.train import corpus
from trtllm_dflash.train.packages import EVALUATION_PACKAGES as THIRD_PARTY
SNIPPET_SEED = 4321
LONG_LINES = (60, 100)
LONG_PROMPT_TOKENS = 896
BUCKET = 128
BUCKETS = 8  # up to 1024 tokens of context
LOSSLESS_BATCHES = (3, 8)


def third_party_snippets(count: int) -> list[str]:
    """Deterministic snippets of installed third-party packages (tests and generated files skipped)."""
    root = Path(sysconfig.get_paths()["purelib"])
    lines_of = {}
    for package in THIRD_PARTY:
        for rel in corpus.list_files(root / package):
            lines_of[f"{package}/{rel}"] = corpus.read_source(root / package / rel).splitlines(keepends=True)
    return [p.text for p in corpus.snippets(lines_of, count, SNIPPET_SEED)]


def long_snippets(count: int) -> list[str]:
    root = corpus.stdlib_root()
    lines_of = {f: corpus.read_source(root / f).splitlines(keepends=True) for f in corpus.split_files(root)["heldout"]}
    return [p.text for p in corpus.snippets(lines_of, count, SNIPPET_SEED, *LONG_LINES)]


def prompt_sets(tokenizer, heldout: int, third_party: int, long: int) -> dict[str, list[list[int]]]:
    held = encode_prompts(read_prompts_file(PROMPTS_FILE), tokenizer)
    return {"heldout-16": held[:16], "heldout-64": held[:heldout],
            "third-party": encode_prompts(third_party_snippets(third_party), tokenizer),
            "long": [ids[-LONG_PROMPT_TOKENS:] for ids in encode_prompts(long_snippets(long), tokenizer)]}


def anchors_and_steps(prompt_len: int, accepted: list[int]) -> list[tuple[int, int]]:
    """(anchor position = context length, tokens made) of every verify step of one request."""
    out, position = [], prompt_len
    for a in accepted:
        out.append((position, a + 1))
        position += a + 1
    return out


def summarize(results, prompts) -> dict:
    steps = [s for r, p in zip(results, prompts) for s in anchors_and_steps(len(p), r.stats.accepted_per_step)]
    return {"tau": sum(t for _, t in steps) / len(steps), "steps": len(steps), "blocks": steps}


def by_context(blocks: list[tuple[int, int]]) -> list[dict]:
    rows = []
    for i in range(BUCKETS):
        made = [t for pos, t in blocks if i * BUCKET <= pos < (i + 1) * BUCKET]
        rows.append({"bucket": f"{i * BUCKET}-{(i + 1) * BUCKET - 1}", "steps": len(made),
                     "tau": sum(made) / len(made) if made else None})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path)
    parser.add_argument("--drafter", action="append", default=[], help="[LABEL=]DIR; repeat to compare drafters")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--heldout", type=int, default=64)
    parser.add_argument("--third-party", type=int, default=64)
    parser.add_argument("--long", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write every number here")
    parser.add_argument("--drafter-gemm-dtype", choices=DRAFTER_GEMM_DTYPES, default="float32",
                        help="as dflash-run's option of that name (default float32: the drafter as trained)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target_dir, drafter_dir = pair_paths()
    target_dir = args.target or target_dir
    drafters = [d.split("=", 1) if "=" in d else (d, d) for d in args.drafter] or [("shipped", str(drafter_dir))]
    target = GptOssTarget(load_hf_gpt_oss(target_dir, "cpu", torch.float32))
    sets = {name: prompts for name, prompts in  # a set asked with 0 prompts is left out
            prompt_sets(load_tokenizer(target_dir), args.heldout, args.third_party, args.long).items() if prompts}
    params = SamplingParams(max_tokens=args.max_tokens)
    baseline = ReferenceRuntime(target, None)
    reference = {name: [r.output_token_ids for r in baseline.generate(p, params, 1)] for name, p in sets.items()}
    report = {}
    gemm = drafter_gemm_dtype(args.drafter_gemm_dtype, torch.float32, torch.device("cpu"))
    for label, directory in drafters:
        drafter = load_drafter(directory, "cpu", torch.float32)
        runtime = ReferenceRuntime(target, DFlashProposer(drafter, target, matmul_dtype=gemm))
        row = {}
        for name, prompts in sets.items():
            results = runtime.generate(prompts, params, 1)
            row[name] = summarize(results, prompts)
            row[name]["lossless"] = sum(r.output_token_ids == ref for r, ref in zip(results, reference[name]))
            row[name]["prompts"] = len(prompts)
        for batch in LOSSLESS_BATCHES:
            results = runtime.generate(sets["heldout-16"], params, batch)
            row[f"lossless-batch-{batch}"] = sum(r.output_token_ids == ref
                                                 for r, ref in zip(results, reference["heldout-16"]))
        row["by-context"] = by_context([block for name in ("heldout-64", "long") if name in sets
                                        for block in row[name]["blocks"]])
        report[label] = row
        print(f"\n{label} ({directory})")
        for name in sets:
            print(f"  {name:12s} tau {row[name]['tau']:.3f} over {row[name]['steps']} steps, "
                  f"lossless {row[name]['lossless']}/{row[name]['prompts']}")
        print("  lossless at batch " + ", ".join(f"{b}: {row[f'lossless-batch-{b}']}/16" for b in LOSSLESS_BATCHES))
        print("  tau by context: " + "  ".join(f"{c['bucket']}: {c['tau']:.2f} ({c['steps']})" if c["tau"] else
                                               f"{c['bucket']}: - (0)" for c in row["by-context"]))
    if args.json:
        for row in report.values():
            for name in sets:
                del row[name]["blocks"]
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
