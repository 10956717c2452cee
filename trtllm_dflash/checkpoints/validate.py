"""Do a gpt-oss target and a DFlash drafter fit together? Checked from configs and safetensors
headers only, before anything is loaded or written, so every mismatch names its file and field."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..models.drafter_config import DFlashConfig
from .gpt_oss import check_weight_files, read_target_config
from .safetensors_io import ShardedReader


@dataclass(frozen=True)
class Pair:
    target_dir: Path
    drafter_dir: Path
    target_config: dict[str, Any]
    drafter_config: DFlashConfig
    warnings: tuple[str, ...] = ()  # fits, but worth telling the user (e.g. `last_layer_warning`)


def tensor_shape(directory: Path, name: str) -> tuple[Path, tuple[int, ...]] | None:
    """(file, shape) of a tensor, read from the safetensors headers, accepting a `model.` prefix."""
    reader = ShardedReader(directory)
    for key in (name, "model." + name):
        if key in reader.infos:
            return reader.files[key], reader.infos[key].shape
    return None


def check_target_layer_ids(ids: list[int], num_layers: int, field: str, path: Path | None = None) -> None:
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise InputError(f"ids {bad} are outside the target's decoder layers [0, {num_layers}) (0-based; the "
                         "output of layer i is used).", path=path, field=field)


def last_layer_warning(ids: list[int], num_layers: int, field: str) -> str | None:
    """Why a drafter should not read the target's last layer: the two upstream conventions disagree on it."""
    if num_layers - 1 not in ids:
        return None
    return (f"{field} uses layer {num_layers - 1}, the target's last layer. z-lab's reference (and anything built on "
            f"transformers' output_hidden_states) feeds hidden_states[{num_layers}], which is AFTER the final norm, "
            "while TensorRT-LLM and this runtime feed the layer's residual stream before it, so the drafter drafts "
            f"differently in each; drafters meant to be portable use layers below {num_layers - 1}.")


def validate_pair(target_dir: str | Path, drafter_dir: str | Path, block_size: int | None = None) -> Pair:
    target_dir, drafter_dir = Path(target_dir), Path(drafter_dir)
    target = read_target_config(target_dir)
    target_cfg_path = target_dir / "config.json"
    drafter_cfg_path = drafter_dir / "config.json"
    drafter = DFlashConfig.from_json(drafter_cfg_path)
    check_weight_files(target_dir)
    check_weight_files(drafter_dir)

    hidden = target["hidden_size"]
    if drafter.hidden_size != hidden:
        raise InputError(f"drafter hidden size {drafter.hidden_size} differs from the target's {hidden} "
                         f"({target_cfg_path}); a DFlash drafter shares the target's embeddings and LM head.",
                         path=drafter_cfg_path, field="hidden_size")
    layers = target["num_hidden_layers"]
    if drafter.num_target_layers != layers:
        raise InputError(f"the drafter was made for a {drafter.num_target_layers}-layer target, but "
                         f"{target_cfg_path} has {layers} layers.", path=drafter_cfg_path, field="num_target_layers")
    check_target_layer_ids(drafter.target_layer_ids, layers, "dflash_config.target_layer_ids", drafter_cfg_path)
    vocab = target["vocab_size"]
    if not 0 <= drafter.mask_token_id < vocab:
        raise InputError(f"mask token id {drafter.mask_token_id} is outside the target vocabulary [0, {vocab}).",
                         path=drafter_cfg_path, field="dflash_config.mask_token_id")
    if drafter.vocab_size is not None and drafter.vocab_size != vocab:
        raise InputError(f"drafter vocabulary {drafter.vocab_size} differs from the target's {vocab} "
                         f"({target_cfg_path}).", path=drafter_cfg_path, field="vocab_size")
    if block_size is not None and not 2 <= block_size <= drafter.block_size:
        raise InputError(f"expected 2..{drafter.block_size} (the drafter's block size), got {block_size}.",
                         field="block_size")

    fc = tensor_shape(drafter_dir, "fc.weight")
    if fc is None:
        raise InputError("tensor 'fc.weight' not found in the drafter weights.", path=drafter_dir)
    fc_file, fc_shape = fc
    width = len(drafter.target_layer_ids) * hidden
    if fc_shape != (hidden, width):
        raise InputError(f"shape {list(fc_shape)} does not fit: expected [{hidden}, {width}] = [target hidden, "
                         f"len(target_layer_ids)={len(drafter.target_layer_ids)} x target hidden {hidden}].",
                         path=fc_file, field="fc.weight")
    warning = last_layer_warning(drafter.target_layer_ids, layers, f"{drafter_cfg_path} dflash_config.target_layer_ids")
    return Pair(target_dir, drafter_dir, target, drafter, (warning,) if warning else ())
