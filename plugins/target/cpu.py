"""The gpt-oss target's MoE and attention as compiled CPU calls (``cpu_kernel.cpp``), built on first use
(`plugins/compiled.py`).

On a small target a CPU step is bound by tensor ops and Python, not arithmetic: the MoE's torch formulation
(`models/layers.py` `routed_experts`) takes ~25 ops and a Python loop over routed experts, a layer's
attention ~15 ops and per-step masks. The MoE kernel takes the router's top-k and the experts' float32
weights or their exact bf16 copies; the attention kernel the fused q/k/v projection's output and the layer's
K/V arena. Where ``target_kernels()`` returns None the target runs the torch formulations; the kernels'
numbers are theirs up to float32 summation order (tests/test_target_cpu.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..compiled import CompiledKernel, amx_wanted

KERNEL = CompiledKernel(Path(__file__).with_name("cpu_kernel.cpp"), "dflash_target_cpu",
                        "compiled CPU kernels of the target (MoE, attention)", "the target runs its torch formulations")
LANES = 16  # the kernel's vector width in floats: hidden and intermediate sizes must be multiples


def target_kernels():
    """The compiled module, or None where it is disabled or cannot be built."""
    return KERNEL.module()


TILE = 64  # the MoE kernel's column tile (kVectors x kLanes): int8 experts are stored tile by tile


def tile_widths(columns: int) -> list[int]:
    """The kernel's column tiles over `columns` (a multiple of `LANES`): whole `TILE`s, then `LANES` at a time."""
    return [TILE] * (columns // TILE) + [LANES] * (columns % TILE // LANES)


def tile_major(matrices: torch.Tensor) -> torch.Tensor:
    """[E, rows, columns] -> the same shape holding each matrix tile by tile (`tile_widths`), every tile's rows
    contiguous: the MoE kernel then streams a tile instead of reading a short run every `columns` entries."""
    experts, rows, columns = matrices.shape
    tiles = matrices.split(tile_widths(columns), dim=2)
    return torch.cat([tile.reshape(experts, -1) for tile in tiles], dim=1).view(experts, rows, columns)


def untiled(matrix: torch.Tensor) -> torch.Tensor:
    """One matrix [rows, columns] of `tile_major`'s output in its plain layout."""
    rows, columns = matrix.shape
    widths = tile_widths(columns)
    tiles = matrix.reshape(-1).split([rows * width for width in widths])
    return torch.cat([tile.view(rows, width) for tile, width in zip(tiles, widths)], dim=1)


@dataclass(frozen=True)
class RowInt8:
    """Expert matrices [E, in, out] held exactly as int8 `values` times a power-of-two `scales` [E, in], one per input
    row (`int8_rows`). The MoE kernel multiplies the inputs by the scales, not the weights: x_h s_h is exact, so each
    product (x_h s_h) q_hc is x_h w_hc, and the sums are the float32 originals' bit for bit (but for an input so tiny
    that x_h s_h falls below float32's normal range, some 2^-100 below the sums it joins). A quarter of the float32
    bytes, and a weight vector is widened without a multiply. `values` are stored `tile_major`, so read an expert's
    float32 matrix through `[e]` (the torch path's GEMM, the same numbers). Against round 19's int8 (a scale per
    block of 32 rows and column, multiplied into each weight vector; the plain layout) the routed-experts call took
    0.62-0.83x the time at 1 token and 0.82x at 8, with L2 evicted between calls (round 20)."""

    values: torch.Tensor  # int8 [E, in, out], tile-major
    scales: torch.Tensor  # float32 [E, in]

    def __getitem__(self, expert: int) -> torch.Tensor:
        return untiled(self.values[expert]).float() * self.scales[expert][:, None]


def int8_rows(weight: torch.Tensor) -> RowInt8 | None:
    """Float32 CPU experts [E, in, out] as `RowInt8` where every input row is an int8 times a power of two exactly
    (scale 2^(e - 7) for the row's peak m * 2^e, 0.5 <= m < 1: |values| < 128) and `out` is a multiple of `LANES`,
    else None. MXFP4 experts fit where the block scales of a row's columns lie within a few octaves of each other
    (an MXFP4 value has at most two significant bits): the embedded target's do; elsewhere the runtime reads bf16
    copies instead."""
    weight = weight.detach()
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 3 or weight.shape[2] % LANES:
        return None
    _, exponent = torch.frexp(weight.abs().amax(dim=2))
    scales = torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent - 7)
    values = (weight / scales[:, :, None]).round()
    if values.abs().max() > 127 or not torch.equal(values * scales[:, :, None], weight):
        return None
    return RowInt8(tile_major(values.to(torch.int8)), scales)


def amx_available() -> bool:
    """Whether the kernels run on AMX tiles here (`amx_gemm.h`: built for a CPU with AMX-BF16, the tiles granted,
    not switched off by TRTLLM_DFLASH_AMX=0)."""
    module = target_kernels()
    return module is not None and amx_wanted() and module.amx_available()


AMX_ROWS = 32  # an AMX-tiled matrix's rows (inputs) come in slices of this many


@dataclass(frozen=True)
class AmxTiles:
    """Matrices [..., in, out] held as bf16 AMX tiles (`amx_tiles`; the kernels' `amx_gemm.h` multiplies float32
    inputs by them exactly, split into three bf16 parts). `[e]` gives matrix e in float32, plain (the torch path's)."""

    values: torch.Tensor  # bf16 [..., in, out] holding the tile layout

    def __getitem__(self, expert: int) -> torch.Tensor:
        rows, columns = self.values.shape[-2:]
        tiles = self.values[expert].view(columns // LANES, rows // AMX_ROWS, AMX_ROWS // 2, LANES, 2)
        return tiles.permute(1, 2, 4, 0, 3).reshape(rows, columns).float()


def amx_tiles(weight: torch.Tensor) -> AmxTiles | None:
    """Matrices [..., in, out] (CPU) as `AmxTiles` where bf16 holds every weight exactly (MXFP4 experts, bf16
    checkpoints' dense weights), `in` is a multiple of `AMX_ROWS`, `out` of `LANES` and AMX runs here, else None.
    Tile (column slice j, row slice i) holds, at its row p, rows 2p and 2p + 1 of slice i interleaved per column."""
    weight = weight.detach()
    *lead, rows, columns = weight.shape
    if weight.device.type != "cpu" or rows % AMX_ROWS or columns % LANES or not amx_available():
        return None
    compact = weight.to(torch.bfloat16)
    if not torch.equal(compact.float(), weight.float()):
        return None
    n = len(lead)
    tiles = compact.reshape(*lead, rows // AMX_ROWS, AMX_ROWS // 2, 2, columns // LANES, LANES)
    tiles = tiles.permute(*range(n), n + 3, n, n + 1, n + 4, n + 2)  # column slice, row slice, pair, column, of pair
    return AmxTiles(tiles.contiguous().view(*lead, rows, columns))


@dataclass(frozen=True)
class Bf16Pairs:
    """Matrices [..., in, out] held in bf16 two input rows a word (`bf16_pairs`): word [p, c] holds row 2p's weight in
    its low half and row 2p + 1's in its high half, the layout the kernels widen with one load, a shift and a mask
    (gemm_tiles.h `Bf16Pairs`). `matrix()` gives them back in float32, `[e]` matrix e of a stack."""

    values: torch.Tensor  # int32 [..., in / 2, out]

    def matrix(self) -> torch.Tensor:
        halves = torch.stack([self.values & 0xFFFF, (self.values >> 16) & 0xFFFF], dim=-2)  # [..., in / 2, 2, out]
        return (halves.flatten(-3, -2) << 16).view(torch.float32)

    def __getitem__(self, expert: int) -> torch.Tensor:
        return Bf16Pairs(self.values[expert]).matrix()


def bf16_pairs(weight: torch.Tensor) -> Bf16Pairs | None:
    """CPU matrices [..., in, out] as `Bf16Pairs` where bf16 holds every weight exactly (MXFP4 experts, a bf16
    checkpoint's dense weights) and `in` is even, else None."""
    weight = weight.detach()
    if weight.dim() < 2 or weight.device.type != "cpu" or weight.shape[-2] % 2:
        return None
    compact = weight.to(torch.bfloat16)
    if not torch.equal(compact.float(), weight.float()):
        return None
    halves = compact.view(torch.int16).to(torch.int32) & 0xFFFF
    return Bf16Pairs((halves[..., 0::2, :] | halves[..., 1::2, :] << 16).contiguous())


def moe_serves(x: torch.Tensor, gate_up: object, down: object) -> bool:
    """Whether the MoE kernel takes these: float32 CPU tokens, experts as float32 CPU tensors ([E, H, 2I], [E, I, H];
    not fbgemm's packed copies), both `Bf16Pairs` or both `RowInt8`, H and I multiples of `LANES`, the kernel
    built."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or target_kernels() is None:
        return False
    if isinstance(gate_up, AmxTiles) and isinstance(down, AmxTiles):  # amx_tiles checked the rest
        return x.shape[-1] % AMX_ROWS == 0
    if isinstance(gate_up, RowInt8) and isinstance(down, RowInt8):  # int8_rows made them from float32 CPU experts
        inter = down.values.shape[1]
    elif isinstance(gate_up, Bf16Pairs) and isinstance(down, Bf16Pairs):  # bf16_pairs made them from CPU experts
        inter = 2 * down.values.shape[1]
    elif (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.device.type == "cpu"
          and gate_up.dtype == down.dtype == torch.float32):
        inter = down.shape[1]
    else:
        return False
    return x.shape[-1] % LANES == 0 and inter % LANES == 0


def route_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's router (`GptOssTopKRouter`) on x float32 [n, H]: each token's top_k experts by x @ weight.T + bias,
    largest first, and the softmax of their logits -> (indices int64 [n, k], scores float32 [n, k])."""
    return tuple(target_kernels().route(x.contiguous(), weight.contiguous(), bias.contiguous(), top_k))


ExpertCopy = torch.Tensor | RowInt8 | Bf16Pairs | AmxTiles


def expert_arguments(gate_up: ExpertCopy, down: ExpertCopy
                     ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor | None, torch.Tensor | None], bool]:
    """The MoE kernel's expert arguments from a storage's matrices: (gate_up, down, their int8 rows' scales or Nones,
    whether they are AMX tiles)."""
    scales, tiles = (None, None), isinstance(gate_up, AmxTiles)
    if isinstance(gate_up, RowInt8):
        scales = (gate_up.scales, down.scales)
    if isinstance(gate_up, (RowInt8, Bf16Pairs, AmxTiles)):
        gate_up, down = gate_up.values, down.values
    return gate_up, down, scales, tiles


def routed_experts_cpu(x: torch.Tensor, indices: torch.Tensor, scores: torch.Tensor,
                       gate_up: ExpertCopy, gate_up_bias: torch.Tensor, down: ExpertCopy,
                       down_bias: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """x float32 [n, H], the router's top-k `indices` [n, k] and `scores` [n, k], gate_up [E, H, 2I] (gate and
    up interleaved) and down [E, I, H] (float32, or both `Bf16Pairs`, `RowInt8` or `AmxTiles`), their float32
    biases -> [n, H]: per
    token, the sum over its slots of score x down(swiglu(gate_up(x))), gpt-oss's clamped SwiGLU with `alpha` and
    `limit`."""
    gate_up, down, scales, tiles = expert_arguments(gate_up, down)
    return target_kernels().routed_experts(x.contiguous(), indices.contiguous(), scores.float().contiguous(),
                                       gate_up.contiguous(), gate_up_bias.float().contiguous(), down.contiguous(),
                                       down_bias.float().contiguous(), alpha, limit, *scales, tiles)


@dataclass(frozen=True)
class MoeCall:
    """One layer's router and experts as the compiled MoE takes them, prepared once (`moe_call`): a step's MoE is then
    one call (route and experts), where the two calls and their arguments' checks and conversions took 10-17 us of
    Python a layer, 4-8% of an AR step on a Xeon VM (round 22). The target's weights are frozen after load."""

    router_weight: torch.Tensor
    router_bias: torch.Tensor
    top_k: int
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor
    down: torch.Tensor
    down_bias: torch.Tensor
    alpha: float
    limit: float
    scales: tuple[torch.Tensor | None, torch.Tensor | None]
    tiles: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x float32 [n, H] (contiguous) -> the layer's MoE output [n, H], as `route_cpu` then `routed_experts_cpu`."""
        return target_kernels().moe(x.contiguous(), *self.arguments())

    def arguments(self) -> tuple:
        """The kernel's `moe` arguments after x (`__call__` passes them; `WholeTargetStep` holds them)."""
        return (self.router_weight, self.router_bias, self.top_k, self.gate_up, self.gate_up_bias, self.down,
                self.down_bias, self.alpha, self.limit, *self.scales, self.tiles)


def moe_call(mlp: torch.nn.Module, gate_up: object, down: object) -> MoeCall | None:
    """`MoeCall` for gpt-oss's MLP `mlp` (its router and experts' biases) with the experts read from `gate_up` / `down`
    (any storage `moe_serves` takes for float32 tokens), else None."""
    probe = torch.empty(0, mlp.router.weight.shape[1])
    if not moe_serves(probe, gate_up, down):
        return None
    router, experts = mlp.router, mlp.experts
    gate_up, down, scales, tiles = expert_arguments(gate_up, down)
    frozen = [t.detach().float().contiguous() for t in (router.weight, router.bias, experts.gate_up_proj_bias,
                                                         experts.down_proj_bias)]
    return MoeCall(frozen[0], frozen[1], router.top_k, gate_up.contiguous(), frozen[2], down.contiguous(), frozen[3],
                   experts.alpha, experts.limit, scales, tiles)


def linear_cpu(x: torch.Tensor, weight: torch.Tensor | Bf16Pairs | AmxTiles, bias: torch.Tensor | None
               ) -> torch.Tensor:
    """x float32 [..., in] (contiguous) times weight [in, out] (float32, `Bf16Pairs` or `AmxTiles`) plus bias float32
    [out] -> [..., out], in float32 products and sums; out a multiple of `LANES`."""
    values, tiles = linear_weight(weight)
    return target_kernels().linear(x, values, bias, tiles)


def linear_weight(weight: torch.Tensor | Bf16Pairs | AmxTiles) -> tuple[torch.Tensor, bool]:
    """The kernel's `linear` weight arguments: the tensor and whether it holds AMX tiles."""
    if isinstance(weight, torch.Tensor):
        return weight, False
    return weight.values, isinstance(weight, AmxTiles)


def sink_attention_cpu(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                       values: torch.Tensor, positions: torch.Tensor, sliding_window: int | None,
                       sinks: torch.Tensor | None, scale: float) -> torch.Tensor:
    """A target layer's attention for a step after its fused projection: qkv float32 [b, t, (Hq + 2 Hkv) * D]
    (contiguous), cos / sin [b, t, D] (`Rotary`'s), the layer's arena keys / values [b, Hkv, S, D]
    (`KVArena.k[i]` / `v[i]`), positions int64 [b, t], sinks [Hq] (None: no sink). Writes the step's rotated
    keys and its values at their positions, then attends causally (within `sliding_window`) -> [b, t, Hq * D]."""
    return target_kernels().sink_attention(qkv, cos, sin, keys, values, positions,
                                           -1 if sliding_window is None else sliding_window, sinks, scale)


class WholeTargetStep:
    """The target's decoder layers for a step in one compiled call (`cpu_kernel.cpp` `TargetStep`, built by
    `GptOssTarget.whole_step`): the embedding and RoPE lookups, the first RMSNorm, every layer's attention and MoE
    with their residual adds and norms, over weights held from construction."""

    def __init__(self, step, embedding: torch.Tensor, rotary):
        self.step, self.embedding, self.rotary = step, embedding, rotary  # rotary: the target's `Rotary`

    def __call__(self, tokens: torch.Tensor, cache, positions: torch.Tensor,
                 feature_layers: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens int64 [b, t] at positions int64 [b, t] (their K/V written into the `KVArena` there) -> (final-normed
        hidden states [b, t, H], the feature layers' outputs side by side [b, t, len * H] or None)."""
        rope = self.rotary.table(cache.capacity, torch.float32, tokens.device)  # the arena bounds every position
        return tuple(self.step.step(tokens, self.embedding, rope, cache.k, cache.v, positions, feature_layers))


def attention_serves(x: torch.Tensor, head_dim: int) -> bool:
    """Whether the attention kernel takes a target whose hidden states are like x: float32 on the CPU, head_dim
    a multiple of `LANES`, the kernels built (its projection's output and the arena are contiguous there)."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and head_dim % LANES == 0
            and target_kernels() is not None)


def unavailable_reason() -> str | None:
    """Why `target_kernels()` returned None (None while it loads, or before it was asked)."""
    return KERNEL.unavailable_reason()
