"""Rotary position embedding with Hugging Face semantics (default, YaRN, ...).

The inverse frequencies and the attention factor come from transformers' own RoPE initialisers, so
a drafter or target built here rotates exactly as the checkpoint's reference code does. YaRN folds
its attention factor into cos/sin, which scales both q and k.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


class Rotary(torch.nn.Module):
    """cos/sin tables for absolute positions; rotation pairs dimension j with j + head_dim/2.

    Both come full width, as transformers' do, except that `sin` carries rotate_half's sign:
    [-sin, sin] over the two halves, so `rotate` is x * cos + roll(x) * sin, four ops instead of eight
    and the same numbers as transformers' q * cos + rotate_half(q) * sin (the negation is exact)."""

    def __init__(self, hf_config: PretrainedConfig):
        super().__init__()
        params = hf_config.rope_parameters
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
            inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = float(scaling)
        self.tables: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # [positions, 2, head_dim]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype,
                top: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] -> cos, sin [..., head_dim] (angles in float32, then cast), gathered from a
        table of positions [0, 2^k) kept per dtype and device (grown when a position passes it): a
        decode step's two small ops instead of seven. `top`: max(positions) + 1 when the caller knows it."""
        if top is None:
            top = int(positions.max()) + 1 if positions.numel() else 0
        picked = self.table(top, dtype, positions.device)[positions]
        return picked[..., 0, :], picked[..., 1, :]

    def span(self, start: int, count: int, dtype: torch.dtype,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` of positions [[start, ..., start + count - 1]]: views of the table, no gather."""
        picked = self.table(start + count, dtype, device)[None, start: start + count]
        return picked[..., 0, :], picked[..., 1, :]

    def table(self, top: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """[size, 2, head_dim] cos/sin of positions [0, size), size >= top a power of two."""
        table = self.tables.get((dtype, device))
        if table is None or len(table) < top:
            with torch.inference_mode(False):  # a table made in inference mode could not serve training
                size = 1 << max(top - 1, 255).bit_length()
                table = torch.stack(self.cos_sin(torch.arange(size, device=device), dtype), dim=-2)
            self.tables[dtype, device] = table
        return table

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` computed from the angles, without the table (an exported graph's form)."""
        angles = positions[..., None].float() * self.inv_freq
        cos, sin = angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling
        return torch.cat([cos, cos], dim=-1).to(dtype), torch.cat([-sin, sin], dim=-1).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., D]; cos/sin from `Rotary`, broadcastable to [..., D] (rotate-half pairing, as HF GptOss
    and Qwen3): roll(x) = [second, first], which the signed sin turns into [-second, first]."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, t, D]; cos/sin [b, t, D]."""
    return rotate(x, cos[:, None], sin[:, None])
