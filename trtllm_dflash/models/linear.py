"""Linear maps whose GEMM runs in another dtype than the activations around it (the drafter's bf16 path).

A draft need not be exact -- the target verifies every token -- and on a small model a drafter step is
bound by reading its weights, so its GEMMs may read bf16 weights and bf16 inputs while norms, RoPE,
attention and the residual stream stay float32 (the output is cast back). On CPU the bf16 weight is
reordered once into oneDNN's blocked layout (`mkldnn._reorder_linear_weight`, what inductor's CPU
freezing pass does for bf16 linears); without that, MKL repacks the weight on every call and gains
little over float32 at a handful of rows (docs/benchmarks.md, round 4). Elsewhere (CUDA) it is
`F.linear` on a bf16 weight copy.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


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


def native_bf16(device: torch.device) -> bool:
    """Whether bf16 GEMMs are a speed-up on this device (CUDA, or a CPU that packs them for oneDNN)."""
    return device.type == "cuda" or onednn_packs(torch.bfloat16, device)


class CastLinear:
    """y = x @ W.T + b with W, b and the GEMM's input in `dtype`; y comes back in x's dtype.
    Built once from (copies of) the weight; the caller rebuilds it when the weight changes."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        self.dtype, self.out_features = dtype, weight.shape[0]
        weight = weight.detach().to(dtype)
        self.bias = None if bias is None else bias.detach().to(dtype)
        self.packed = onednn_packs(dtype, weight.device)
        self.weight = prepack(weight) if self.packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.native(x).to(x.dtype)

    def native(self, x: torch.Tensor) -> torch.Tensor:
        """y in `dtype`, the GEMM's own, not cast back: for a consumer that takes it as it is (a residual
        add promotes it; the next GEMM of the same dtype reads it directly), one copy less each way."""
        flat = x.reshape(-1, x.shape[-1]).to(self.dtype)  # 2-D: a 3-D input sends F.linear to a batched matmul
        if self.packed:
            y = packed_linear(flat, self.weight, self.bias)
        else:
            y = F.linear(flat, self.weight, self.bias)
        return y.view(*x.shape[:-1], self.out_features)


def drafter_gemm_dtype(choice: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype | None:
    """`dflash-run --drafter-gemm-dtype` -> `DFlashProposer(matmul_dtype=...)` (None: the model's dtype).
    auto: bfloat16 for a float32 drafter where bf16 GEMMs are native here, else the model's dtype."""
    if choice == "auto":
        return torch.bfloat16 if model_dtype == torch.float32 and native_bf16(device) else None
    wanted = {"float32": torch.float32, "bfloat16": torch.bfloat16}[choice]
    return None if wanted == model_dtype else wanted
