"""Frozen linear maps laid out for the inference path, their GEMM in a chosen dtype (`CastLinear`).

Two facts about small GEMMs on this project's CPUs shape it (docs/benchmarks.md, round 7):
- MKL runs a few-row GEMM 1.3-2x faster on a weight stored [in, out] than on the [out, in] one that
  `F.linear` hands it as a transposed view, so on CPU the weight is copied once, transposed.
- A draft need not be exact -- the target verifies every token -- and a GEMM bound by reading its
  weight (the drafter's LM head) halves its bytes in bf16 through oneDNN, whose CPU path takes the
  weight reordered once into its blocked layout (`mkldnn._reorder_linear_weight`, what inductor's CPU
  freezing pass does for bf16 linears). But a oneDNN call costs ~25 us more than MKL's, more than a
  small GEMM's few-row halved bytes give back, so bf16 serves every GEMM only where oneDNN packs it (a
  CPU with native bf16), whose few-row calls go to another copy (below): there a 256 x 256 to 1024 x 256
  drafter GEMM at 16-32 rows took 0.4-0.9x fbgemm's float16 time on an AMX Xeon (round 12). Elsewhere
  bf16 serves only GEMMs with at least `NARROW_MIN_WEIGHTS` weights (`gemm_dtype`): the LM head here,
  every GEMM of a gpt-oss-120b drafter.
  And on CPU only at `NARROW_MIN_ROWS` rows or more: at a lone request's 7 draft rows the LM head ran 3-5%
  slower in bf16 inside the loop than as float32 on its weight stored [in, out] (bound by the call and
  the weight's bytes alike), while at 56 rows (a batch of 8) float32 takes 2.8x bf16's time (bound by
  arithmetic, where AMX and AVX512-BF16 double the rate); so a packed GEMM keeps a copy for fewer rows
  (float32 on that Intel VM; fbgemm's float16 where it runs, below).
fbgemm's fp16-weight GEMM (x86 CPU builds) multiplies a float16 copy of the weight, prepacked once, with
float32 inputs, products and sums. Two uses:
- Exact-class GEMMs of the target: where float16 holds the float32 weight to float32's own accuracy
  (`fits_half`: bf16 weights, MXFP4 experts), its result is the float32 GEMM's up to summation order,
  like MKL's, from half the bytes. The target's LM head, q/k/v and o_proj run that way (`exact_dtype`):
  the attention projections in float16 took a verify of 8 tokens from 2.47 to 2.21 ms inside the loop on
  an AVX512 AMD EPYC VM, the AR step level (round 13).
- The drafter's GEMMs, at every size: on an AVX512 AMD EPYC VM the drafter step ran in 0.76x its time
  inside the loop with every GEMM in float16 against float32 ones beside a bf16 LM head (round 10), and
  on an AVX2 one its 7-row LM head in half the float32 time (round 9). Where bf16 is native, oneDNN's
  bf16 GEMM is twice fbgemm's rate at 56 rows and more, so a bf16 drafter keeps its LM head packed in
  bf16 and hands fewer rows to fbgemm: 0.15 ms less per drafter step than bf16 at a lone request's 7
  rows there (round 10). The drafter's weights are bf16 at heart, which float16 holds (down to 6e-5).
Where the CPU has AVX512-BF16 and the compiled kernel builds (plugins/draft_block/dot_gemm.h), a bf16 GEMM is
that kernel's at every row count instead (`CastLinear.dot`): inputs rounded to bf16, `vdpbf16ps` products and float32
sums at twice the FMA's rate, a few microseconds a call. On an AVX2 CPU the kernel makes the same products with FMAs
at float32's rate, for the calls' few microseconds and the whole compiled drafter step (round 23). On the AVX512 AMD
EPYC VM it took a drafter GEMM at 8 rows from 24-59 us (fbgemm's float16) and 20-38 us (oneDNN's bf16) to 6-20 us,
the 7-row LM head from 185 and 102 to 77 us, and the drafter step inside the loop from 1.03 to 0.75 ms (round 18). The oneDNN and few-row paths above
serve where it does not run.
Elsewhere (CUDA) a GEMM is `F.linear` on the weight copy.
"""

from __future__ import annotations

import functools

import torch
from torch.nn import functional as F

from ..errors import InputError
from ..plugins.draft_block import cpu as draft_cpu

NARROW_MIN_WEIGHTS = 1 << 20  # a 4096 x 256 LM head; a drafter's q/k/v, MLP are 2-8x smaller
NARROW_MIN_ROWS = 16  # two requests' draft rows


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`, without dispatching a `.to` that would do nothing: inside a step of a small model
    every op Python dispatches costs ~10 us on this project's CPU, no-op casts included."""
    return x if x.dtype == dtype else x.to(dtype)


def onednn_packs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN's prepacked linear serves this dtype here: a CPU build with mkldnn, a CPU with
    native bf16 dot products (elsewhere oneDNN emulates bf16, slower than float32)."""
    native = getattr(torch.cpu, "_is_avx512_bf16_supported", None)  # private in torch 2.13: absent means no
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and native is not None and native())


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """A CPU weight [out, in] reordered once into oneDNN's blocked layout, for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [n, in] @ W.T + b in x's dtype through oneDNN, W from `prepack`. No autograd."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@functools.cache
def fbgemm_fp16() -> bool:
    """Whether this torch build carries fbgemm's fp16-weight GEMM (x86 CPU builds do; ARM ones don't)."""
    try:
        torch.ops.quantized.linear_prepack_fp16(torch.zeros(1, 1), None)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return True


@functools.cache
def half_gemm():
    """fbgemm's fp16-weight GEMM (x [n, in] float32 times a `linear_prepack_fp16` weight -> float32) as the
    C++ function `torch.ops` dispatches to: its Python wrapper first scans the arguments for the fake
    script objects of torch.compile's tracing, ~3 us a call on this project's CPUs, a fifth of a small
    GEMM's time. (`_op` is torch's own handle on that function; without it the wrapper serves.)"""
    op = torch.ops.quantized.linear_dynamic_fp16
    return getattr(op, "_op", op)


def half_weights(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a float16 GEMM here is fbgemm's, on a float16 copy of the weight with float32 inputs."""
    return device.type == "cpu" and dtype == torch.float16 and fbgemm_fp16()


def half_or(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """float16 where fbgemm's fp16-weight GEMM runs on this device, else `dtype`."""
    return torch.float16 if half_weights(torch.float16, device) else dtype


def fits_half(weight: torch.Tensor) -> bool:
    """Whether float16 holds this float32 weight to float32's accuracy: every value exactly, except those
    below float16's normal range (2^-14), which it rounds by at most 2^-25. bf16 weights within float16's
    range (gpt-oss checkpoints' dense ones) and MXFP4 experts qualify; random float32 ones do not."""
    if weight.dtype != torch.float32:
        return False
    weight = weight.detach()
    return bool(((weight.half().float() == weight) | (weight.abs() < 2**-14)).all())


def exact_half(weight: torch.Tensor) -> bool:
    """Whether a GEMM over this float32 weight can run through fbgemm's fp16-weight GEMM at float32's accuracy."""
    return half_weights(torch.float16, weight.device) and fits_half(weight)


def exact_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype of a target GEMM over `weight` that keeps float32's accuracy: float16 where `exact_half`, else
    the weight's own."""
    return torch.float16 if exact_half(weight) else weight.dtype


def native_bf16(device: torch.device) -> bool:
    """Whether bf16 GEMMs are a speed-up on this device (CUDA, or a CPU that packs them for oneDNN)."""
    return device.type == "cuda" or onednn_packs(torch.bfloat16, device)


def gemm_dtype(weight: torch.Tensor, wanted: torch.dtype | None) -> torch.dtype:
    """The dtype of a GEMM over `weight` when `wanted` is asked (None: the weight's own): the compiled dot GEMM's bf16
    or int8 at any size where it takes the weight; fbgemm's float16 at any size; bf16 at any size where oneDNN packs it
    (`CastLinear` hands its few-row calls to a copy);
    another narrower dtype only for a weight of at least `NARROW_MIN_WEIGHTS`, a smaller one in fbgemm's
    float16 where it runs, else in its own dtype (see the module's docstring)."""
    if wanted is None:
        return weight.dtype
    if wanted in draft_cpu.DOT_DTYPES and draft_cpu.dot_serves(weight, wanted):
        return wanted  # the compiled dot GEMM, at every size
    if wanted == torch.int8:  # only the compiled int8 dot GEMM multiplies int8; else the bf16 it stands in for
        return gemm_dtype(weight, torch.bfloat16)
    if half_weights(wanted, weight.device) or wanted.itemsize >= weight.dtype.itemsize:
        return wanted
    if weight.numel() >= NARROW_MIN_WEIGHTS or onednn_packs(wanted, weight.device):
        return wanted
    return half_or(weight.dtype, weight.device)


class CastLinear:
    """y = x @ W.T + b with W, b and the GEMM's input in `dtype` (fbgemm's float16 GEMM: W only); y comes back in
    x's dtype.
    Built once from (copies of) the weight; the caller rebuilds it when the weight changes. Gradients
    flow to x (not to the copies) except through oneDNN's packed op and fbgemm's fp16 one, which have none.

    A step of a small model is bound by the count of ops Python dispatches (~10 us each inside a step
    on this project's CPU, views and no-op casts included), so a GEMM in the input's dtype is the one
    `F.linear` call, which folds a contiguous 3-D input into a 2-D GEMM itself; on CPU its weight is the
    [out, in] view of a copy stored [in, out], which `F.linear` transposes back for MKL."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 few_rows: "CastLinear | None" = None,
                 dot_packed: tuple[torch.Tensor, torch.Tensor | None] | None = None):
        """`few_rows`: the GEMM of the same weight that serves a packed GEMM's calls of fewer than
        `NARROW_MIN_ROWS` rows; None: a copy made here, in fbgemm's float16 where it runs, else in the
        weight's own dtype. Pass the one the model already runs (the drafter's logits pass the target's
        LM head: a verify has just read it into cache, where a copy of its own would be read from memory;
        7% of DFlash's speed-up, round 7). `dot_packed`: for the compiled dot GEMM, `dot_pack(weight, dtype)`'s
        answer already held elsewhere, used instead of packing a copy (the same reasoning: the target's exact
        greedy head holds the LM head's int8 packing)."""
        self.dtype, self.out_features = dtype, weight.shape[0]
        self.dot = dtype in draft_cpu.DOT_DTYPES and draft_cpu.dot_serves(weight, dtype)
        self.scales = None  # an int8 weight's columns' scales
        if self.dot:  # the compiled AVX512 bf16 or int8 GEMM, at any row count (the module docstring)
            self.packed = self.half = False
            self.few_rows = None
            self.weight, self.scales = dot_packed or draft_cpu.dot_pack(weight, dtype)
            self.bias = None if bias is None else bias.detach().float().contiguous()
            return
        if dtype == torch.int8:
            raise ValueError("int8 GEMMs run only in the compiled int8 dot GEMM, AVX512-VNNI or AVX2 (`gemm_dtype` "
                             "picks another dtype where it does not serve)")
        self.packed = onednn_packs(dtype, weight.device)
        self.half = half_weights(dtype, weight.device)
        wider = self.packed and weight.dtype.itemsize > dtype.itemsize
        if not wider:
            self.few_rows = None
        else:
            self.few_rows = few_rows if few_rows is not None else CastLinear(weight, bias,
                                                                            half_or(weight.dtype, weight.device))
        if self.half:  # fbgemm rounds the weight to float16 itself; inputs, bias and output stay float32
            self.bias = None if bias is None else bias.detach().float()
            self.weight = torch.ops.quantized.linear_prepack_fp16(weight.detach().float(), self.bias)
            return
        weight = weight.detach().to(dtype)
        self.bias = None if bias is None else bias.detach().to(dtype)
        if self.packed:
            self.weight = prepack(weight)
        else:  # MKL on CPU reads the weight row-major [in, out]
            self.weight = weight.t().contiguous().t() if weight.device.type == "cpu" else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return cast(self.native(x), x.dtype)

    def native(self, x: torch.Tensor) -> torch.Tensor:
        """y in the dtype of the GEMM that ran (`dtype`; float32 from the dot kernel, or the weight's own for
        fewer than `NARROW_MIN_ROWS` rows), not cast back: for a consumer that takes it as it is (a residual add
        promotes it; the next GEMM of the same dtype reads it directly), one copy less each way."""
        if self.dot:  # float32 in and out
            return draft_cpu.dot_linear_cpu(cast(x, torch.float32), self.weight, self.bias, self.scales)
        if self.few_rows is not None and x.numel() < NARROW_MIN_ROWS * x.shape[-1]:
            return self.few_rows.native(x)
        if self.half:  # float32 in and out
            return half_gemm()(cast(x, torch.float32), self.weight)
        x = cast(x, self.dtype)
        if not self.packed:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, x.shape[-1])  # oneDNN's op takes 2-D inputs
        return packed_linear(flat, self.weight, self.bias).view(*x.shape[:-1], self.out_features)


DRAFTER_GEMM_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")  # the choices of `drafter_gemm_dtype`


def drafter_gemm_dtype(choice: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype | None:
    """`dflash-run --drafter-gemm-dtype` -> `DFlashProposer(matmul_dtype=...)` (None: the model's dtype),
    the dtype of the drafter step's GEMMs where `gemm_dtype` admits it.
    auto, for a float32 drafter: int8 where the compiled int8 GEMM runs (AVX512-VNNI: the drafter step in 0.74x bf16's
    time inside the loop, pooled tau within 0.01 on the embedded pair, round 19; AVX2, `vpmaddubsw` with inputs on 63
    levels: 0.67x, tau 2.77 against 2.79, round 24), else bfloat16 where
    the compiled bf16 GEMM runs (AVX512-BF16, or FMAs on AVX2: then the whole drafter step is one compiled call,
    round 23) or bf16 GEMMs are native here, else float16 where fbgemm's fp16-weight GEMM runs (x86 CPUs), else the
    model's dtype.
    int8 runs only in that GEMM: asked for on a CPU without it (no AVX2) or on CUDA, it is an `InputError`."""
    int8_runs = device.type == "cpu" and draft_cpu.dot_kernel(torch.int8) is not None
    if choice == "auto":
        if model_dtype != torch.float32:
            return None
        if int8_runs:
            return torch.int8
        if native_bf16(device) or (device.type == "cpu" and draft_cpu.dot_kernel(torch.bfloat16) is not None):
            return torch.bfloat16
        return torch.float16 if half_weights(torch.float16, device) else None
    if choice == "int8" and not int8_runs:
        reason = ((draft_cpu.unavailable_reason() or "the CPU lacks AVX512-VNNI and AVX2") if device.type == "cpu"
                  else "a CUDA device")
        raise InputError(f"int8 drafter GEMMs run only in the compiled int8 CPU kernel, not here ({reason}).",
                         field="--drafter-gemm-dtype")
    wanted = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}[choice]
    return None if wanted == model_dtype else wanted
