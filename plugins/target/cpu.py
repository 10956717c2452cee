"""The gpt-oss target's MoE and attention as compiled CPU calls (``cpu_kernel.cpp``), built on first use
(`plugins/compiled.py`).

On a small target a CPU step is bound by tensor ops and Python, not arithmetic: the MoE's torch formulation
(`models/target.py` `routed_experts`) takes ~25 ops and a Python loop over routed experts, a layer's
attention ~15 ops and per-step masks. The MoE kernel takes the router's top-k and the experts' float32
weights or their exact bf16 copies; the attention kernel the fused q/k/v projection's output and the layer's
K/V arena. Where ``target_kernels()`` returns None the target runs the torch formulations; the kernels'
numbers are theirs up to float32 summation order (tests/test_target_cpu.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..compiled import CompiledKernel

KERNEL = CompiledKernel(Path(__file__).with_name("cpu_kernel.cpp"), "dflash_target_cpu",
                        "compiled CPU kernels of the target (MoE, attention)", "the target runs its torch formulations")
LANES = 16  # the kernel's vector width in floats: hidden and intermediate sizes must be multiples


def target_kernels():
    """The compiled module, or None where it is disabled or cannot be built."""
    return KERNEL.module()


BLOCK = 32  # input rows sharing a `BlockInt8` scale


@dataclass(frozen=True)
class BlockInt8:
    """Expert matrices [E, in, out] held exactly as int8 `values` times a power-of-two `scales` [E, in / 32, out], one
    per block of 32 input rows and output column (`int8_blocks`). MXFP4 experts always fit: a value of
    {0, 0.5, 1, 1.5, 2, 3, 4, 6} times its block's power of two is an integer of at most 96 times a smaller one. Half
    the bytes of a bf16 copy and one more multiply a weight vector in the MoE kernel; `[e]` gives expert e's float32
    matrix (the torch path's GEMM, the same numbers)."""

    values: torch.Tensor  # int8 [E, in, out]
    scales: torch.Tensor  # float32 [E, in / BLOCK, out]

    def __getitem__(self, expert: int) -> torch.Tensor:
        return (self.values[expert].view(-1, BLOCK, self.values.shape[-1]).float()
                * self.scales[expert][:, None]).view(self.values.shape[1:])


def int8_blocks(weight: torch.Tensor) -> BlockInt8 | None:
    """Float32 CPU experts [E, in, out] as `BlockInt8` where every block of 32 input rows of a column is an int8 times
    a power of two exactly (scale 2^(e - 7) for the block's peak m * 2^e, 0.5 <= m < 1: |values| < 128), else None."""
    weight = weight.detach()
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 3 or weight.shape[1] % BLOCK:
        return None
    experts, inputs, outputs = weight.shape
    blocks = weight.view(experts, inputs // BLOCK, BLOCK, outputs)
    _, exponent = torch.frexp(blocks.abs().amax(dim=2))
    scales = torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent - 7)
    values = (blocks / scales[:, :, None]).round()
    if values.abs().max() > 127 or not torch.equal(values * scales[:, :, None], blocks):
        return None
    return BlockInt8(values.to(torch.int8).view(experts, inputs, outputs), scales)


def moe_serves(x: torch.Tensor, gate_up: object, down: object) -> bool:
    """Whether the MoE kernel takes these: float32 CPU tokens, experts as float32 or bf16 CPU tensors alike
    ([E, H, 2I], [E, I, H]; not fbgemm's packed copies) or both `BlockInt8`, H and I multiples of `LANES`, the
    kernel built."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or target_kernels() is None:
        return False
    if isinstance(gate_up, BlockInt8) and isinstance(down, BlockInt8):
        return True  # int8_blocks made them from float32 CPU experts in blocks of 32 rows
    return (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.device.type == "cpu"
            and gate_up.dtype == down.dtype and gate_up.dtype in (torch.float32, torch.bfloat16)
            and x.shape[-1] % LANES == 0 and down.shape[1] % LANES == 0)


def route_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's router (`GptOssTopKRouter`) on x float32 [n, H]: each token's top_k experts by x @ weight.T + bias,
    largest first, and the softmax of their logits -> (indices int64 [n, k], scores float32 [n, k])."""
    return tuple(target_kernels().route(x.contiguous(), weight.contiguous(), bias.contiguous(), top_k))


def routed_experts_cpu(x: torch.Tensor, indices: torch.Tensor, scores: torch.Tensor,
                       gate_up: torch.Tensor | BlockInt8, gate_up_bias: torch.Tensor, down: torch.Tensor | BlockInt8,
                       down_bias: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """x float32 [n, H], the router's top-k `indices` [n, k] and `scores` [n, k], gate_up [E, H, 2I] (gate and
    up interleaved) and down [E, I, H] (float32, bf16, or both `BlockInt8`), their float32 biases -> [n, H]: per
    token, the sum over its slots of score x down(swiglu(gate_up(x))), gpt-oss's clamped SwiGLU with `alpha` and
    `limit`."""
    if isinstance(gate_up, BlockInt8):
        scales = (gate_up.scales, down.scales)
        gate_up, down = gate_up.values, down.values
    else:
        scales = (None, None)
    return target_kernels().routed_experts(x.contiguous(), indices.contiguous(), scores.float().contiguous(),
                                       gate_up.contiguous(), gate_up_bias.float().contiguous(), down.contiguous(),
                                       down_bias.float().contiguous(), alpha, limit, *scales)


def linear_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x float32 [..., in] (contiguous) times weight [in, out] (float32, or a bf16 copy that holds it exactly) plus
    bias float32 [out] -> [..., out], in float32 products and sums; out a multiple of `LANES`."""
    return target_kernels().linear(x, weight, bias)


def sink_attention_cpu(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                       values: torch.Tensor, positions: torch.Tensor, sliding_window: int | None,
                       sinks: torch.Tensor | None, scale: float) -> torch.Tensor:
    """A target layer's attention for a step after its fused projection: qkv float32 [b, t, (Hq + 2 Hkv) * D]
    (contiguous), cos / sin [b, t, D] (`Rotary`'s), the layer's arena keys / values [b, Hkv, S, D]
    (`KVArena.k[i]` / `v[i]`), positions int64 [b, t], sinks [Hq] (None: no sink). Writes the step's rotated
    keys and its values at their positions, then attends causally (within `sliding_window`) -> [b, t, Hq * D]."""
    return target_kernels().sink_attention(qkv, cos, sin, keys, values, positions,
                                           -1 if sliding_window is None else sliding_window, sinks, scale)


def attention_serves(x: torch.Tensor, head_dim: int) -> bool:
    """Whether the attention kernel takes a target whose hidden states are like x: float32 on the CPU, head_dim
    a multiple of `LANES`, the kernels built (its projection's output and the arena are contiguous there)."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and head_dim % LANES == 0
            and target_kernels() is not None)


def unavailable_reason() -> str | None:
    """Why `target_kernels()` returned None (None while it loads, or before it was asked)."""
    return KERNEL.unavailable_reason()
