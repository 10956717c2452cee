"""Triton Python-backend model serving a dflash-build engine (copied to `<repo>/dflash/1/model.py`).

Needs `trtllm_dflash` installed in the Python environment of Triton's Python backend. All request
logic lives in `trtllm_dflash.triton.service`; this file only moves tensors in and responses out.
"""

from __future__ import annotations

import json
from pathlib import Path

import triton_python_backend_utils as pb_utils

from trtllm_dflash.errors import InputError
from trtllm_dflash.triton.service import INPUT_NAMES, DFlashService


def fail(sender, message: str) -> None:
    """The request's final response, carrying only an error."""
    sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message)),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        engine_dir = Path(args["model_repository"]) / params["engine_dir"]  # absolute paths stay absolute
        self.service = DFlashService.from_engine(engine_dir, params.get("backend", "auto"),
                                                 params.get("verify_checksums") == "true")

    def execute(self, requests):
        """Decoupled mode: every request answers through its own response sender."""
        for request in requests:
            sender = request.get_response_sender()
            inputs = {}
            for name in INPUT_NAMES:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy()

            def emit(outputs, final, sender=sender):
                tensors = [pb_utils.Tensor(name, value) for name, value in outputs.items()]
                flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
                sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=flags)

            try:
                self.service.handle(inputs, emit)
            except InputError as exc:
                fail(sender, str(exc))
            except Exception as exc:  # noqa: BLE001 -- one failing request must not leave the others unanswered
                fail(sender, f"internal error: {type(exc).__name__}: {exc}")
        return None

    def finalize(self):
        self.service = None
