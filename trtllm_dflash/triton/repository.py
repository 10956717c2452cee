"""Writing a Triton model repository for an engine, in Triton's LLM-API (PyTorch) layout.

    <repo>/dflash/config.pbtxt   python backend, decoupled (streaming), tensors from service.py
    <repo>/dflash/1/model.py     serves the engine through trtllm_dflash's Runtime interface
    <repo>/dflash/1/model.yaml   the engine's LLM-API options + `model` + `triton_config`, as
                                 Triton's llmapi `model.py` reads them, with absolute paths;
                                 stand-alone repositories only (see write_model_repository)

The engine is found through the `engine_dir` parameter, resolved against the model directory:
`../..` inside an engine (`<engine>/triton/dflash` -> `<engine>`, so the engine stays relocatable),
an absolute path for a repository written elsewhere (`dflash-build --triton-repo`).
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from ..engine.options import LlmApiOptions
from .llmapi import INPUTS, OUTPUTS, TensorSpec

MODEL_NAME = "dflash"
MODEL_SOURCE = Path(__file__).with_name("model.py")


def tensor_block(spec: TensorSpec, optional: bool) -> str:
    dims = ", ".join(str(d) for d in spec.dims)
    extra = "\n    optional: true" if optional and spec.optional else ""
    return f'  {{\n    name: "{spec.name}"\n    data_type: {spec.data_type}\n    dims: [ {dims} ]{extra}\n  }}'


@dataclass(frozen=True)
class ModelParameters:
    """How model.py runs the engine (config.pbtxt `parameters`, read back in `initialize`)."""

    backend: str = "auto"
    device: str = "auto"
    speculation: str = "dflash"  # "off": the target alone, the autoregressive baseline
    batching: str = "inflight"  # the reference backend's; "static": a request waits for the running batch to end
    stream_interval: int | None = None  # None: the engine's LLM API option (written only when set)
    # the reference backend's, each written only when set: dflash-sa (None), dflash or ngram; dflash-run's policy
    # priced per live batch ("adaptive", None for dflash-sa and dflash) or the engine's block ("fixed", None for ngram)
    draft_method: str | None = None
    draft_length: str | None = None


def render_config(engine_ref: str, model_name: str = MODEL_NAME, run: ModelParameters = ModelParameters()) -> str:
    """config.pbtxt: max_batch_size 0 (the model batches concurrent requests itself), decoupled so a
    request can stream."""
    inputs = ",\n".join(tensor_block(t, optional=True) for t in INPUTS)
    outputs = ",\n".join(tensor_block(t, optional=False) for t in OUTPUTS)
    chosen = {name: value for name, value in asdict(run).items() if value is not None}
    parameters = {"engine_dir": engine_ref, **chosen, "verify_checksums": "false"}
    params = "\n".join(f'parameters {{\n  key: "{k}"\n  value: {{ string_value: "{v}" }}\n}}'
                       for k, v in parameters.items())
    return (f'name: "{model_name}"\nbackend: "python"\nmax_batch_size: 0\n'
            f"model_transaction_policy {{\n  decoupled: true\n}}\n"
            f"input [\n{inputs}\n]\noutput [\n{outputs}\n]\n"
            f"instance_group [\n  {{\n    count: 1\n    kind: KIND_MODEL\n  }}\n]\n{params}\n")


def render_model_yaml(options: LlmApiOptions, engine_root: Path) -> str:
    """Absolute paths under engine_root: Triton's llmapi model.py hands them to LLM() as they are."""
    data = options.to_dict()
    spec = data.get("speculative_config")
    if spec is not None:
        spec["speculative_model"] = str(engine_root / spec["speculative_model"])
    document = {"model": str(engine_root / "target"), **data, "triton_config": {"max_batch_size": 0, "decoupled": True}}
    return yaml.safe_dump(document, sort_keys=False)


def write_model_repository(repo: Path, engine_ref: str, options: LlmApiOptions, engine_root: Path | None,
                           model_name: str = MODEL_NAME, run: ModelParameters = ModelParameters()) -> Path:
    version = repo / model_name / "1"
    version.mkdir(parents=True)
    (repo / model_name / "config.pbtxt").write_text(render_config(engine_ref, model_name, run))
    shutil.copyfile(MODEL_SOURCE, version / "model.py")
    # Inside a relocatable engine (engine_root None) there is no path Triton's llmapi model.py could
    # resolve (it passes `model` to LLM() against the server's cwd), and our model.py reads the
    # engine itself, so no model.yaml is written there.
    if engine_root is not None:
        (version / "model.yaml").write_text(render_model_yaml(options, engine_root))
    return repo
