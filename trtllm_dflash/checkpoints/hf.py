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


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of a checkpoint: the sharded index's files, or the single file."""
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = require(read_json(index), "weight_map", dict, index)
        files = sorted({directory / name for name in weight_map.values()})
        for file in files:
            if not file.is_file():
                raise InputError(f"shard listed in {INDEX_FILE} is missing.", path=file)
        return files
    single = directory / SINGLE_FILE
    if single.is_file():
        return [single]
    raise InputError(f"no weights found; expected {SINGLE_FILE} or {INDEX_FILE}.", path=directory)


def load_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(directory):
        try:
            state.update(load_file(file))
        except (SafetensorError, OSError, ValueError) as exc:
            raise InputError(f"cannot read safetensors (truncated or corrupt?): {exc}", path=file) from None
    return state
