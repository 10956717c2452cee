"""Triton Python-backend model serving a dflash-build engine (copied to `<repo>/<name>/1/model.py`).

Needs `trtllm_dflash` installed in the Python environment of Triton's Python backend. All request
logic lives in `trtllm_dflash.triton` (llmapi: parsing, scheduler: batching, service: generation);
this file only moves tensors in and responses out. Decoupled: `execute` queues each request and
returns; the scheduler's worker thread answers through the request's response sender.
"""

from __future__ import annotations

import json
from pathlib import Path

import triton_python_backend_utils as pb_utils

from trtllm_dflash.errors import InputError
from trtllm_dflash.triton.llmapi import INPUT_NAMES, refuse_parameters
from trtllm_dflash.triton.scheduler import BatchScheduler
from trtllm_dflash.triton.service import DFlashService, Job


def responder(sender):
    """(emit, fail) for one request's response sender."""
    def emit(outputs, final):
        tensors = [pb_utils.Tensor(name, value) for name, value in outputs.items()]
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=flags)

    def fail(message, cancelled=False):
        code = getattr(pb_utils.TritonError, "CANCELLED", None) if cancelled else None
        error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
        try:
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:  # noqa: BLE001 -- a cancelled request may refuse further responses
            pass

    return emit, fail


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        engine_dir = Path(args["model_repository"]) / params["engine_dir"]  # absolute paths stay absolute
        self.service = DFlashService.from_engine(engine_dir, params.get("backend", "auto"),
                                                 params.get("verify_checksums") == "true",
                                                 params.get("device", "auto"), params.get("speculation", "dflash"),
                                                 params.get("batching", "inflight"),
                                                 int(params["stream_interval"]) if "stream_interval" in params else None,
                                                 params.get("draft_length"), params.get("draft_method"))
        self.scheduler = BatchScheduler(self.service.run_batch, self.service.max_batch_size)

    def execute(self, requests):
        for request in requests:
            emit, fail = responder(request.get_response_sender())
            inputs = {}
            for name in INPUT_NAMES:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy()
            try:
                refuse_parameters(json.loads(request.parameters() or "{}"))
                spec, prompt = self.service.prepare(inputs)
                if spec.stop_request:  # upstream's answer to a stop request is a CANCELLED error
                    self.scheduler.cancel(request.request_id())
                    fail("request cancelled by client", True)
                    continue
                self.scheduler.submit(Job(spec, prompt, emit, fail, request.is_cancelled, request.request_id()))
            except InputError as exc:
                fail(str(exc))
            except Exception as exc:  # noqa: BLE001 -- one failing request must not leave the others unanswered
                fail(f"internal error: {type(exc).__name__}: {exc}")
        return None

    def finalize(self):
        self.scheduler.close()
        self.service.close()
        self.service = None
