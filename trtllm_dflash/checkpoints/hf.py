"""Reading Hugging Face style checkpoint directories with errors that name the file and field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..errors import InputError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        if path.is_dir():
            raise InputError("is a directory; expected a JSON file here.", path=path)
        if path.parent.is_file():  # a file given where its directory was meant (`--target DIR/config.json`)
            raise InputError(f"is a file; expected the directory that holds {path.name}.", path=path.parent)
        raise InputError("file not found; expected a JSON file here.", path=path)
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"not valid JSON ({exc}).", path=path) from None
    if not isinstance(data, dict):
        raise InputError("expected a JSON object at the top level.", path=path)
    return data


def require(config: dict[str, Any], key: str, kind: type | tuple[type, ...], path: Path) -> Any:
    """config[key] with a clear error when it is absent or of the wrong type (bool is not an int)."""
    if key not in config:
        raise InputError("missing.", path=path, field=key)
    value = config[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise InputError(f"expected {names}, got {value!r}.", path=path, field=key)
    return value


def index_weight_map(index: Path) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> shard file) of a sharded checkpoint's index."""
    weight_map = require(read_json(index), "weight_map", dict, index)
    if not all(isinstance(file, str) for file in weight_map.values()):
        raise InputError("expected tensor names mapped to shard file names.", path=index, field="weight_map")
    return weight_map


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of a checkpoint: the index's shards, else every ``*.safetensors`` file."""
    if not directory.is_dir():
        raise InputError("checkpoint directory not found.", path=directory)
    index = directory / INDEX_FILE
    if index.is_file():
        files = sorted({directory / name for name in index_weight_map(index).values()})
        for file in files:
            if not file.is_file():
                raise InputError(f"shard listed in {INDEX_FILE} is missing.", path=file)
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise InputError(f"no weights found; expected {SINGLE_FILE} or {INDEX_FILE}.", path=directory)
    return files


def load_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(directory):
        try:
            state.update(load_file(file))
        except (SafetensorError, OSError, ValueError) as exc:
            raise InputError(f"cannot read safetensors (truncated or corrupt?): {exc}", path=file) from None
    return state
