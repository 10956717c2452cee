"""Reference runtime: DFlash vs n-gram (prompt lookup) vs DFlash + suffix automaton (dflash-sa)
vs autoregressive, same prompts, one process.

    python benchmarks/bench_reference_runtime.py [--target DIR --drafter DIR] [--prompts-file FILE]
                                                 [--batch-size N] [--max-tokens N] [--repeats N]
                                                 [--threads N] [--sa-thresholds 2,3,4] [--adaptive]
                                                 [--sa-max-drafts N]
                                                 [--drafter-gemm-dtype D] [--also-drafter-gemm-dtype D]
                                                 [--also-torch-drafter]

Pair: --target/--drafter, else the embedded default pair with its held-out prompts, else (with
--random) a random pair at the embedded scale, where acceptance is meaningless and the numbers
show the loop's overhead only. The runs are interleaved per batch of prompts (every method on a
batch before the next, in rotating order) and speed-ups are the median of per-repeat ratios
(min..max beside it), so machine noise largely cancels. tau is pooled:
committed tokens over verify steps of all prompts. Greedy outputs are also checked for
losslessness against the autoregressive run. With --adaptive, DFlash and dflash-sa also run with a
per-step adaptive draft length (`runtime/draft_length.py`), its step costs measured here first. With
--sa-max-drafts N, the dflash-sa rows at the first threshold also run with suffix drafts of up to N tokens
(rows suffixed -sN; `SuffixDFlashProposer(max_suffix_drafts=N)`; the adaptive ones share one cost table, the
block-bound rows reading its first K), and n-gram with N drafts (ngram-kN) beside them. The
DFlash and dflash-sa rows run the drafter step's GEMMs as `dflash-run --drafter-gemm-dtype` would
(`--drafter-gemm-dtype`, default auto); with --also-drafter-gemm-dtype D, every such row is also run
with them in D (`DFlashProposer(matmul_dtype=...)`; rows suffixed -D, adaptive ones with their own
step costs). With --also-torch-drafter, every such row also runs on a second copy of the drafter kept on its
torch formulation (`use_cpu_kernel = False`; rows suffixed -torch): the compiled CPU draft-step kernels'
effect, side by side. With --suffix-priors P,..., the widest adaptive dflash-sa row also runs with each of these
priors for its suffix drafts' untried positions instead of `SOURCE_PRIORS`' (rows suffixed -pP, the same
step costs).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import tempfile
import time
from pathlib import Path

import torch

from trtllm_dflash.checkpoints.gpt_oss import load_hf_gpt_oss
from trtllm_dflash.models.drafter import load_drafter
from trtllm_dflash.models.linear import DRAFTER_GEMM_DTYPES, drafter_gemm_dtype
from trtllm_dflash.models.random_pair import drafter_config_for, save_random_drafter, save_random_target, tiny_target_config
from trtllm_dflash.models.target import GptOssTarget
from trtllm_dflash.prompts import load_tokenizer, read_prompts_file
from trtllm_dflash.runtime.draft_length import (KEY_EDGES, SOURCE_PRIORS, adaptive_draft_length, format_costs,
                                               measure_step_costs)
from trtllm_dflash.runtime.proposers import DEFAULT_SA_THRESHOLD, DFlashProposer, NGramProposer, SuffixDFlashProposer
from trtllm_dflash.runtime.reference import ReferenceRuntime
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.runtime.stats import total_stats
from trtllm_dflash.runtime.tuning import EXPERT_DTYPES, choose_expert_storage, expert_storage_note


def random_pair(root: Path) -> tuple[Path, Path]:
    config = tiny_target_config(vocab_size=4096, hidden_size=256, num_layers=4, heads=4, kv_heads=2, head_dim=64,
                                experts=8, top_k=2, intermediate_size=256, sliding_window=64, eos_token_id=4095)
    save_random_target(root / "target", config)
    save_random_drafter(root / "drafter", drafter_config_for(config, num_layers=1, block_size=8,
                                                             target_layer_ids=[0, 1, 2]))
    return root / "target", root / "drafter"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path)
    parser.add_argument("--drafter", type=Path)
    parser.add_argument("--random", action="store_true", help="use a random pair (overhead only)")
    parser.add_argument("--prompts-file", type=Path)
    parser.add_argument("--prompts", type=int, default=8, help="how many prompts to use")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dflash-blocks", default="",
                        help="extra DFlash rows at these block sizes (comma-separated, e.g. 4,6)")
    parser.add_argument("--sa-thresholds", default=str(DEFAULT_SA_THRESHOLD),
                        help="dflash-sa rows at these suffix-match thresholds (comma-separated)")
    parser.add_argument("--adaptive", action="store_true",
                        help="add DFlash and dflash-sa rows with a per-step adaptive draft length")
    parser.add_argument("--sa-max-drafts", type=int,
                        help="add dflash-sa rows whose suffix drafts run up to this many tokens, and n-gram with as many")
    parser.add_argument("--suffix-priors", default="",
                        help="with --adaptive: the widest adaptive dflash-sa row also at these suffix priors (comma-separated)")
    parser.add_argument("--suffix-key-edges", default="",
                        help="with --adaptive: the widest adaptive dflash-sa row also with these buckets of match lengths "
                             "(comma-separated; each edges joined by ':', e.g. 4:16, or none for one estimate)")
    parser.add_argument("--expert-dtype", choices=EXPERT_DTYPES, default="auto",
                        help="as dflash-run's option of that name")
    parser.add_argument("--drafter-gemm-dtype", choices=DRAFTER_GEMM_DTYPES, default="auto",
                        help="as dflash-run's option of that name, for the DFlash and dflash-sa rows")
    parser.add_argument("--also-drafter-gemm-dtype", choices=DRAFTER_GEMM_DTYPES[1:],
                        help="add DFlash and dflash-sa rows (suffixed with it) whose drafter GEMMs run in this dtype")
    parser.add_argument("--also-torch-drafter", action="store_true",
                        help="add DFlash and dflash-sa rows (suffixed -torch) whose drafter runs without the compiled CPU kernels")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        if args.target:
            target_dir, drafter_dir, label = args.target, args.drafter, str(args.target)
        elif args.random:
            (target_dir, drafter_dir), label = random_pair(Path(tmp)), "random (overhead only)"
        else:
            from trtllm_dflash.embedded import PROMPTS_FILE, pair_paths

            (target_dir, drafter_dir), label = pair_paths(), "embedded"
            args.prompts_file = args.prompts_file or PROMPTS_FILE
        dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
        target = GptOssTarget(load_hf_gpt_oss(target_dir, args.device, dtype))
        drafter = load_drafter(drafter_dir, args.device, dtype)
        torch_drafter = load_drafter(drafter_dir, args.device, dtype) if args.also_torch_drafter else None
        if args.prompts_file:
            tokenizer = load_tokenizer(target_dir)
            texts = read_prompts_file(args.prompts_file)[: args.prompts]
            prompts = [tokenizer.encode(p) if isinstance(p, str) else p for p in texts]
        else:
            gen = torch.Generator().manual_seed(0)
            prompts = [torch.randint(0, target.vocab_size - 2, (64,), generator=gen).tolist()
                       for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=args.max_tokens)  # no stop ids: every run decodes the same length
    block = drafter.config.block_size
    print(expert_storage_note(target, choose_expert_storage(target, args.expert_dtype, args.batch_size, block),
                              args.batch_size, block))
    runtimes = {"autoregressive": ReferenceRuntime(target, None),
                "ngram": ReferenceRuntime(target, NGramProposer(num_drafts=block - 1))}
    longest = args.sa_max_drafts
    if longest:
        runtimes[f"ngram-k{longest}"] = ReferenceRuntime(target, NGramProposer(num_drafts=longest))
    policies: dict = {}  # row -> its adaptive policy (`adaptive_draft_length`)
    first_threshold = int(args.sa_thresholds.split(",")[0])
    variants = [(args.drafter_gemm_dtype, drafter, "")]  # (GEMM dtype choice, drafter, row suffix)
    if args.also_drafter_gemm_dtype:
        variants.append((args.also_drafter_gemm_dtype, drafter, f"-{args.also_drafter_gemm_dtype}"))
    if torch_drafter is not None:
        torch_drafter.use_cpu_kernel = False
        variants.append((args.drafter_gemm_dtype, torch_drafter, "-torch"))
    for choice, model, suffix in variants:
        matmul_dtype = drafter_gemm_dtype(choice, dtype, torch.device(args.device))
        print(f"drafter GEMMs{suffix or ' (plain rows)'}: {str(matmul_dtype or dtype).removeprefix('torch.')}")

        def dflash(**kwargs) -> DFlashProposer:
            return DFlashProposer(model, target, matmul_dtype=matmul_dtype, **kwargs)

        runtimes[f"dflash{suffix}"] = ReferenceRuntime(target, dflash())
        for extra in (int(x) for x in args.dflash_blocks.split(",") if x):
            runtimes[f"dflash-b{extra}{suffix}"] = ReferenceRuntime(target, dflash(block_size=extra))
        for threshold in (int(x) for x in args.sa_thresholds.split(",") if x):
            runtimes[f"dflash-sa{threshold}{suffix}"] = ReferenceRuntime(target, SuffixDFlashProposer(dflash(), threshold))
        if longest:
            runtimes[f"dflash-sa{first_threshold}-s{longest}{suffix}"] = ReferenceRuntime(
                target, SuffixDFlashProposer(dflash(), first_threshold, max_suffix_drafts=longest))
        if args.adaptive:
            start = time.perf_counter()
            # one table for every adaptive row (the suffix row up to --sa-max-drafts), so their policies differ
            # only in how far suffix drafts may run, not in a second measurement's noise
            widest = measure_step_costs(target, dflash, args.batch_size, block - 1, suffix_most=longest)
            print(f"step costs{suffix} at batch {args.batch_size} (ms, K = 0, 1, ...; measured in "
                  f"{time.perf_counter() - start:.1f} s): {format_costs(widest)}")
            costs = {"neural": widest["neural"], "suffix": widest["suffix"][:block]}  # the block's K = 0..B-1
            policies[f"dflash-adapt{suffix}"] = adaptive_draft_length(costs)
            runtimes[f"dflash-adapt{suffix}"] = ReferenceRuntime(target, dflash(policy=policies[f"dflash-adapt{suffix}"]))
            # the adaptive hybrids: (row stem, step costs, longest suffix draft); the widest also at --suffix-priors
            hybrids = [(f"dflash-sa{first_threshold}-adapt", costs, None)]
            if longest:
                hybrids.append((f"dflash-sa{first_threshold}-s{longest}-adapt", widest, longest))
            stem, table, most = hybrids[-1]
            rows = [(name + suffix, adaptive_draft_length(row_costs), row_most) for name, row_costs, row_most in hybrids]
            rows += [(f"{stem}-p{prior:g}{suffix}", adaptive_draft_length(table, priors={**SOURCE_PRIORS, "suffix": prior}),
                      most) for prior in (float(x) for x in args.suffix_priors.split(",") if x)]
            for edges in (x for x in args.suffix_key_edges.split(",") if x):
                key_edges = {**KEY_EDGES, "suffix": () if edges == "none" else tuple(int(e) for e in edges.split(":"))}
                rows.append((f"{stem}-e{edges}{suffix}", adaptive_draft_length(table, key_edges=key_edges), most))
            for name, policy, row_most in rows:
                policies[name] = policy
                runtimes[name] = ReferenceRuntime(target, SuffixDFlashProposer(
                    dflash(), first_threshold, policy=policy, max_suffix_drafts=row_most))
    for runtime in runtimes.values():
        runtime.warm_up(prompts[0])
    rates: dict[str, list[float]] = {name: [] for name in runtimes}
    summary: dict[str, tuple[float, float, float]] = {}
    per_position: dict[str, list[float]] = {}
    outputs: dict[str, list[list[int]]] = {}
    names = list(runtimes)
    for _ in range(args.repeats):
        results: dict[str, list] = {name: [] for name in runtimes}
        times = {name: {"draft": 0.0, "verify": 0.0} for name in runtimes}
        # every method on one batch of prompts before the next batch, in a rotating order: the runs
        # compared are seconds apart, so load from other jobs hits them alike
        for turn, first in enumerate(range(0, len(prompts), args.batch_size)):
            for name in names[turn % len(names):] + names[: turn % len(names)]:
                results[name] += runtimes[name].generate(prompts[first: first + args.batch_size], params,
                                                         args.batch_size)
                for part, seconds in runtimes[name].step_times.items():
                    times[name][part] += seconds
        for name in runtimes:
            total = total_stats(results[name], args.batch_size)
            rates[name].append(total.decode_tokens_per_s)
            summary[name] = (total.acceptance_length, times[name]["draft"] / max(sum(times[name].values()), 1e-9),
                             total.suffix_steps / max(total.steps, 1))
            per_position[name] = total.per_position_acceptance
            outputs[name] = [r.output_token_ids for r in results[name]]

    print(f"pair={label} device={args.device} threads={args.threads} prompts={len(prompts)} "
          f"batch={args.batch_size} max_tokens={args.max_tokens} block={block} repeats={args.repeats}")
    print(f"{'method':<28}{'decode tok/s':>14}{'tau':>8}{'draft share':>13}{'suffix steps':>14}"
          f"{'speed-up':>10}{'min..max':>14}{'vs ngram':>10}{'lossless':>10}")
    for name in runtimes:
        ratios = [r / a for r, a in zip(rates[name], rates["autoregressive"])]
        versus_ngram = statistics.median(r / n for r, n in zip(rates[name], rates["ngram"]))
        lossless = sum(o == a for o, a in zip(outputs[name], outputs["autoregressive"]))
        tau, share, suffix = summary[name]
        print(f"{name:<28}{statistics.median(rates[name]):>14.1f}{tau:>8.2f}{share:>13.0%}{suffix:>14.0%}"
              f"{statistics.median(ratios):>9.2f}x{min(ratios):>7.2f}..{max(ratios):.2f}x"
              f"{versus_ngram:>9.2f}x{lossless:>6}/{len(prompts)}")
    for name in runtimes:
        if name != "autoregressive":
            print(f"{name} per-position acceptance: " + " ".join(f"{x:.2f}" for x in per_position[name]))
    for name, policy in policies.items():
        for source, chosen in policy.chosen.items():
            if chosen:
                counts = collections.Counter(chosen)
                print(f"{name} chosen K for {source} drafts (all repeats): "
                      + " ".join(f"{k}:{counts[k] / len(chosen):.0%}" for k in sorted(counts)))


if __name__ == "__main__":
    main()
