"""The drafter step's work between its GEMMs as compiled CPU kernels (``cpu_kernel.cpp``), built on first use.

On a small drafter a CPU step is bound by the count of tensor ops torch eager dispatches, so the
drafter's lean path hands each layer's QK-norm + RoPE + block attention, its residual adds with the
next RMSNorm and its SiLU-and-multiply to one call each, and so do the context K/V writes and the greedy
drafts (float32; head_dim a multiple of 16). The file is built with torch's C++ extension loader (a C++
compiler and ninja, which this project's machines have) into a per-user cache, once per source, CPU,
torch and Python version, and takes a fraction of a second to load after that. Where it cannot be built
(no toolchain) or ``TRTLLM_DFLASH_CPU_KERNEL=0`` is set, ``cpu_kernel()`` returns None and the drafter
runs its torch formulation; ``unavailable_reason()`` says why. Their numbers are the torch path's to
float32 rounding (tests/test_draft_block_cpu.py), not bit for bit: drafts need not be exact.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import warnings
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).with_name("cpu_kernel.cpp")
DISABLE_VARIABLE = "TRTLLM_DFLASH_CPU_KERNEL"
_failure: str | None = None


def cpu_flags() -> str:
    """The CPU's feature flags (the build uses -march=native, so a binary must not move to another CPU)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_name() -> str:
    key = [cpu_flags(), torch.__version__, sys.implementation.cache_tag]  # a build serves one CPU, torch and Python
    digest = hashlib.sha256(SOURCE.read_bytes() + "\n".join(key).encode()).hexdigest()
    return f"dflash_draft_block_cpu_{digest[:12]}"


def build_directory() -> Path:
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    directory = root / "trtllm_dflash" / build_name()
    directory.mkdir(parents=True, exist_ok=True)
    return directory


@functools.cache
def cpu_kernel() -> ModuleType | None:
    """The compiled module (the functions the wrappers below call), or None where it is disabled or cannot be
    built."""
    global _failure
    if os.environ.get(DISABLE_VARIABLE, "1") == "0":
        _failure = f"{DISABLE_VARIABLE}=0"
        return None
    try:
        from torch.utils.cpp_extension import load

        directory = build_directory()
        if not (directory / f"{build_name()}.so").is_file():  # the one slow start a machine sees: say so
            print(f"building the compiled CPU draft-step kernels in {directory} (once per machine, about 20 s)",
                  file=sys.stderr, flush=True)
        return load(build_name(), [str(SOURCE)], extra_cflags=["-O3", "-march=native", "-fopenmp-simd"],
                    build_directory=str(directory), verbose=False)
    except Exception as exc:  # a missing compiler or ninja surfaces as RuntimeError, OSError, or a build error
        _failure = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc}"
        warnings.warn(f"the compiled CPU draft-block kernel is unavailable ({_failure}); the drafter runs its "
                      "torch formulation", RuntimeWarning, stacklevel=2)
        return None


def serves(*tensors: torch.Tensor) -> bool:
    """Whether the compiled kernels take these tensors: float32 on the CPU, the kernels built."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and cpu_kernel() is not None


def unavailable_reason() -> str | None:
    """Why `cpu_kernel()` returned None (None while it loads, or before it was asked)."""
    return _failure


def draft_block_attention_cpu(q: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor, ctx_k: torch.Tensor,
                              ctx_v: torch.Tensor, ctx_lens: torch.Tensor, scale: float,
                              sliding_window: int | None = None,
                              prologue: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                              eps: float = 1e-6) -> torch.Tensor:
    """The reference's ``draft_block_attention`` (layout there: q [b*B, Hq, D], k/v_blk [b*B, Hkv, D], arena
    [b, Hkv, S, D]; any strides but the last) through the compiled kernel -> [b*B, Hq * D]. `prologue`:
    (q_norm [D], k_norm [D], cos [b*B, D], sin [b*B, D]) to apply the QK-norm (RMSNorm with `eps`, times
    the weight) and the rotation (`rope.rotate`) to q and k_blk first. Raises where `cpu_kernel()` is None."""
    kernel = cpu_kernel()
    if kernel is None:
        raise RuntimeError(f"the compiled CPU draft-block kernel is unavailable: {unavailable_reason()}")
    q_norm, k_norm, cos, sin = prologue if prologue is not None else (None,) * 4
    return kernel.draft_block_attention(q, k_blk, v_blk, ctx_k, ctx_v, ctx_lens.long(), scale,
                                        -1 if sliding_window is None else sliding_window, q_norm, k_norm, cos, sin,
                                        eps)


def add_rms_norm_cpu(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next RMSNorm in one call: x float32 [..., H], delta float32 or bf16 of x's
    shape, weight float32 with at least H entries (the first H are the norm's: a `doubled_weight` serves)
    -> (x + delta, RMSNorm(x + delta) * weight), float32."""
    return tuple(cpu_kernel().add_rms_norm(x, delta, weight, eps))


def silu_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(gate) * up of gate_up [..., 2I] (gate first; float32 or bf16) -> [..., I], same dtype."""
    return cpu_kernel().silu_mul(gate_up)


def greedy_peak_cpu(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of float32 logits [..., V]: the first index of the maximum (argmax's answer) and the softmax's
    peak probability, in one pass -> (int64 [...], float32 [...])."""
    return tuple(cpu_kernel().greedy_peak(logits))


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of float32 x [..., H] times weight (at least H entries; the first H are read: a `doubled_weight`
    serves)."""
    return cpu_kernel().rms_norm(x, weight, eps)


def write_context_kv_cpu(keys: torch.Tensor, values: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, arena_keys: torch.Tensor, arena_values: torch.Tensor,
                         positions: torch.Tensor | int, eps: float) -> None:
    """Committed tokens' context K/V into the arena, every layer at once: keys / values [b, n, L * Hkv, D]
    (layer-major heads, raw from the context projection), k_norm [L, D], cos / sin [b, n, D], the arena's
    [L, b, Hkv, S, D] tensors (`KVArena.keys` / `values`); each key gets its layer's k_norm and the rotation.
    `positions` [b, n], or for a lone request the int first of n consecutive ones."""
    tensor = None if isinstance(positions, int) else positions
    cpu_kernel().write_context_kv(keys, values, k_norm, cos, sin, arena_keys, arena_values, tensor,
                                  positions if tensor is None else 0, eps)
