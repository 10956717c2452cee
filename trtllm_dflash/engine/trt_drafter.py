"""`dflash-build --trt-drafter`: the drafter as an ONNX graph with draft-block plugin nodes, and a
TensorRT engine of it where TensorRT and a GPU are present (plugins/draft_block/README.md)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoints.safetensors_io import ShardedReader
from ..errors import InputError
from ..models.drafter import DrafterStep, load_drafter

ONNX_NAME = "drafter.onnx"


def lm_head_weight(target_dir: Path) -> torch.Tensor:
    """The target's LM head (the drafter borrows it), read alone from the sharded checkpoint."""
    reader = ShardedReader(target_dir)
    if "lm_head.weight" not in reader.infos:
        raise InputError("no 'lm_head.weight' tensor; the drafter step needs the target's LM head.",
                         path=target_dir, field="lm_head.weight")
    return reader.read("lm_head.weight").float()


def export_drafter_onnx(drafter_dir: Path, target_dir: Path, path: Path) -> Path:
    """Export one float32 drafter step (batch and context capacity dynamic)."""
    from trtllm_dflash.plugins.draft_block.onnx_export import export_drafter_step

    drafter = load_drafter(drafter_dir)
    cfg = drafter.config
    step = DrafterStep(drafter, lm_head_weight(target_dir)).eval()
    batch, capacity = 2, 16
    arena = [torch.zeros(batch, cfg.num_key_value_heads, capacity, cfg.head_dim)
             for _ in range(2 * cfg.num_hidden_layers)]
    example = [torch.zeros(batch, cfg.block_size, cfg.hidden_size), torch.tensor([3, 7], dtype=torch.int32), *arena]
    export_drafter_step(step, example, path, num_layers=cfg.num_hidden_layers)
    return path


def write_trt_drafter(drafter_dir: Path, target_dir: Path, out_dir: Path) -> str | None:
    """`out_dir/drafter_trt/drafter.onnx` always; the engine when possible. Returns why not, if not."""
    from trtllm_dflash.plugins.draft_block.tensorrt_plugin import build_trt_drafter

    onnx_dir = out_dir / "drafter_trt"
    onnx_dir.mkdir(parents=True, exist_ok=True)
    export_drafter_onnx(drafter_dir, target_dir, onnx_dir / ONNX_NAME)
    return build_trt_drafter(onnx_dir / ONNX_NAME, out_dir).skipped
