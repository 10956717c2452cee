"""One small interface for every runtime backend, and the choice between them.

A runtime generates for a list of tokenized prompts, streams committed tokens through an optional
callback, and returns per-request `GenerationResult`s with `RequestStats`, whichever engine ran it,
so outputs and statistics are comparable across backends.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from typing import Protocol

from ..errors import InputError
from .sampling import SamplingParams
from .stats import GenerationResult

OnTokens = Callable[[int, list[int]], None]  # (request index, newly committed tokens)
Cancelled = Callable[[int], bool]  # (request index) -> stop generating for it now
Admit = Callable[[int], Sequence[Sequence[int]]]  # (free batch rows) -> at most that many prompts to join now

BACKENDS = ("auto", "trtllm", "reference")
DRAFT_METHODS = ("dflash-sa", "dflash", "ngram")  # the reference runtime's; the first is its default


def default_draft_length(method: str) -> str:
    """The reference runtime's draft length for `method` unless asked otherwise: adaptive for dflash-sa and dflash
    (faster at every batch size measured, docs/benchmarks.md), fixed for n-gram (no drafter costs to adapt to)."""
    return "fixed" if method == "ngram" else "adaptive"


class Runtime(Protocol):
    backend: str

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, batch_size: int = 1,
                 on_tokens: OnTokens | None = None) -> list[GenerationResult]: ...


def check_request(prompts: Sequence[Sequence[int]], batch_size: int, vocab_size: int | None = None,
                  max_tokens: int = 0, max_positions: int | None = None) -> None:
    """What every backend refuses before generating: a batch size below 1, empty prompts, ids
    outside the vocabulary, and prompt + max_tokens beyond the target's positions (the last two
    when the backend knows the target; the reference runtime sizes its K/V cache from them)."""
    if batch_size < 1:
        raise InputError(f"expected at least 1, got {batch_size}.", field="batch_size")
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise InputError(f"prompt {i} is empty; at least one token is needed.", field="prompt")
        if vocab_size is not None and (max(prompt) >= vocab_size or min(prompt) < 0):
            raise InputError(f"prompt {i} has token ids outside [0, {vocab_size}).", field="prompt")
        if max_positions is not None and len(prompt) + max_tokens > max_positions:
            raise InputError(f"prompt {i} ({len(prompt)} tokens) plus max_tokens {max_tokens} exceeds the target's "
                             f"max_position_embeddings ({max_positions}).", field="max_tokens")


def cuda_device_capability() -> tuple[int, int] | None:
    import torch

    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def choose_backend(requested: str, trtllm_importable: bool | None = None,
                   capability: tuple[int, int] | None | str = "probe") -> tuple[str, str]:
    """-> (backend, reason). auto = TensorRT-LLM when it is importable and a supported GPU (SM90+:
    Hopper or Blackwell, where TensorRT-LLM runs gpt-oss) is present, else the reference runtime."""
    if requested not in BACKENDS:
        raise InputError(f"expected one of {', '.join(BACKENDS)}, got {requested!r}.", field="--backend")
    if requested == "reference":
        return "reference", "asked for"
    if trtllm_importable is None:
        trtllm_importable = importlib.util.find_spec("tensorrt_llm") is not None
    if capability == "probe":
        capability = cuda_device_capability()
    if requested == "trtllm":
        return "trtllm", "asked for"
    if not trtllm_importable:
        return "reference", "tensorrt_llm is not installed"
    if capability is None:
        return "reference", "no CUDA GPU"
    if capability < (9, 0):
        return "reference", f"GPU compute capability {capability[0]}.{capability[1]} < 9.0"
    return "trtllm", f"tensorrt_llm and an SM{capability[0]}{capability[1]} GPU are present"
