"""The Triton model repository: config.pbtxt against Triton's ModelConfig schema, model.yaml, and
the Python-backend model driven through a stubbed `triton_python_backend_utils` (no server here)."""

from __future__ import annotations

import importlib.util
import json
import sys
import types

import numpy as np
import pytest
import torch
import yaml

from trtllm_dflash.engine.build import BuildOptions, build_engine
from trtllm_dflash.engine.load import reference_runtime
from trtllm_dflash.engine.options import LlmApiOptions
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.triton.service import INPUT_NAMES, OUTPUTS


def triton_schema():
    """Triton's `model_config_pb2`: tritonclient[grpc] when installed, else the generated module
    loaded from a base `tritonclient` install (its gencode also runs on protobuf 7)."""
    try:
        from tritonclient.grpc import model_config_pb2
        return model_config_pb2
    except (ImportError, RuntimeError):
        pass
    spec = importlib.util.find_spec("tritonclient")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("needs tritonclient (pip install --no-deps tritonclient==2.73.0) for Triton's schema")
    path = f"{spec.submodule_search_locations[0]}/grpc/model_config_pb2.py"
    module_spec = importlib.util.spec_from_file_location("triton_model_config_pb2", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def built(tiny_pair, tmp_path_factory):
    target, drafter = tiny_pair
    root = tmp_path_factory.mktemp("triton")
    return build_engine(BuildOptions(target, drafter, root / "engine", triton_repo=root / "repo"),
                        show_progress=False, log=lambda _: None)


@pytest.mark.parametrize("where", ["engine", "external"])
def test_config_pbtxt_parses_with_triton_schema(built, where):
    from google.protobuf import text_format

    repo = built.engine.triton_dir if where == "engine" else built.triton_repo
    schema = triton_schema()
    config = text_format.Parse((repo / "dflash" / "config.pbtxt").read_text(), schema.ModelConfig())
    assert config.name == "dflash" and config.backend == "python" and config.max_batch_size == 0
    assert config.model_transaction_policy.decoupled
    assert [i.name for i in config.input] == list(INPUT_NAMES) and all(i.optional for i in config.input)
    assert [o.name for o in config.output] == [o.name for o in OUTPUTS]
    engine_ref = config.parameters["engine_dir"].string_value
    assert engine_ref == ("../.." if where == "engine" else str(built.engine.root))
    assert (repo / "dflash" / engine_ref).resolve() == built.engine.root.resolve()


def test_model_yaml_carries_the_llm_api_options(built):
    """Only the stand-alone repository has a model.yaml (Triton's llmapi model.py passes its paths to
    LLM() as they are, so they are absolute); the engine's own repository has none: relative paths
    there would resolve against the server's working directory."""
    assert not (built.engine.triton_dir / "dflash" / "1" / "model.yaml").exists()
    data = yaml.safe_load((built.triton_repo / "dflash" / "1" / "model.yaml").read_text())
    model, triton_config = data.pop("model"), data.pop("triton_config")
    options = LlmApiOptions.from_dict(data)
    assert triton_config == {"max_batch_size": 0, "decoupled": True}
    assert model == str(built.engine.root / "target")
    assert options.speculative_config.speculative_model == str(built.engine.root / "drafter")


class FakeTensor:
    def __init__(self, name, value):
        self._name, self._value = name, np.asarray(value)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._value


class FakeSender:
    def __init__(self):
        self.sent = []

    def send(self, response, flags=0):
        self.sent.append((response, flags))


class FakeRequest:
    def __init__(self, **inputs):
        self.inputs = {k: FakeTensor(k, v) for k, v in inputs.items()}
        self.sender = FakeSender()

    def get_response_sender(self):
        return self.sender


@pytest.fixture
def pb_utils(monkeypatch):
    module = types.ModuleType("triton_python_backend_utils")
    module.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    module.Tensor = FakeTensor
    module.TritonError = lambda message: ("error", message)
    module.InferenceResponse = lambda output_tensors, error=None: types.SimpleNamespace(
        outputs={t.name(): t.as_numpy() for t in output_tensors}, error=error)
    module.get_input_tensor_by_name = lambda request, name: request.inputs.get(name)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", module)
    return module


@pytest.fixture
def model(built, pb_utils):
    model_dir = built.engine.triton_dir / "dflash"
    spec = importlib.util.spec_from_file_location("dflash_triton_model", model_dir / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    instance = module.TritonPythonModel()
    parameters = {"engine_dir": {"string_value": "../.."}, "backend": {"string_value": "reference"}}
    instance.initialize({"model_config": json.dumps({"parameters": parameters}),
                         "model_repository": str(model_dir)})
    return instance


def test_streaming_request_matches_the_baseline(built, model):
    prompt = [72, 101, 108, 108, 111]
    request = FakeRequest(input_ids=np.array(prompt, dtype=np.int32), streaming=np.array([True]),
                          sampling_param_max_tokens=np.array([12], dtype=np.int32))
    model.execute([request])
    sent = request.sender.sent
    assert [flags for _, flags in sent] == [0] * (len(sent) - 1) + [1] and len(sent) > 2
    ids = [int(t) for response, _ in sent[:-1] for t in response.outputs["output_ids"]]
    runtime = reference_runtime(built.engine, torch.device("cpu"), torch.float32, with_drafter=False)
    [baseline] = runtime.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=(256,)))
    assert ids == baseline.output_token_ids
    final = sent[-1][0].outputs
    assert final["total_draft_tokens"][0] > 0 and 0 <= final["acceptance_rate"][0] <= 1
    assert final["acceptance_length"][0] >= 1 and final["finish_reason"][0] in (b"length", b"stop")
    text = b"".join(response.outputs["text_output"][0] for response, _ in sent[:-1]).decode()
    assert text == model.service.tokenizer.decode(ids)


def test_text_request_without_streaming(model):
    request = FakeRequest(text_input=np.array([b"Hello"], dtype=object),
                          sampling_param_max_tokens=np.array([6], dtype=np.int32))
    model.execute([request])
    [(response, flags)] = request.sender.sent
    assert flags == 1 and response.error is None
    ids = response.outputs["output_ids"].tolist()
    assert 1 <= len(ids) <= 6
    assert response.outputs["text_output"][0].decode() == model.service.tokenizer.decode(ids)


def test_bad_request_gets_an_error_response(model):
    request = FakeRequest(sampling_param_max_tokens=np.array([6], dtype=np.int32))
    model.execute([request])
    [(response, flags)] = request.sender.sent
    assert flags == 1 and "text_input" in response.error[1]


def test_malformed_requests_get_error_responses_and_the_batch_goes_on(model, monkeypatch):
    prompt = np.array([72, 101, 108], dtype=np.int32)
    few = np.array([3], dtype=np.int32)
    bad = [
        (dict(text_input=np.array([b"\xff\xfe\x80"], dtype=object)), "text_input", "UTF-8 text"),
        (dict(input_ids=np.array([1.5, 2.0], dtype=np.float32)), "input_ids", "integer token ids"),
        (dict(input_ids=np.array([[72, 101]], dtype=np.int32)), "input_ids", "1-D"),
        (dict(input_ids=prompt, sampling_param_temperature=np.array([b"abc"], dtype=object)),
         "sampling_param_temperature", "a number"),
        (dict(input_ids=prompt, streaming=np.array([b"false"], dtype=object)), "streaming", "a boolean"),
        (dict(input_ids=prompt, sampling_param_top_p=np.array([0.5, 0.9], dtype=np.float32)),
         "sampling_param_top_p", "one value"),
    ]
    requests = [FakeRequest(sampling_param_max_tokens=few, **inputs) for inputs, _, _ in bad]
    requests.append(FakeRequest(input_ids=prompt, sampling_param_max_tokens=few))
    model.execute(requests)
    for request, (_, field, message) in zip(requests, bad):
        [(response, flags)] = request.sender.sent
        assert flags == 1 and field in response.error[1] and message in response.error[1], response.error
    [(response, flags)] = requests[-1].sender.sent  # the good request after them is still answered
    assert flags == 1 and response.error is None and len(response.outputs["output_ids"]) >= 1

    def crash(*args, **kwargs):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(model.service.runtime, "generate", crash)
    request = FakeRequest(input_ids=prompt, sampling_param_max_tokens=few)
    model.execute([request])
    [(response, flags)] = request.sender.sent
    assert flags == 1 and response.error == ("error", "internal error: RuntimeError: CUDA out of memory")


def test_a_tiny_temperature_samples_the_argmax_instead_of_nan(model):
    prompt = np.array([72, 101, 108, 108, 111], dtype=np.int32)
    outputs = {}
    for temperature in (0.0, 1e-45, 1e-38):
        request = FakeRequest(input_ids=prompt, sampling_param_max_tokens=np.array([6], dtype=np.int32),
                              sampling_param_temperature=np.array([temperature], dtype=np.float32))
        model.execute([request])
        [(response, _)] = request.sender.sent
        outputs[temperature] = response.outputs["output_ids"].tolist()
    assert outputs[1e-45] == outputs[1e-38] == outputs[0.0]
