"""Static activation scales: the amax of every quantized layer's input over calibration prompts.

Forward hooks record the largest |input| of each `nn.Linear` (target attention, drafter layers and
`fc`) and of each gpt-oss expert block, while the reference runtime generates on calibration
prompts (so the drafter sees the target features it will see in service). The result is keyed by
the logical weight names the converter uses (`...q_proj.weight`, `...experts.gate_up_proj`) and
feeds `convert_checkpoint(..., input_amax=...)`, which turns amax into `input_scale`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import contextmanager

import torch
from torch import nn

from .recipes import Format, get_recipe


def _record(amax: dict[str, float], name: str, x: torch.Tensor) -> None:
    value = float(x.detach().abs().max()) if x.numel() else 0.0
    amax[name] = max(amax.get(name, 0.0), value)


def is_gpt_oss_experts(module: nn.Module) -> bool:
    return hasattr(module, "gate_up_proj") and hasattr(module, "down_proj") and hasattr(module, "_apply_gate")


def _experts_hook(amax: dict[str, float], name: str):
    """gate_up sees the routed hidden states; down_proj sees the clamped-SwiGLU activation of each
    selected expert, recomputed here with the module's own gate (calibration only)."""

    def hook(module, args):
        hidden, router_indices = args[0], args[1]
        _record(amax, f"{name}.gate_up_proj", hidden)
        for expert in router_indices.unique().tolist():
            tokens = (router_indices == expert).any(dim=-1)
            gate_up = hidden[tokens] @ module.gate_up_proj[expert] + module.gate_up_proj_bias[expert]
            _record(amax, f"{name}.down_proj", module._apply_gate(gate_up))

    return hook


@contextmanager
def recording(roots: Iterable[nn.Module]):
    """Hooks on every linear and expert block under `roots`; yields the amax dict being filled."""
    amax: dict[str, float] = {}
    handles = []
    for root in roots:
        for name, module in root.named_modules():
            if isinstance(module, nn.Linear):
                handles.append(module.register_forward_pre_hook(
                    lambda m, args, key=f"{name}.weight": _record(amax, key, args[0])))
            elif is_gpt_oss_experts(module):
                handles.append(module.register_forward_pre_hook(_experts_hook(amax, name)))
    try:
        yield amax
    finally:
        for handle in handles:
            handle.remove()


def calibrate(roots: Iterable[nn.Module], run: Callable[[], object]) -> dict[str, float]:
    with recording(roots) as amax:
        run()
    return amax


def for_recipe(amax: dict[str, float], recipe: str, model_type: str | None = None) -> dict[str, float]:
    """The entries the recipe quantizes (FP8 / NVFP4) with a usable amax; the rest stay unscaled.

    ``model_type="gpt_oss"`` selects the gpt-oss target's variant of the recipe (what
    ``convert_checkpoint`` applies to a gpt-oss source); ``None`` the generic one (drafter).
    """
    chosen = get_recipe(recipe, model_type)
    return {name: value for name, value in amax.items()
            if chosen.format_for(name) in (Format.FP8, Format.NVFP4) and value > 0}
