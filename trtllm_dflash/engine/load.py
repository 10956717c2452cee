"""Running an engine directory: the reference runtime or TensorRT-LLM, behind one interface.

Quantized checkpoints (any `--quant` recipe) are dequantized on load by the checkpoint loaders, so
the reference runtime can run (and check) every engine TensorRT-LLM would.
"""

from __future__ import annotations

import torch

from ..checkpoints.gpt_oss import load_hf_gpt_oss
from ..models.drafter import load_drafter
from ..models.linear import drafter_gemm_dtype
from ..models.target import GptOssTarget
from ..runtime.draft_length import CostTables, adaptive_draft_length, measure_step_costs
from ..runtime.interface import DRAFT_METHODS, Runtime, choose_backend
from ..runtime.proposers import (DEFAULT_SA_THRESHOLD, DFlashProposer, NGramProposer,
                                 SuffixDFlashProposer, default_sa_max_drafts)
from ..runtime.reference import ReferenceRuntime
from ..runtime.tuning import choose_expert_storage
from ..errors import InputError
from .manifest import Engine
from .trtllm_versions import engine_requirements


def engine_speculation(engine: Engine) -> tuple[int | None, dict[int, int] | None]:
    """(verify block size, draft_len_schedule) the engine's options ask for."""
    spec = engine.llm_api_options().speculative_config
    if spec is None:
        return None, None
    return spec.max_draft_len + 1, spec.draft_len_schedule


def reference_runtime(engine: Engine, device: torch.device, dtype: torch.dtype,
                      draft_method: str | None = "dflash-sa", inflight: bool = True,
                      draft_length: str = "fixed") -> ReferenceRuntime:
    """The engine on the reference runtime with `draft_method` (`DRAFT_METHODS`; None: the target alone, the
    autoregressive baseline): dflash-sa (DFlash with suffix-automaton drafts, at the engine's threshold and longest
    suffix draft, by default `default_sa_max_drafts` of its verify block), dflash, or ngram (prompt lookup, a block
    of drafts every step); the engine's max_draft_len and schedule; the drafter's GEMMs and the experts' storage as
    `dflash-run`'s --drafter-gemm-dtype auto and --expert-dtype auto (timed at batch 1). It serves requests, so by
    default it batches in flight (a finished request's row goes to the next one at the next step).
    `draft_length` "adaptive" (dflash-sa and dflash): `dflash-run`'s adaptive policy, priced by step costs measured
    here at 1, 2, 4, ... rows up to the engine's max batch size, at most 64 (`CostTables`), each step by its live
    rows'."""
    if draft_method is not None and draft_method not in DRAFT_METHODS:
        raise InputError(f"expected one of {', '.join(DRAFT_METHODS)}, got {draft_method!r}.", field="draft_method")
    if draft_length == "adaptive" and draft_method not in ("dflash-sa", "dflash"):
        raise InputError(f"the adaptive draft length sizes the drafts of dflash-sa and dflash, not of {draft_method}.",
                         field="draft_length")
    target = GptOssTarget(load_hf_gpt_oss(engine.target_dir, device, dtype))
    block, schedule = engine_speculation(engine)
    drafted = draft_method is not None
    # the baseline only takes one-token steps: time the storages on those (AMX tiles win verifies, lose AR steps here)
    choose_expert_storage(target, "auto", 1, (block or 8) if drafted else 1)
    if not drafted:
        return ReferenceRuntime(target, None, inflight=inflight)
    drafter = load_drafter(engine.drafter_dir, device, dtype)
    block = block or drafter.config.block_size
    if draft_method == "ngram":
        return ReferenceRuntime(target, NGramProposer(num_drafts=block - 1), draft_len_schedule=schedule,
                                inflight=inflight)
    matmul_dtype = drafter_gemm_dtype("auto", dtype, device)
    longest = (engine.sa_max_drafts or default_sa_max_drafts(block)) if draft_method == "dflash-sa" else None
    policy, tables = None, None
    if draft_length == "adaptive":
        # at most 64 rows: a GPU profile's max_batch_size (up to 720) would keep a CPU start-up timing for minutes;
        # a larger live batch is priced by the largest table
        most_rows = min(engine.llm_api_options().max_batch_size or 8, 64)
        sizes = [1 << i for i in range(most_rows.bit_length())]  # 1, 2, 4, ... <= most_rows
        tables = CostTables({rows: measure_step_costs(
            target, lambda: DFlashProposer(drafter, target, block, matmul_dtype=matmul_dtype), rows, block - 1,
            suffix_most=longest) for rows in sizes})
        policy = adaptive_draft_length(tables.for_rows(1))
    if draft_method == "dflash":
        proposer = DFlashProposer(drafter, target, block, policy=policy, matmul_dtype=matmul_dtype,
                                  cost_tables=tables)
    else:
        proposer = SuffixDFlashProposer(DFlashProposer(drafter, target, block, matmul_dtype=matmul_dtype),
                                        engine.sa_threshold or DEFAULT_SA_THRESHOLD, policy=policy,
                                        max_suffix_drafts=longest, cost_tables=tables)
    return ReferenceRuntime(target, proposer, draft_len_schedule=schedule, inflight=inflight)


def engine_backend(engine: Engine, requested: str) -> tuple[str, str]:
    """-> (backend, why): `choose_backend`, except that an engine only the reference runtime can run
    (a quantized drafter, see trtllm_versions) makes auto pick the reference runtime and refuses trtllm."""
    chosen, reason = choose_backend(requested)
    why = engine_requirements(engine.manifest).get("reference_only")
    if chosen != "trtllm" or not why:
        return chosen, reason
    if requested == "trtllm":
        raise InputError(f"this engine runs on the reference runtime only: {why}", path=engine.root / "manifest.json",
                         field="--backend")
    return "reference", "the engine is reference-only (quantized drafter)"


def engine_runtime(engine: Engine, backend: str, device: torch.device, dtype: torch.dtype,
                   inflight: bool = True, draft_length: str = "fixed",
                   draft_method: str = "dflash-sa") -> tuple[Runtime, str]:
    """-> (runtime, why this backend): TensorRT-LLM where it is installed with a supported GPU and
    the engine allows it (it runs DFlash: `draft_method`, `inflight` and `draft_length` are the reference
    runtime's)."""
    chosen, reason = engine_backend(engine, backend)
    if chosen == "trtllm":
        from ..runtime.trtllm import TrtllmRuntime

        return TrtllmRuntime(engine.root), reason
    return reference_runtime(engine, device, dtype, draft_method, inflight, draft_length), reason
