"""The drafter step's work between its GEMMs as compiled CPU kernels (``cpu_kernel.cpp``), built on first use.

On a small drafter a CPU step is bound by the count of tensor ops torch eager dispatches, so the
drafter's lean path hands each layer's QK-norm + RoPE + block attention, its residual adds with the
next RMSNorm and its SiLU-and-multiply to one call each, and so do the context K/V writes and the greedy
drafts (float32; head_dim a multiple of 16). How the source is built and when it is not: `plugins/compiled.py`;
where ``cpu_kernel()`` returns None the drafter runs its torch formulation. Their numbers are the torch path's
to float32 rounding (tests/test_draft_block_cpu.py), not bit for bit: drafts need not be exact. Where every GEMM of
the drafter is the module's bf16 or int8 one, `WholeDraftStep` runs a drafter step, LM head included, in one call.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..compiled import DISABLE_VARIABLE, CompiledKernel, amx_wanted

KERNEL = CompiledKernel(Path(__file__).with_name("cpu_kernel.cpp"), "dflash_draft_block_cpu",
                        "compiled CPU draft-step kernels", "the drafter runs its torch formulation",
                        on_load=lambda module: module.set_int8_tiles(amx_wanted()))


def cpu_kernel():
    """The compiled module (the functions the wrappers below call), or None where it is disabled or cannot be
    built."""
    return KERNEL.module()


def serves(*tensors: torch.Tensor) -> bool:
    """Whether the compiled kernels take these tensors: float32 on the CPU, the kernels built."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and cpu_kernel() is not None


def unavailable_reason() -> str | None:
    """Why `cpu_kernel()` returned None (None while it loads, or before it was asked)."""
    return KERNEL.unavailable_reason()


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


def greedy_verify_cpu(logits: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy accept rule on the verify's float32 logits [b, K + 1, V] and drafts int64 [b, K] (each row
    contiguous: a verify block's view [:, 1:] serves) in one pass that stops at each request's first mismatch ->
    (num_accepted int64 [b], bonus int64 [b]), `accept.greedy_accept`'s answer on the logits' argmax."""
    return tuple(cpu_kernel().greedy_verify(logits.contiguous(), drafts))


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


DOT_GROUP = 16  # output columns per packed group: the output width must be a multiple
DOT_INPUT_MULTIPLE = 32  # the input width must be a multiple
DOT_DTYPES = (torch.bfloat16, torch.int8)  # the products the dot GEMM has


def dot_kernel(dtype: torch.dtype = torch.bfloat16):
    """The compiled module where it has the GEMM with `dtype` products (`dot_gemm.h`: bf16 on a CPU with
    AVX512-BF16, or through FMAs on one with AVX2 and FMA; int8 on one with AVX512-VNNI, or through `vpmaddubsw` on
    one with AVX2; the source built), else None. (Built with -march=native, the module has a GEMM exactly where the CPU
    has its instructions.)"""
    module = cpu_kernel()
    if module is None or dtype not in DOT_DTYPES:
        return None
    return module if (module.dot_available() if dtype == torch.bfloat16 else module.dot_int8_available()) else None


def dot_serves(weight: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether `dot_linear_cpu` takes a GEMM over `weight` [out, in] with `dtype` products: a 2-D CPU tensor, out a
    multiple of `DOT_GROUP`, in of `DOT_INPUT_MULTIPLE`, the kernel running here."""
    return (weight.dim() == 2 and weight.device.type == "cpu" and weight.shape[0] % DOT_GROUP == 0
            and weight.shape[1] % DOT_INPUT_MULTIPLE == 0 and dot_kernel(dtype) is not None)


def dot_pack(weight: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor | None]:
    """W [out, in] -> (its copy packed as `dot_linear_cpu` reads it, the columns' scales or None), each group of 16
    output columns' words of inputs one after another (`dot_gemm.h`):
    - bf16: W rounded to bf16 as [out / 16, in / 2, 16, 2]; no scales;
    - int8: each output column quantized symmetrically, q = round(W / s) in [-127, 127] with s = max |W| / 127 (float32
      [out]), stored as q + 128 in uint8 [out / 16, in / 4, 16, 4] (the instruction's unsigned operand)."""
    out, inputs = weight.shape
    weight = weight.detach().float()
    if dtype == torch.bfloat16:
        words, scales = weight.to(torch.bfloat16), None
    else:
        scales = (weight.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        words = ((weight / scales[:, None]).round().clamp(-127, 127) + 128).to(torch.uint8)
    per_word = 2 if dtype == torch.bfloat16 else 4
    grouped = words.view(out // DOT_GROUP, DOT_GROUP, inputs // per_word, per_word)
    return grouped.transpose(1, 2).contiguous(), scales


def dot_linear_cpu(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                   scales: torch.Tensor | None = None) -> torch.Tensor:
    """x float32 [..., in] @ W.T + bias (float32 [out] or None) from W's `dot_pack` (the packed weight and its scales)
    -> float32 [..., out]. bf16: x rounded to bf16, float32 products and sums (AVX512-BF16). int8: each row of x
    quantized symmetrically to `int8_input_levels()` levels a side with its own scale (max |x| / levels), int32
    products and sums, then both scales. Where `dot_serves` said so: a GEMM's hot path, so it asks nothing again."""
    return KERNEL.module().dot_linear(x.contiguous(), packed, bias, scales)


def int8_input_levels() -> int:
    """How finely the int8 GEMM quantizes an input row: to [-levels, levels], 127 with AVX512-VNNI, 63 on AVX2 (where
    `vpmaddubsw`'s 16-bit sums of two products would saturate past it)."""
    return int(dot_kernel(torch.int8).dot_int8_input_levels())


class WholeDraftStep:
    """A drafter step in one compiled call (`cpu_kernel.cpp` `DraftStep`, built by `DFlashDrafter.whole_step`): the
    committed tokens' context K/V, the block through every layer, the draft logits and, when greedy, the drafts."""

    def __init__(self, step, embedding: torch.Tensor, rope: torch.Tensor):
        self.step, self.embedding, self.rope = step, embedding, rope  # rope: `Rotary.table`, covering the arena

    def __call__(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor | int, cache,
                 context_lens: torch.Tensor, greedy: bool) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """tokens [b, B] (anchor, mask ids), features [b, n, F] at arena `positions` [b, n] (or a lone request's int
        first position), the `KVArena`, context_lens [b] counting them -> logits [b, B - 1, V] and, when `greedy`,
        (the verify block [b, B]: the anchors, then the drafts `greedy_peak_cpu` gives; the drafts' softmax peak)."""
        out = self.step.step(tokens, self.embedding, features, *arena_positions(positions), cache.keys, cache.values,
                             context_lens, self.rope, greedy)
        return out[0], (out[1], out[2]) if greedy else None

    def write(self, features: torch.Tensor, positions: torch.Tensor | int, cache) -> None:
        """Only the committed tokens' context K/V, as `__call__` writes them (a step whose drafts come from elsewhere)."""
        self.step.write(features, *arena_positions(positions), cache.keys, cache.values, self.rope)


def arena_positions(positions: torch.Tensor | int) -> tuple[torch.Tensor | None, int]:
    """`DraftStep`'s two ways of placing committed rows: positions [b, n], or (None, a lone request's first one)."""
    return (None, positions) if isinstance(positions, int) else (positions, 0)


class ExactGreedyHead:
    """The target's greedy verify through its LM head's int8 copy with float32 argmaxes (`greedy_head.h`): each
    argmax is the float32 GEMM's, recomputed in float32 for the few outputs the int8 logits and their error bound
    leave in doubt (the bound is for the build's `int8_input_levels()`). Built where `dot_serves(weight,
    torch.int8)`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight = weight.detach().float().contiguous()  # the head itself where it is float32 already
        self.packed, self.scales = dot_pack(self.weight, torch.int8)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.abs_sum = self.weight.abs().sum(dim=1, dtype=torch.float64).float()  # no float64 copy of the head
        self.recomputed = 0  # float32 logits recomputed, over all calls (how often the bound leaves a doubt)

    def __call__(self, hidden: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden float32 [b, K + 1, H] (final-normed), drafts int64 [b, K] (each row contiguous, as in
        `greedy_verify_cpu`) -> (num_accepted [b], bonus [b]),
        `accept.greedy_accept`'s answer on the argmax of the float32 logits."""
        accepted, bonus, recomputed = KERNEL.module().exact_greedy_verify(
            hidden.contiguous(), drafts, self.weight, self.packed, self.scales, self.bias, self.abs_sum)
        self.recomputed += recomputed
        return accepted, bonus
