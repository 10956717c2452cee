"""The benchmark scripts that run on the embedded pair, each at a tiny size: they run to the end and report
what they exist to report (lossless rows, identical outputs). Nothing else runs them between rounds, and
they break silently when the code under them changes (round 10 found two that did). The numbers
themselves are not checked: at this size they are noise."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

# script, arguments, what its output must show
CASES = {
    "bench_reference_runtime": (["--prompts", "2", "--max-tokens", "8", "--repeats", "1", "--adaptive",
                                 "--sa-max-drafts", "11", "--suffix-priors", "0.5", "--also-torch-drafter"],
                                [r"^(autoregressive|ngram|ngram-k11|(dflash|dflash-sa2|dflash-sa2-s11|dflash-adapt|"
                                 r"dflash-sa2-adapt|dflash-sa2-s11-adapt|dflash-sa2-s11-adapt-p0.5)(-torch)?) .* 2/2$"]),
    "bench_step_costs": (["--prompts", "2", "--max-tokens", "8", "--repeats", "1", "--batch-sizes", "1,2"],
                         [r"^batch 1: .*DFlash 2/2, AR 2/2, generate 2/2$", r"^batch 2: .*DFlash 2/2, AR 2/2, generate 2/2$",
                          r"^drafter step "]),
    "bench_expert_storage": (["--prompts", "2", "--max-tokens", "8", "--repeats", "1"],
                             [r"outputs identical across storages and methods: True", r"^start-up timing .* -> \w+$"]),
    "bench_inflight_batching": (["--prompts", "3", "--max-tokens", "8", "--repeats", "1", "--batch-sizes", "2"],
                                [r"^    2  (autoregressive|default|ngram) (static|inflight) .* 3/3$"]),
    "bench_pair_quality": (["--heldout", "2", "--third-party", "2", "--long", "2", "--max-tokens", "8"],
                           [r"^  heldout-64 .*lossless 2/2$", r"^  lossless at batch 3: 16/16, 8: 16/16$"]),
    "bench_schedule": (["--concurrency", "1", "--draft-lengths", "1", "--prompts", "2", "--max-tokens", "8",
                        "--repeats", "1", "--requests", "2"],
                       [r"^\| 1 \| \d+ \| \d+ \| \d+ \| K=\d", r"^### SYNTHETIC"]),
    "bench_drafter_quant": (["--prompts", "2", "--calibration-prompts", "2", "--max-tokens", "8"],
                            [r"^(bf16|fp8|nvfp4) .* 2/2$"]),
    "bench_stream_text": (["--lengths", "64,256", "--repeats", "1"],
                          [r"^\| 256 \| streaming \+ stop string \| \d+", r"identical to the whole decode: True$"]),
    "diag_drafter_train_vs_runtime": (["--prompts", "2", "--max-tokens", "8"],
                                      [r"^runtime anchors through the training forward: .*argmax agreement"]),
}


@pytest.mark.parametrize("script", sorted(CASES))
def test_benchmark_script_runs_to_its_report(script):
    arguments, patterns = CASES[script]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(BENCHMARKS / f"{script}.py"), *arguments], capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for pattern in patterns:
        matches = re.findall(pattern, done.stdout, flags=re.MULTILINE)
        assert matches, f"{script}: no line matches {pattern!r} in:\n{done.stdout[-3000:]}"
    if script == "bench_reference_runtime":  # every method's row, each lossless
        assert len(re.findall(CASES[script][1][0], done.stdout, flags=re.MULTILINE)) == 17
    if script == "bench_inflight_batching":  # both runtimes, both batchings, and n-gram in flight, each lossless
        assert len(re.findall(CASES[script][1][0], done.stdout, flags=re.MULTILINE)) == 5
    if script == "bench_drafter_quant":
        assert len(re.findall(CASES[script][1][0], done.stdout, flags=re.MULTILINE)) == 3


def load_bench_step_costs(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_step_costs", BENCHMARKS / "bench_step_costs.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclasses look their module up there
    spec.loader.exec_module(bench)
    return bench


def test_step_costs_byte_floor_reads_the_experts_in_each_storage(monkeypatch):
    """A target step's byte floor counts the experts at the size of the storage read: half the float32 originals'
    from bf16 pairs, fbgemm's float16 copies and AMX tiles, about a quarter from int8 rows. (Round 29's CI failed
    where the start-up timing chose the AMX tiles: the floor took the storage's name for a torch dtype.)"""
    from trtllm_dflash.checkpoints.gpt_oss import load_hf_gpt_oss
    from trtllm_dflash.embedded import pair_paths
    from trtllm_dflash.models.target import GptOssTarget

    bench = load_bench_step_costs(monkeypatch)
    target = GptOssTarget(load_hf_gpt_oss(pair_paths()[0]))
    weights = sum(experts.gate_up_proj.numel() + experts.down_proj.numel()
                  for experts in (layer.mlp.experts for layer in target.hf.model.layers))
    floors, expert_bytes = {}, {}
    for storage in target.expert_storages:
        target.use_expert_storage(storage)
        expert_bytes[storage] = target.expert_bytes()
        floors[storage] = bench.target_bytes(target, 10.0, 1, 100.0)
    assert expert_bytes["float32"] == 4 * weights
    for half in {"bfloat16", "float16", "amx"} & set(floors):
        assert expert_bytes[half] == 2 * weights and floors[half] < floors["float32"]
    assert weights < expert_bytes["int8"] < 1.25 * weights and floors["int8"] < floors["bfloat16"]


def test_step_costs_counts_experts_in_a_run_of_its_own(monkeypatch):
    """`bench_step_costs` counts the experts a step touches with hooks on the routers; a hooked router sends the
    lean forward down its slower hook-aware path, so the hooks must be gone before any timed run (rounds 17-23
    timed the hooked path)."""
    import torch

    from trtllm_dflash.models.random_pair import random_target, tiny_target_config
    from trtllm_dflash.models.layers import hooked
    from trtllm_dflash.models.target import GptOssTarget

    bench = load_bench_step_costs(monkeypatch)
    target = GptOssTarget(random_target(tiny_target_config()))
    touched = bench.ExpertsTouched(target)
    seen_hooked = []

    def run():
        seen_hooked.append(all(hooked(router) for router in touched.routers))
        with torch.inference_mode():
            cache = target.new_cache(1, 8)
            target(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], cache, [])

    touched.count(run)
    assert seen_hooked == [True]
    assert not any(hooked(router) for router in touched.routers)
    assert 1 <= touched.mean(3, 1) <= target.config.num_local_experts
