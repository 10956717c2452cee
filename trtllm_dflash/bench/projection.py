"""PROJECTION, not a measurement: gpt-oss-120b + the z-lab DFlash drafter on an 8x B200 node served
by TensorRT-LLM, computed from published numbers through the same cost model dflash-bench fits.
It is replaced by measurements when someone runs `dflash-bench` on the TensorRT-LLM path.

Inputs (every one cited; files under /work/shared/reference/):
  AR at batch 1: 420 tokens/s/user, 8x B200, TP8 (trtllm-integration.md §7.4, TensorRT-LLM blog 9)
  AR at full load: 19.5k tokens/s/GPU, 4x B200 DP4EP4 (same source), taken per GPU for 8 GPUs
  tau by task at draft lengths 3/5/9 (block 4/6/10): HF model card z-lab/gpt-oss-120b-DFlash
      (dflash-algorithm.md §7.2, peers.md §9); assumed flat across concurrency (peers.md §9 takeaway)
  end-to-end speedups by task at c = 1..64 and K = 3/9: same card (SGLang, 1x H200, incl. prefill)
Assumptions (arithmetic, labelled):
  verify_time(b, w) = a0 + a2*b*w: a0 + a2 = 1/420 s; a2 = 1 / (8 * 19.5k) s per token; a1 = 0.
      A verify of w tokens costs what w AR tokens of compute cost, plus one fixed pass. Optimistic at
      small batch for a MoE (w tokens touch more experts than one) -- the card calibration absorbs that.
  P(first j accepted) constant between the published block sizes (so tau(3), tau(5), tau(9) are exact).
  draft_time(b, k) = c0 + c2*b*k, two scenarios that bracket the drafter:
      "size-scaled"     c0 = a0 * 8/36 (drafter vs target layers), c2 = a2 * (0.78 B drafter + 0.58 B
                         shared LM head) / 5.1 B active target parameters -- an optimised drafter
      "card-calibrated" c0, c2 least-squares fitted so the model reproduces the card's speedups -- an
                         SGLang/H200 drafter, with prefill time counted against it (pessimistic)
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .cost_model import CostModel, least_squares
from .points import AR, BenchPoint
from .pareto import throughput_gain_at
from .report import curve, headline
from .schedule import build_schedule, model_score

GPUS = 8
AR_TOKENS_PER_S_USER_BATCH1 = 420.0
AR_TOKENS_PER_S_PER_GPU_MAX = 19_500.0
DRAFT_LENGTHS_PUBLISHED = (3, 5, 9)
TAU_BY_TASK = {  # tau at K = 3, 5, 9
    "GSM8K": (3.3, 4.3, 5.3), "Math500": (3.3, 4.3, 5.4), "HumanEval": (3.1, 3.8, 4.4),
    "MBPP": (3.1, 3.9, 4.6), "MT-Bench": (2.7, 3.3, 3.7),
}
CARD_SPEEDUP = {  # concurrency -> task -> (speedup at K=3, at K=9)
    1: {"GSM8K": (1.3, 1.8), "Math500": (1.5, 1.9), "HumanEval": (1.3, 1.7), "MBPP": (1.4, 1.8), "MT-Bench": (1.3, 1.3)},
    8: {"GSM8K": (1.2, 1.6), "Math500": (1.4, 1.7), "HumanEval": (1.4, 1.7), "MBPP": (1.5, 1.7), "MT-Bench": (1.2, 1.3)},
    16: {"GSM8K": (1.3, 1.6), "Math500": (1.5, 1.6), "HumanEval": (1.4, 1.8), "MBPP": (1.5, 1.8), "MT-Bench": (1.3, 1.3)},
    32: {"GSM8K": (1.2, 1.5), "Math500": (1.4, 1.5), "HumanEval": (1.5, 1.7), "MBPP": (1.6, 1.8), "MT-Bench": (1.4, 1.3)},
    64: {"GSM8K": (1.2, 1.5), "Math500": (1.4, 1.5), "HumanEval": (1.4, 1.5), "MBPP": (1.6, 1.6), "MT-Bench": (1.3, 1.2)},
}
DRAFTER_LAYERS, TARGET_LAYERS = 8, 36
DRAFTER_PARAMS_B, LM_HEAD_PARAMS_B, TARGET_ACTIVE_PARAMS_B = 0.78, 0.58, 5.1
CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # schedule bands and plot points
MID_INTERACTIVITY = 300.0  # tokens/s/user: ~70% of AR's batch-1 speed, away from AR's limit
DENSE = tuple(range(1, 257))  # every batch size, so the headline ratios do not depend on grid luck


def verify_coefficients() -> tuple[float, float, float]:
    a2 = 1.0 / (GPUS * AR_TOKENS_PER_S_PER_GPU_MAX)
    return 1.0 / AR_TOKENS_PER_S_USER_BATCH1 - a2, 0.0, a2


def acceptance_from_tau(taus: Sequence[float]) -> tuple[float, ...]:
    """P(first j accepted), j = 1..9, constant between the published draft lengths."""
    acceptance, done, previous = [], 0, 1.0
    for k, tau in zip(DRAFT_LENGTHS_PUBLISHED, taus):
        acceptance += [(tau - previous) / (k - done)] * (k - done)
        done, previous = k, tau
    return tuple(acceptance)


def size_scaled_draft() -> tuple[float, float, float]:
    a0, _, a2 = verify_coefficients()
    return (a0 * DRAFTER_LAYERS / TARGET_LAYERS, 0.0,
            a2 * (DRAFTER_PARAMS_B + LM_HEAD_PARAMS_B) / TARGET_ACTIVE_PARAMS_B)


def card_calibrated_draft() -> tuple[float, float, float]:
    """c0 fitted so step(c, K) = tau * AR_step(c) / speedup over the card's 50 (task, c, K) points;
    c2 as size-scaled (a free c2 fits slightly negative: the card's speedups hardly move with c)."""
    c2 = size_scaled_draft()[2]
    verify = CostModel(verify_coefficients(), (0.0, 0.0, 0.0), ())
    rows, targets = [], []
    for c, by_task in CARD_SPEEDUP.items():
        for task, speedups in by_task.items():
            for k, speedup, tau in zip((3, 9), speedups, (TAU_BY_TASK[task][0], TAU_BY_TASK[task][2])):
                step = tau * verify.verify_time(c, 1) / speedup
                rows.append([1.0])
                targets.append(step - verify.verify_time(c, k + 1) - c2 * c * k)
    return least_squares(rows, targets, width=1)[0], 0.0, c2


SCENARIOS = {"size-scaled": size_scaled_draft, "card-calibrated": card_calibrated_draft}


def model_points(model: CostModel, concurrency: Sequence[int] = CONCURRENCY) -> list[BenchPoint]:
    """Predicted points in the bench's own record, so the bench's Pareto and schedule code applies."""
    points = []
    for c in concurrency:
        for k in range(model.max_draft_len + 1):
            step = model.step_time(c, k)
            points.append(BenchPoint(method=AR if k == 0 else "dflash", draft_len=k, concurrency=c,
                                     tokens_per_s_user=model.tokens_per_s_user(c, k), tokens_per_s=model.tokens_per_s(c, k),
                                     tau=model.tokens_per_step(k), draft_s=model.draft_time(c, k),
                                     verify_s=model.verify_time(c, k + 1), step_s=step, mean_batch=float(c), steps=0,
                                     decode_tokens=0, repeats=0, per_position_acceptance=list(model.acceptance[:k]),
                                     decode_tokens_per_s=model.tokens_per_s(c, k)))
    return points


def project(task: str, scenario: str) -> dict:
    model = CostModel(verify_coefficients(), SCENARIOS[scenario](), acceptance_from_tau(TAU_BY_TASK[task]))
    dense = model_points(model, DENSE)
    spec, ar = curve([p for p in dense if p.method != AR]), curve([p for p in dense if p.method == AR])
    return {"task": task, "scenario": scenario, "model": model.to_dict(), "headline": headline(dense),
            "gain_at_mid_interactivity": throughput_gain_at(spec, ar, MID_INTERACTIVITY),
            "schedule": build_schedule(model_score(model), CONCURRENCY, model.max_draft_len, "projection"),
            "points": model_points(model)}


def markdown_table() -> str:
    lines = [f"| Task | Drafter scenario | Interactivity gain at batch 1 (best K) | Throughput gain at "
             f"{MID_INTERACTIVITY:.0f} tok/s/user | Largest throughput gain at equal interactivity (at tok/s/user) "
             "| draft_len_schedule |", "|---|---|---|---|---|---|"]
    for scenario in SCENARIOS:
        for task in TAU_BY_TASK:
            result = project(task, scenario)
            inter = result["headline"]["interactivity_gain_at_smallest_batch"]
            gain = result["headline"]["throughput_gain_at_equal_interactivity"]
            mid = result["gain_at_mid_interactivity"]
            lines.append(f"| {task} | {scenario} | {inter['ratio']:.2f}x (K={inter['draft_len']}) | "
                         + (f"{mid:.1f}x" if mid else "n/a") + " | "
                         + (f"{gain['ratio']:.1f}x (at {gain['tokens_per_s_user']:.0f}, K={gain['draft_len']}, "
                            f"c={gain['concurrency']})" if gain else "no overlap")
                         + f" | `{result['schedule']['draft_len_schedule']}` |")
    return "\n".join(lines)


def main() -> None:
    """`python -m trtllm_dflash.bench.projection [PLOT_DIR]`: the table (and Pareto plots per task)."""
    a0, _, a2 = verify_coefficients()
    print(f"verify: a0 = {a0 * 1e3:.3f} ms, a2 = {a2 * 1e6:.2f} us/token")
    for name, scenario in SCENARIOS.items():
        c0, _, c2 = scenario()
        print(f"draft ({name}): c0 = {c0 * 1e3:.3f} ms, c2 = {c2 * 1e6:.2f} us/draft token")
    print(markdown_table())
    if len(sys.argv) > 1:
        from pathlib import Path

        from .plots import plot_pareto

        out = Path(sys.argv[1])
        out.mkdir(parents=True, exist_ok=True)
        for scenario in SCENARIOS:
            result = project("HumanEval", scenario)
            print(plot_pareto(result["points"], out / f"projection_humaneval_{scenario}.png",
                              f"PROJECTION gpt-oss-120b, 8x B200, HumanEval tau, drafter {scenario}"))


if __name__ == "__main__":
    main()
