"""gpt-oss's routed experts as one compiled CPU call (``cpu_kernel.cpp``), built on first use (`plugins/compiled.py`).

On a small target the MoE is the largest part of a CPU step, and what it costs is the ~25 tensor ops and
the Python loop over routed experts of its torch formulation (`models/target.py` `routed_experts`), not
arithmetic. The kernel takes the router's top-k and the experts' float32 weights or their exact bf16 copies.
Where ``moe_kernel()`` returns None the target runs the torch formulation; its numbers are the torch
formulation's up to float32 summation order (tests/test_moe_cpu.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..compiled import CompiledKernel

KERNEL = CompiledKernel(Path(__file__).with_name("cpu_kernel.cpp"), "dflash_moe_cpu", "compiled CPU MoE kernel",
                        "the target's MoE runs its torch formulation")
LANES = 16  # the kernel's vector width in floats: hidden and intermediate sizes must be multiples


def moe_kernel():
    """The compiled module, or None where it is disabled or cannot be built."""
    return KERNEL.module()


def serves(x: torch.Tensor, gate_up: object, down: object) -> bool:
    """Whether the kernel takes these: float32 CPU tokens, experts as float32 or bf16 CPU tensors alike
    ([E, H, 2I], [E, I, H]; not fbgemm's packed copies), H and I multiples of `LANES`, the kernel built."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and isinstance(gate_up, torch.Tensor)
            and isinstance(down, torch.Tensor) and gate_up.device.type == "cpu" and gate_up.dtype == down.dtype
            and gate_up.dtype in (torch.float32, torch.bfloat16)
            and x.shape[-1] % LANES == 0 and down.shape[1] % LANES == 0 and moe_kernel() is not None)


def routed_experts_cpu(x: torch.Tensor, indices: torch.Tensor, scores: torch.Tensor, gate_up: torch.Tensor,
                       gate_up_bias: torch.Tensor, down: torch.Tensor, down_bias: torch.Tensor, alpha: float,
                       limit: float) -> torch.Tensor:
    """x float32 [n, H], the router's top-k `indices` [n, k] and `scores` [n, k], gate_up [E, H, 2I] (gate and
    up interleaved) and down [E, I, H] (float32 or bf16), their float32 biases -> [n, H]: per token, the sum
    over its slots of score x down(swiglu(gate_up(x))), gpt-oss's clamped SwiGLU with `alpha` and `limit`."""
    return moe_kernel().routed_experts(x.contiguous(), indices.contiguous(), scores.float().contiguous(),
                                       gate_up.contiguous(), gate_up_bias.float().contiguous(), down.contiguous(),
                                       down_bias.float().contiguous(), alpha, limit)


def unavailable_reason() -> str | None:
    """Why `moe_kernel()` returned None (None while it loads, or before it was asked)."""
    return KERNEL.unavailable_reason()
