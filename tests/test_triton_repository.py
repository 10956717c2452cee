"""The Triton model repository: config.pbtxt against Triton's ModelConfig schema and the upstream
llmapi interface, model.yaml, and the Python-backend model driven through a stubbed
`triton_python_backend_utils` (no server here; tests/test_triton_server.py runs a real one)."""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import time
import types

import numpy as np
import pytest
import torch
import yaml

from trtllm_dflash.engine.build import build_engine
from trtllm_dflash.engine.plan import BuildOptions
from trtllm_dflash.engine.load import reference_runtime
from trtllm_dflash.engine.options import LlmApiOptions
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.triton.llmapi import INPUT_NAMES, OUTPUTS


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


# The upstream llmapi model's tensors (NVIDIA/TensorRT-LLM triton_backend/all_models/llmapi/tensorrt_llm/
# config.pbtxt @ 0a71057, helpers.py @ 0df60f9; beam_width from tensorrtllm_backend @ c1e1963), written
# out here so that dropping or retyping one fails this test.
UPSTREAM_INPUTS = {
    "text_input": ("TYPE_STRING", [-1]), "image_url": ("TYPE_STRING", [-1]), "streaming": ("TYPE_BOOL", [1]),
    "sampling_param_best_of": ("TYPE_INT32", [1]), "sampling_param_beam_width": ("TYPE_INT32", [1]),
    "sampling_param_temperature": ("TYPE_FP32", [1]), "sampling_param_top_k": ("TYPE_INT32", [1]),
    "sampling_param_top_p": ("TYPE_FP32", [1]), "sampling_param_frequency_penalty": ("TYPE_FP32", [1]),
    "sampling_param_presence_penalty": ("TYPE_FP32", [1]), "sampling_param_max_tokens": ("TYPE_INT32", [1]),
    "sampling_param_stop": ("TYPE_STRING", [-1]), "sampling_param_seed": ("TYPE_UINT64", [1]),
    "sampling_param_exclude_input_from_output": ("TYPE_BOOL", [1]),
    "sampling_param_return_perf_metrics": ("TYPE_BOOL", [1]),
    "sampling_param_logits_post_processor_name": ("TYPE_STRING", [1]),
    "return_finish_reason": ("TYPE_BOOL", [1]), "return_stop_reason": ("TYPE_BOOL", [1]),
    "return_cumulative_logprob": ("TYPE_BOOL", [1]), "stop": ("TYPE_BOOL", [1]),
    "lora_id": ("TYPE_UINT64", [1]), "lora_name": ("TYPE_STRING", [1]), "lora_path": ("TYPE_STRING", [1]),
    "lora_ckpt_source": ("TYPE_STRING", [1]),
}
UPSTREAM_OUTPUTS = {
    "text_output": ("TYPE_STRING", [-1]), "finish_reason": ("TYPE_STRING", [-1]),
    "stop_reason": ("TYPE_STRING", [-1]), "arrival_time_ns": ("TYPE_INT64", [1]),
    "first_scheduled_time_ns": ("TYPE_INT64", [1]), "first_token_time_ns": ("TYPE_INT64", [1]),
    "last_token_time_ns": ("TYPE_INT64", [1]), "acceptance_rate": ("TYPE_FP32", [1]),
    "total_accepted_draft_tokens": ("TYPE_INT32", [1]), "total_draft_tokens": ("TYPE_INT32", [1]),
}
NOT_PRODUCED = ("cumulative_logprob", "kv_cache_reused_block", "kv_cache_missed_block", "kv_cache_alloc_new_blocks",
                "kv_cache_alloc_total_blocks", "kv_cache_hit_rate")


def test_config_accepts_the_upstream_llmapi_interface(built):
    from google.protobuf import text_format

    schema = triton_schema()
    config = text_format.Parse((built.engine.triton_dir / "dflash" / "config.pbtxt").read_text(), schema.ModelConfig())
    dtype = schema.DataType.Name
    inputs = {i.name: (dtype(i.data_type), list(i.dims)) for i in config.input}
    outputs = {o.name: (dtype(o.data_type), list(o.dims)) for o in config.output}
    assert {name: inputs.get(name) for name in UPSTREAM_INPUTS} == UPSTREAM_INPUTS
    assert {name: outputs.get(name) for name in UPSTREAM_OUTPUTS} == UPSTREAM_OUTPUTS
    assert inputs["input_ids"] == ("TYPE_INT32", [-1]) and outputs["output_ids"] == ("TYPE_INT32", [-1])
    assert not set(NOT_PRODUCED) & set(outputs)  # no numbers for them: not declared, so asking for one fails


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
        self.sent, self.finished = [], threading.Event()

    def send(self, response, flags=0):
        self.sent.append((response, flags))
        if flags:
            self.finished.set()


class FakeRequest:
    def __init__(self, request_id="", parameters="{}", **inputs):
        self.inputs = {k: FakeTensor(k, v) for k, v in inputs.items()}
        self.sender, self.cancelled, self.id, self.params = FakeSender(), False, request_id, parameters

    def get_response_sender(self):
        return self.sender

    def is_cancelled(self):
        return self.cancelled

    def request_id(self):
        return self.id

    def parameters(self):
        return self.params

    def responses(self, timeout=60):
        """Everything sent, once the final response is (the model answers from its worker thread)."""
        assert self.sender.finished.wait(timeout), "no final response"
        return self.sender.sent


@pytest.fixture
def pb_utils(monkeypatch):
    module = types.ModuleType("triton_python_backend_utils")
    module.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    class TritonError:
        CANCELLED = 7

        def __init__(self, message, code=None):
            self.message, self.code = message, code

    module.Tensor = FakeTensor
    module.TritonError = TritonError
    module.InferenceResponse = lambda output_tensors, error=None: types.SimpleNamespace(
        outputs={t.name(): t.as_numpy() for t in output_tensors}, error=error)
    module.get_input_tensor_by_name = lambda request, name: request.inputs.get(name)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", module)
    return module


def load_model(built, **parameters):
    """The engine's model.py, initialized as Triton would with config.pbtxt `parameters` (strings) beside the
    engine directory and the reference backend."""
    model_dir = built.engine.triton_dir / "dflash"
    spec = importlib.util.spec_from_file_location("dflash_triton_model", model_dir / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    instance = module.TritonPythonModel()
    values = {"engine_dir": "../..", "backend": "reference", **parameters}
    instance.initialize({"model_config": json.dumps({"parameters": {k: {"string_value": v} for k, v in values.items()}}),
                         "model_repository": str(model_dir)})
    return instance


@pytest.fixture
def model(built, pb_utils):
    instance = load_model(built)
    yield instance
    instance.finalize()


def joined(sent, name="output_ids"):
    """A streamed output concatenated over every response (ids) or joined (text)."""
    if name == "text_output":
        return b"".join(r.outputs[name][0] for r, _ in sent if name in r.outputs).decode()
    return [int(t) for r, _ in sent if name in r.outputs for t in r.outputs[name]]


def baseline_ids(built, prompt, max_tokens):
    runtime = reference_runtime(built.engine, torch.device("cpu"), torch.float32, draft_method=None)
    [baseline] = runtime.generate([prompt], SamplingParams(max_tokens=max_tokens, stop_token_ids=(256,)))
    return baseline.output_token_ids


PROMPT = [72, 101, 108, 108, 111]


def ids(values):
    return np.array(values, dtype=np.int32)


def request(max_tokens=12, **inputs):
    inputs.setdefault("input_ids", ids(PROMPT))
    return FakeRequest(sampling_param_max_tokens=ids([max_tokens]), **inputs)


def test_streaming_request_matches_the_baseline(built, model):
    streamed = request(streaming=np.array([True]))
    model.execute([streamed])
    sent = streamed.responses()
    # the first response at once, then deltas (merged while the sender is busy) and the final
    assert [flags for _, flags in sent] == [0] * (len(sent) - 1) + [1] and len(sent) >= 2
    assert joined(sent) == baseline_ids(built, PROMPT, 12)
    final = sent[-1][0].outputs
    assert final["total_draft_tokens"][0] > 0 and 0 <= final["acceptance_rate"][0] <= 1
    assert final["acceptance_length"][0] >= 1 and final["finish_reason"][0] in (b"length", b"stop")
    assert joined(sent, "text_output") == model.service.tokenizer.decode(joined(sent))


def test_text_request_without_streaming(model):
    text = FakeRequest(text_input=np.array([b"Hello"], dtype=object), sampling_param_max_tokens=ids([6]))
    model.execute([text])
    [(response, flags)] = text.responses()
    assert flags == 1 and response.error is None
    out = response.outputs["output_ids"].tolist()
    assert 1 <= len(out) <= 6
    assert response.outputs["text_output"][0].decode() == model.service.tokenizer.decode(out)


def test_bad_request_gets_an_error_response(model):
    missing = FakeRequest(sampling_param_max_tokens=ids([6]))
    model.execute([missing])
    [(response, flags)] = missing.responses()
    assert flags == 1 and "text_input" in response.error.message


def test_malformed_requests_get_error_responses_and_the_batch_goes_on(model, monkeypatch):
    prompt, few = ids([72, 101, 108]), ids([3])
    bad = [
        (dict(text_input=np.array([b"\xff\xfe\x80"], dtype=object)), "text_input", "UTF-8 text"),
        (dict(text_input=np.array([b"a", b"b"], dtype=object)), "text_input", "one prompt per request"),
        (dict(input_ids=np.array([1.5, 2.0], dtype=np.float32)), "input_ids", "integer token ids"),
        (dict(input_ids=np.array([[72, 101]], dtype=np.int32)), "input_ids", "1-D"),
        (dict(input_ids=ids([72, 10**6])), "input_ids", "outside"),
        (dict(input_ids=prompt, sampling_param_temperature=np.array([b"abc"], dtype=object)),
         "sampling_param_temperature", "a number"),
        (dict(input_ids=prompt, sampling_param_temperature=np.array([-1.0], dtype=np.float32)),
         "sampling_param_temperature", ">= 0"),
        (dict(input_ids=prompt, streaming=np.array([b"false"], dtype=object)), "streaming", "a boolean"),
        (dict(input_ids=prompt, sampling_param_top_p=np.array([0.5, 0.9], dtype=np.float32)),
         "sampling_param_top_p", "one value"),
        (dict(input_ids=prompt, sampling_param_stop=np.array([b""], dtype=object)), "sampling_param_stop", "empty"),
    ]
    requests = [FakeRequest(sampling_param_max_tokens=few, **inputs) for inputs, _, _ in bad]
    requests.append(FakeRequest(input_ids=prompt, sampling_param_max_tokens=ids([10**6])))
    bad.append((None, "sampling_param_max_tokens", "exceeds"))
    requests.append(FakeRequest(input_ids=prompt, sampling_param_max_tokens=few))
    model.execute(requests)
    for req, (_, field, message) in zip(requests, bad):
        [(response, flags)] = req.responses()
        assert flags == 1 and field in response.error.message and message in response.error.message, \
            response.error.message
    [(response, flags)] = requests[-1].responses()  # the good request after them is still answered
    assert flags == 1 and response.error is None and len(response.outputs["output_ids"]) >= 1

    def crash(*args, **kwargs):
        raise RuntimeError("CUDA out of memory")

    # the batch ends a step after its last answer; a request sent before that would join it (in-flight batching)
    deadline = time.monotonic() + 30
    while model.scheduler.running and time.monotonic() < deadline:
        time.sleep(0.01)
    monkeypatch.setattr(model.service.runtime, "generate", crash)
    failing = FakeRequest(input_ids=prompt, sampling_param_max_tokens=few)
    model.execute([failing])
    [(response, flags)] = failing.responses()
    assert flags == 1 and response.error.message == "internal error: RuntimeError: CUDA out of memory"


@pytest.mark.parametrize("field, value, neutral", [
    ("sampling_param_presence_penalty", np.array([0.5], np.float32), np.array([0.0], np.float32)),
    ("sampling_param_frequency_penalty", np.array([0.1], np.float32), np.array([0.0], np.float32)),
    ("sampling_param_best_of", ids([2]), ids([1])),
    ("sampling_param_beam_width", ids([4]), ids([1])),
    ("return_cumulative_logprob", np.array([True]), np.array([False])),
    ("sampling_param_logits_post_processor_name", np.array([b"mine"], dtype=object), np.array([b""], dtype=object)),
    ("image_url", np.array([b"http://example.com/cat.png"], dtype=object), None),
    ("lora_name", np.array([b"adapter"], dtype=object), None),
])
def test_upstream_fields_we_cannot_honour_are_refused_by_name(model, field, value, neutral):
    refused = request(3, **{field: value})
    model.execute([refused])
    [(response, _)] = refused.responses()
    assert field in response.error.message and "cannot be honoured" in response.error.message
    if neutral is not None:  # the value that asks for nothing is accepted
        accepted = request(3, **{field: neutral})
        model.execute([accepted])
        assert accepted.responses()[-1][0].error is None


def test_unknown_request_parameters_are_refused(model):
    unknown = request(3, parameters=json.dumps({"bogus": 1}))
    model.execute([unknown])
    [(response, _)] = unknown.responses()
    assert "bogus" in response.error.message and "not an input" in response.error.message


def test_concurrent_requests_run_as_one_batch_each_with_its_own_limit(built, model, monkeypatch):
    sizes = []
    generate = model.service.runtime.generate
    monkeypatch.setattr(model.service.runtime, "generate",
                        lambda prompts, *args, **kwargs: sizes.append(len(prompts)) or generate(prompts, *args, **kwargs))
    prompts = [PROMPT, [87, 111, 114, 108, 100], [84, 104, 101], PROMPT]
    limits = [5, 12, 8, 2]
    requests = [request(n, input_ids=ids(p), streaming=np.array([i % 2 == 0])) for i, (p, n) in
                enumerate(zip(prompts, limits))]
    with model.scheduler.wake:  # hold the worker back until all four have arrived
        model.execute(requests)
    for req, prompt, limit in zip(requests, prompts, limits):
        assert joined(req.responses()) == baseline_ids(built, prompt, limit)
    assert sizes == [4]


def test_stop_strings_end_the_text_before_them(built, model):
    text = model.service.tokenizer.decode(baseline_ids(built, PROMPT, 12))
    stop = text[5:7]
    expected = text[: text.find(stop)]
    for streaming in (False, True):
        stopped = request(12, sampling_param_stop=np.array([stop.encode(), b"never"], dtype=object),
                          return_stop_reason=np.array([True]), streaming=np.array([streaming]))
        model.execute([stopped])
        sent = stopped.responses()
        final = sent[-1][0].outputs
        assert joined(sent, "text_output") == expected
        assert final["finish_reason"][0] == b"stop" and final["stop_reason"][0] == stop.encode()


def test_echo_and_perf_metrics(model):
    echoed = FakeRequest(text_input=np.array([b"Hello"], dtype=object), sampling_param_max_tokens=ids([4]),
                         sampling_param_exclude_input_from_output=np.array([False]),
                         sampling_param_return_perf_metrics=np.array([True]))
    model.execute([echoed])
    [(response, _)] = echoed.responses()
    out = response.outputs
    assert out["text_output"][0].decode().startswith("Hello")
    times = [int(out[name][0]) for name in
             ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")]
    assert times == sorted(times) and times[0] > 0


def test_a_cancelled_request_stops_generating(model, monkeypatch):
    from trtllm_dflash.triton.service import Job

    monkeypatch.setattr(Job, "CHECK_EVERY_S", 0.0)
    generate, results = model.service.runtime.generate, []
    monkeypatch.setattr(model.service.runtime, "generate",
                        lambda *args, **kwargs: results.extend(generate(*args, **kwargs)) or results)
    cancelled = request(400, streaming=np.array([True]))
    send = cancelled.sender.send

    def send_then_cancel(response, flags=0):  # the client goes away after the first streamed tokens
        send(response, flags)
        cancelled.cancelled = True

    cancelled.sender.send = send_then_cancel
    model.execute([cancelled])
    sent = cancelled.responses()
    final = sent[-1][0]
    assert final.error is not None and final.error.code == 7 and "cancelled" in final.error.message
    # one response (the steps decoded while the sender started, merged), then only the cancellation
    assert len(sent) == 2 and 0 < len(joined(sent)) < 400
    [result] = results  # the loop dropped the request at a step soon after the client went away
    assert result.finish_reason == "cancelled" and len(result.output_token_ids) < 400


def test_a_stop_request_cancels_requests_with_its_id(model):
    running = request(12, request_id="job-1")
    stopper = FakeRequest(request_id="job-1", stop=np.array([True]))
    with model.scheduler.wake:
        model.execute([running, stopper])
    for req in (running, stopper):
        [(response, _)] = req.responses()
        assert response.error.code == 7


def test_the_runtime_drops_a_cancelled_request_at_the_next_step(built):
    runtime = reference_runtime(built.engine, torch.device("cpu"), torch.float32)
    params = SamplingParams(max_tokens=10, stop_token_ids=(256,))
    first, second = runtime.generate([PROMPT, [84, 104, 101]], params, 2, cancelled=lambda i: i == 0)
    assert first.finish_reason == "cancelled" and len(first.output_token_ids) == 1  # only the prefill token
    assert second.output_token_ids == baseline_ids(built, [84, 104, 101], 10)


def test_a_tiny_temperature_samples_the_argmax_instead_of_nan(model):
    outputs = {}
    for temperature in (0.0, 1e-45, 1e-38):
        tiny = request(6, sampling_param_temperature=np.array([temperature], dtype=np.float32))
        model.execute([tiny])
        [(response, _)] = tiny.responses()
        outputs[temperature] = response.outputs["output_ids"].tolist()
    assert outputs[1e-45] == outputs[1e-38] == outputs[0.0]


def test_take_batch_keeps_arrival_order_and_runs_sampled_requests_alone():
    from collections import deque

    from trtllm_dflash.triton.llmapi import RequestSpec
    from trtllm_dflash.triton.scheduler import take_batch
    from trtllm_dflash.triton.service import Job

    def job(name, temperature=0.0):
        return Job(RequestSpec(None, [1], SamplingParams(temperature=temperature)), [1], None, None, request_id=name)

    queue = deque([job("g1"), job("s1", 0.7), job("g2"), job("g3"), job("g4")])
    assert [j.request_id for j in take_batch(queue, 3)] == ["g1", "g2", "g3"]
    assert [j.request_id for j in take_batch(queue, 3)] == ["s1"]
    assert [j.request_id for j in take_batch(queue, 3)] == ["g4"] and not queue


def arriving_during_the_first_call(model, monkeypatch, late):
    """Wrap the runtime's `generate`: the `late` requests arrive right after the first call's first streamed tokens
    (as clients do while a batch runs). -> the prompt count of each call."""
    calls = []
    generate = model.service.runtime.generate

    def wrapped(prompts, params, batch_size, on_tokens, **hooks):
        calls.append(len(prompts))
        sent = []

        def arrive_then_stream(request, tokens):
            if len(calls) == 1 and not sent:
                sent.append(True)
                model.execute(late)
            on_tokens(request, tokens)

        return generate(prompts, params, batch_size, arrive_then_stream, **hooks)

    monkeypatch.setattr(model.service.runtime, "generate", wrapped)
    return calls


def test_requests_arriving_mid_batch_join_it_at_the_next_step(built, model, monkeypatch):
    """In-flight batching: two requests that arrive while the first decodes join its `generate` call; each gets the
    target's own tokens within its own limit."""
    first = request(30, streaming=np.array([True]))
    late = [request(12, input_ids=ids([87, 111, 114, 108, 100])), request(5, input_ids=ids([84, 104, 101]))]
    calls = arriving_during_the_first_call(model, monkeypatch, late)
    model.execute([first])
    assert joined(first.responses()) == baseline_ids(built, PROMPT, 30)
    for req, prompt, limit in zip(late, ([87, 111, 114, 108, 100], [84, 104, 101]), (12, 5)):
        assert joined(req.responses()) == baseline_ids(built, prompt, limit)
    assert calls == [1]  # one call: the late requests joined it


def test_a_request_that_does_not_fit_the_running_batch_leads_the_next(built, model, monkeypatch):
    """More tokens than the running batch decodes, or sampling: such a request waits for the batch to end, and so
    does every request behind it (first come, first served; the next batch is formed by `take_batch`)."""
    first = request(8)
    longer, behind = request(20), request(4)
    sampled = request(6, sampling_param_temperature=np.array([0.7], dtype=np.float32))
    calls = arriving_during_the_first_call(model, monkeypatch, [longer, sampled, behind])
    model.execute([first])
    assert joined(first.responses()) == baseline_ids(built, PROMPT, 8)
    assert joined(longer.responses()) == baseline_ids(built, PROMPT, 20)
    assert joined(behind.responses()) == baseline_ids(built, PROMPT, 4)
    assert len(joined(sampled.responses())) == 6
    assert calls == [1, 2, 1]  # the next batch takes the greedy ones (`take_batch`), the sampled one runs alone


def test_take_joining_takes_from_the_front_while_each_fits():
    from collections import deque

    from trtllm_dflash.triton.llmapi import RequestSpec
    from trtllm_dflash.triton.scheduler import take_joining
    from trtllm_dflash.triton.service import Job

    def job(name, max_tokens):
        return Job(RequestSpec(None, [1], SamplingParams(max_tokens=max_tokens)), [1], None, None, request_id=name)

    queue = deque([job("a", 4), job("b", 8), job("c", 30), job("d", 4)])
    def fits(j):
        return j.spec.params.max_tokens <= 10
    assert [j.request_id for j in take_joining(queue, 1, fits)] == ["a"]
    assert [j.request_id for j in take_joining(queue, 5, fits)] == ["b"]  # c does not fit: d waits behind it
    assert [j.request_id for j in queue] == ["c", "d"]


def test_a_closing_scheduler_admits_nobody_and_answers_who_waits():
    from trtllm_dflash.triton.llmapi import RequestSpec
    from trtllm_dflash.triton.scheduler import BatchScheduler
    from trtllm_dflash.triton.service import Job

    failed = []
    job = Job(RequestSpec(None, [1], SamplingParams()), [1], None, lambda message, cancelled: failed.append(message))
    scheduler = BatchScheduler(lambda jobs, admit: None, 4)
    with scheduler.wake:  # the worker waits for this lock: it sees the queue only once closing is set
        scheduler.closing = True
        scheduler.queue.append(job)
        assert scheduler.admit(4, lambda j: True) == []
        scheduler.wake.notify()
    scheduler.worker.join(10)
    assert not scheduler.worker.is_alive() and failed == ["the model is shutting down"]


def test_streaming_holds_back_what_a_stop_string_or_utf8_may_still_change():
    from trtllm_dflash.triton.service import held_back

    assert held_back("the end", ("ending",)) == 3 and held_back("the end", ("xyz",)) == 0
    assert held_back("caf\ufffd", ()) == 1
    assert held_back("1\ufffd", ("1\u00e9",)) == 2  # half of the stop string's second character, and its first


def test_the_stream_interval_is_the_engine_s_unless_dflash_serve_sets_one(built, monkeypatch):
    """config.pbtxt carries `stream_interval` only when dflash-serve sets one; otherwise the service takes the
    engine's LLM API option (the GPU profiles' 20), else 1."""
    from trtllm_dflash.engine.manifest import Engine
    from trtllm_dflash.triton.repository import ModelParameters, render_config
    from trtllm_dflash.triton.service import DFlashService

    assert "stream_interval" not in render_config("engine")
    assert 'key: "stream_interval"\n  value: { string_value: "4" }' in render_config("engine", run=ModelParameters(
        stream_interval=4))
    options = built.engine.llm_api_options()
    monkeypatch.setattr(Engine, "llm_api_options", lambda self: options.model_copy(update={"stream_interval": 20}))
    services = [DFlashService.from_engine(built.engine.root, "reference", device="cpu", stream_interval=interval,
                                          draft_length="fixed") for interval in (None, 3)]
    assert [service.stream_interval for service in services] == [20, 3]
    for service in services:
        service.close()


def test_the_served_drafts_follow_the_adaptive_policy_priced_per_live_batch(model):
    """dflash-serve's default: dflash-run's adaptive policy, with step costs measured at 1, 2, 4 and 8 rows (the
    engine's max batch size) and a step priced by its live rows' table."""
    proposer = model.service.runtime.proposer
    assert proposer.policy is not None and list(proposer.cost_tables.tables) == [1, 2, 4, 8]
    neural = [table["neural"] for table in proposer.cost_tables.tables.values()]
    assert neural[-1][-1] > neural[0][-1]  # a full block of 8 rows costs more than one of 1


@pytest.mark.parametrize("method,proposer,adaptive", [("ngram", "NGramProposer", False),
                                                      ("dflash", "DFlashProposer", True),
                                                      ("dflash-sa", "SuffixDFlashProposer", True)])
def test_each_draft_method_serves_the_baseline_s_tokens(built, pb_utils, method, proposer, adaptive):
    """dflash-serve --draft-method: the n-gram baseline (a fixed block) and DFlash alone serve as dflash-sa does, the
    baseline's tokens in one in-flight batch; DFlash's adaptive drafts are priced per live batch like dflash-sa's."""
    served = load_model(built, draft_method=method)
    try:
        runtime = served.service.runtime
        assert type(runtime.proposer).__name__ == proposer and runtime.inflight
        tables = getattr(runtime.proposer, "cost_tables", None)
        assert (runtime.proposer.policy is not None and list(tables.tables) == [1, 2, 4, 8]) if adaptive else \
            runtime.proposer.num_drafts == built.engine.llm_api_options().speculative_config.max_draft_len
        prompts, limits = [PROMPT, [87, 111, 114, 108, 100], [84, 104, 101]], [12, 9, 7]
        requests = [request(n, input_ids=ids(p), streaming=np.array([True])) for p, n in zip(prompts, limits)]
        with served.scheduler.wake:  # all three in one batch
            served.execute(requests)
        for req, prompt, limit in zip(requests, prompts, limits):
            sent = req.responses()
            assert joined(sent) == baseline_ids(built, prompt, limit)
            # a fixed block drafts every step; the adaptive policy may choose plain steps throughout on this pair
            assert adaptive or sent[-1][0].outputs["total_draft_tokens"][0] > 0
    finally:
        served.finalize()


def test_a_draft_method_is_written_to_config_pbtxt_only_when_set_and_refused_where_it_cannot_run(built, pb_utils):
    from trtllm_dflash.errors import InputError
    from trtllm_dflash.triton.repository import ModelParameters, render_config
    from trtllm_dflash.triton.service import DFlashService

    assert "draft_method" not in render_config("engine") and "draft_length" not in render_config("engine")
    assert 'key: "draft_method"\n  value: { string_value: "ngram" }' in render_config(
        "engine", run=ModelParameters(draft_method="ngram"))
    with pytest.raises(InputError, match="adaptive draft length .* not of ngram") as raised:
        DFlashService.from_engine(built.engine.root, "reference", device="cpu", draft_method="ngram",
                                  draft_length="adaptive")
    assert raised.value.field == "draft_length"
    with pytest.raises(InputError, match="draft method dflash runs on the reference backend") as raised:
        DFlashService.from_engine(built.engine.root, "trtllm", device="cpu", draft_method="dflash")
    assert raised.value.field == "backend"
