"""The lean forward's building blocks, shared by the target adapter (`target.py`) and the drafter: gpt-oss
attention with sink logits (plain, and as one fused CPU kernel), RMSNorm with fewer kernels, the MoE that multiplies only
the experts its tokens route to, and the check for forward hooks that a lean path must honour. Plain functions over
tensors and the modules whose weights they read."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.nn import functional as F

from ..plugins.draft_block import cpu as draft_cpu
from ..plugins.target import cpu as target_cpu
from .linear import cast, exact_half, half_gemm


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   sinks: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Grouped-query attention with an optional learned sink logit per query head.

    q [b, Hq, t, D]; k/v [b, Hkv, S, D]; mask [b, t, S] bool (True = visible; None: all); sinks [Hq] or None.
    The sink acts as one extra logit column with no value vector (gpt-oss). Returns [b, t, Hq*D].
    The plain formulation: used off CPU, in training, and as the reference for `fused_attention`.
    """
    b, hq, t, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    rows = hq // hkv * t
    # A KV head's query heads go side by side as extra rows, so K/V are read where they lie (a cache
    # slice) instead of being broadcast over the group, which copied the whole context every step.
    scores = (q.reshape(b, hkv, rows, d) @ k.transpose(-1, -2)).float() * scale  # [b, Hkv, G*t, S]
    scores = scores.view(b, hkv, hq // hkv, t, length)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, hkv, hq // hkv, 1, 1).expand(b, -1, -1, t, 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    out = probs.to(v.dtype).reshape(b, hkv, rows, length) @ v  # [b, Hkv, G*t, D]
    return out.reshape(b, hq, t, d).transpose(1, 2).reshape(b, t, hq * d)


def attention_bias(visible: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """visible [b, t, S] bool -> additive mask [b, 1, groups * t, S] (0 or -inf) in the layout of
    `fused_attention`'s rows (a KV head's `groups` query heads stacked); built once per step."""
    b, t, length = visible.shape
    bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))
    return bias[:, None].expand(b, groups, t, length).reshape(b, 1, groups * t, length)


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                    sinks: torch.Tensor | None, scale: float) -> torch.Tensor:
    """`sink_attention` as one fused CPU kernel: q [b, Hq, t, D], k/v [b, Hkv, S, D], `bias` from
    `attention_bias` (None: every key visible), sinks [Hkv, G, 1] float32 or None -> [b, t, Hq*D].

    The kernel returns each row's log-sum-exp, and a sink only rescales a row:
    softmax over [scores, sink] = softmax(scores) * Z / (Z + e^sink) = ... * sigmoid(lse - sink).
    """
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.reshape(b, hkv, hq // hkv * t, d), k, v, attn_mask=bias, scale=scale)
    if sinks is not None:
        keep = torch.sigmoid(lse.view(b, hkv, hq // hkv, t) - sinks)
        out = out.view(b, hkv, hq // hkv, t, d) * cast(keep[..., None], out.dtype)
    return out.reshape(b, hq, t, d).transpose(1, 2).reshape(b, t, hq * d)


def causal_mask(positions: torch.Tensor, kv_len: int, window: int | None) -> torch.Tensor:
    """positions [b, t] -> [b, t, kv_len]: key p visible iff p <= query (and p > query - window)."""
    keys = torch.arange(kv_len, device=positions.device)
    query = positions[:, :, None]
    mask = keys <= query
    if window is not None:
        mask &= keys > query - window
    return mask


def normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in float32, cast back (the RMSNorm without its weight)."""
    return F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def lean_rms_norm(x: torch.Tensor, doubled: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The inference path's RMSNorm of x over its last dim, times the weight w whose `doubled` copy
    [w, w] is given (None: unscaled). For float32 on CPU it is one layer_norm over [x, -x], whose mean
    is 0 and whose variance is mean(x^2): 3 kernels where torch 2.13 decomposes F.rms_norm into 10 on
    CPU (nine norms a step of the drafter or the target); the same values to float32 rounding (~3e-7
    relative). Elsewhere the Qwen3 formulation (`RMSNorm`)."""
    d = x.shape[-1]
    if x.dtype == torch.float32 and x.device.type == "cpu":
        return F.layer_norm(torch.cat([x, -x], dim=-1), (2 * d,), doubled, None, eps)[..., :d]
    y = normalized(x, eps)
    return y if doubled is None else doubled[:d] * y


def doubled_weight(norm: nn.Module) -> torch.Tensor:
    """An RMSNorm's weight w as the [w, w] that `lean_rms_norm` takes (a copy)."""
    return norm.weight.detach().repeat(2)


def rms_norm(x: torch.Tensor, norm: nn.Module, doubled: torch.Tensor) -> torch.Tensor:
    """transformers' GptOssRMSNorm (float32 math, weight applied before the cast back); on a float32 CPU input,
    `lean_rms_norm` over `norm`'s `doubled_weight` (the same values to float32 rounding, a third of the
    kernels: 5% off an AR step on an AVX512 AMD EPYC VM, round 13)."""
    if x.dtype == torch.float32 and x.device.type == "cpu":
        return lean_rms_norm(x, doubled, norm.variance_epsilon)
    return cast(F.rms_norm(cast(x, torch.float32), norm.weight.shape, cast(norm.weight, torch.float32),
                           norm.variance_epsilon), x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, norm: nn.Module, doubled: torch.Tensor,
                 fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add x + delta and its `rms_norm`; `fused` (the compiled CPU kernel serves x's float32 CPU
    stream, `plugins/draft_block/cpu.py`): one call of it where both are contiguous, the same values to float32
    rounding, in place of the add and the norm's three kernels."""
    if fused and x.is_contiguous() and delta.is_contiguous():
        total, normed = draft_cpu.add_rms_norm_cpu(x, delta, doubled, norm.variance_epsilon)
        return total, normed
    x = x + delta
    return x, rms_norm(x, norm, doubled)


# [E, in, out], or per expert fbgemm's packed [out, in] (`half_copies`), or exact copies (`target_cpu.ExpertCopy`)
ExpertMatrices = torch.Tensor | list | target_cpu.ExpertCopy


def stored_bytes(matrices: ExpertMatrices, weights: int) -> int:
    """The bytes `matrices`, a copy of `weights` weights, take: a tensor's, an exact copy's tensors' (values and any
    scales), and 2 a weight for fbgemm's packed float16 copies, whose buffers torch does not expose."""
    if isinstance(matrices, torch.Tensor):
        return matrices.nbytes
    if isinstance(matrices, list):
        return 2 * weights
    return sum(getattr(matrices, field.name).nbytes for field in dataclasses.fields(matrices))


def routed_experts(x: torch.Tensor, mlp: nn.Module, gate_up_proj: ExpertMatrices | None = None,
                   down_proj: ExpertMatrices | None = None, compiled: bool = False) -> torch.Tensor:
    """transformers' GptOssMLP on tokens x [n, H]: the same router, the same grouped formulation (rows
    sorted by expert, biases and routing weights applied alike, the top-k outputs summed in order),
    hence the same numbers, but each GEMM covers only an expert that some token routes to. On CPU
    transformers' grouped_mm multiplies every expert (empty groups included) with extra ops per call.

    `gate_up_proj` / `down_proj`: the experts' weights in another storage (`expert_gemm`). `compiled`: the router
    and the experts as two calls of the compiled CPU kernels where they take these weights (`plugins/target/cpu.py`:
    float32 or bf16 tensors, not fbgemm's copies; a hooked router is called as it is), the same numbers up to
    float32 summation order."""
    experts = mlp.experts
    gate_up_proj = experts.gate_up_proj if gate_up_proj is None else gate_up_proj
    down_proj = experts.down_proj if down_proj is None else down_proj
    if compiled and target_cpu.moe_serves(x, gate_up_proj, down_proj):
        router = mlp.router
        if hooked(router):
            _, scores, indices = router(x)
        else:
            indices, scores = target_cpu.route_cpu(x, router.weight, router.bias, router.top_k)
        return target_cpu.routed_experts_cpu(x, indices, scores, gate_up_proj, experts.gate_up_proj_bias, down_proj,
                                          experts.down_proj_bias, experts.alpha, experts.limit)
    _, scores, indices = mlp.router(x)
    top_k = indices.shape[1]
    expert_ids, order = torch.sort(indices.reshape(-1))
    rows = x[order // top_k]
    counts = torch.bincount(expert_ids, minlength=experts.num_experts).tolist()
    spans, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            spans.append((expert, start, start + count))
            start += count
    gate_up = expert_rows(rows, gate_up_proj, spans)
    gate_up += experts.gate_up_proj_bias[expert_ids]
    act = experts._apply_gate(gate_up)
    out = expert_rows(act, down_proj, spans)
    out += experts.down_proj_bias[expert_ids]
    out *= scores.reshape(-1)[order, None]
    unsorted = torch.empty_like(out)
    unsorted[order] = out
    return cast(unsorted.view(-1, top_k, out.shape[-1]).sum(dim=1), x.dtype)


def expert_gemm(x: torch.Tensor, weights: ExpertMatrices, expert: int) -> torch.Tensor:
    """x [n, in] times expert `expert`'s matrix [in, out] -> [n, out] in x's dtype. An exact copy
    (`target_cpu.ExpertCopy`) gives its float32 matrix back just before the GEMM, so the GEMM is the same; fbgemm's
    float16 copies (`half_copies`) multiply and sum in float32: the float32 GEMM's result up to
    summation order."""
    if isinstance(weights, list):
        return half_gemm()(x, weights[expert])
    return torch.mm(x, cast(weights[expert], x.dtype))


def expert_rows(x: torch.Tensor, weights: ExpertMatrices, spans: list[tuple[int, int, int]]) -> torch.Tensor:
    """The rows of x sorted by expert, each span (expert, first, last) times its expert's matrix."""
    parts = [expert_gemm(x[first:last], weights, expert) for expert, first, last in spans]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def half_copies(weight: torch.Tensor) -> list | None:
    """Experts [E, in, out] as fbgemm's float16 copies, one prepacked matrix per expert, where float16
    holds them to float32's accuracy and fbgemm runs here (`exact_half`: MXFP4 experts do), else None.
    They halve the bytes a step reads without the cast the bf16 copies need per GEMM: on an AVX512 AMD
    EPYC VM an AR step took 0.93x and a verify 0.86x the time of the float32 originals' (round 10)."""
    weight = weight.detach()
    if not exact_half(weight):
        return None
    return [torch.ops.quantized.linear_prepack_fp16(matrix.t().contiguous(), None) for matrix in weight]


def hooked(*modules: nn.Module) -> bool:
    """Whether a forward hook watches one of these modules (quantization calibration records their
    inputs that way): a lean path that bypasses them must then call them instead."""
    return any(hook_dicts(*modules))


def hook_dicts(*modules: nn.Module) -> list[dict]:
    """The modules' forward (pre-)hooks as the dicts that hold them: `register_forward_hook` adds to these very
    dicts, so a list of them, made once, answers `hooked` later."""
    return [hooks for module in modules for hooks in (module._forward_pre_hooks, module._forward_hooks)]
