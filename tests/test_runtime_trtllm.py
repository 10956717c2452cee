"""The TensorRT-LLM runtime: pure mappings with plain data, a CPU run against a fake `tensorrt_llm`,
and a GPU test that runs only where TensorRT-LLM and a GPU are present.

The fakes are shaped after the names read in NVIDIA/TensorRT-LLM:
  tensorrt_llm/executor/result.py      CompletionOutput.token_ids / finish_reason / request_perf_metrics,
                                       GenerationResultBase.decoding_iter / avg_decoded_tokens_per_iter
  tensorrt_llm/serve/perf_metrics.py   request_perf_metrics.speculative_decoding.{acceptance_rate,
                                       total_accepted_draft_tokens, total_draft_tokens},
                                       .timing_metrics.{arrival_time, first_scheduled_time,
                                       first_token_time, last_token_time} (timedeltas)
  tensorrt_llm/sampling_params.py      SamplingParams fields
  tensorrt_llm/llmapi/llm_args.py      DFlashDecodingConfig, TorchLlmArgs, return_perf_metrics
  tensorrt_llm/llmapi/llm.py           LLM.generate_async(inputs, sampling_params=, streaming=), shutdown()
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
import types
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from trtllm_dflash.errors import InputError, MissingDependencyError
from trtllm_dflash.runtime import trtllm as rt
from trtllm_dflash.runtime import trtllm_stats
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.runtime.stats import GenerationResult, RequestStats, total_stats


# ----------------------------------------------------------------------------- engine dirs

def make_engine(root: Path, spec: dict | None = None, block_size: int = 10, **extra) -> Path:
    engine = root / "engine"
    (engine / "target").mkdir(parents=True)
    (engine / "drafter").mkdir()
    (engine / "drafter" / "config.json").write_text(json.dumps({"block_size": block_size}))
    options = {"speculative_config": spec if spec is not None else
               {"decoding_type": "DFlash", "max_draft_len": 9, "speculative_model": "drafter"},
               "max_seq_len": 8192, "kv_cache_config": {"enable_block_reuse": False, "free_gpu_memory_fraction": 0.8},
               **extra}
    (engine / "llm_api_options.yaml").write_text(yaml.safe_dump(options))
    (engine / "manifest.json").write_text("{}")
    return engine


# ----------------------------------------------------------------------------- versions

@pytest.mark.parametrize("text, expected", [
    ("1.3.0rc11", (1, 3, 0, 3, 11, 0)),
    ("1.4.0rc1", (1, 4, 0, 3, 1, 0)),
    ("1.2.1", (1, 2, 1, 4, 0, 0)),
    ("1.3.0rc5.post1", (1, 3, 0, 3, 5, 1)),
    ("1.3.0.dev2026041500", (1, 3, 0, 0, 2026041500, 0)),
    ("1.3.0+gabc123", (1, 3, 0, 4, 0, 0)),
])
def test_parse_version(text, expected):
    assert rt.parse_version(text) == expected


def test_version_order():
    order = ["1.2.1", "1.3.0.dev1", "1.3.0rc0", "1.3.0rc9", "1.3.0rc11", "1.3.0rc27", "1.3.0", "1.4.0rc1", "1.4.0"]
    assert sorted(order, key=rt.parse_version) == order


def test_parse_version_rejects_garbage():
    with pytest.raises(InputError, match="cannot read TensorRT-LLM version"):
        rt.parse_version("latest")


@pytest.mark.parametrize("old", ["1.0.0", "1.1.0rc5", "1.2.0rc6.post2", "1.2.1", "0.21.0"])
def test_versions_without_dflash_are_refused(old):
    with pytest.raises(MissingDependencyError, match="1.3.0rc series") as info:
        rt.check_version(old)
    assert "NVIDIA's package index" in str(info.value)


def test_version_warnings():
    assert rt.check_version("1.3.0rc27") == []
    assert rt.check_version("1.4.0rc1") == []
    newer, = rt.check_version("1.5.0")
    assert "newer than 1.4.0rc1" in newer


def test_versions_before_the_documented_dflash_release_are_refused():
    """Builds of the 1.3.0rc series before rc27 may have DFlash, but no source we read documents
    their fields: every engine records >= 1.3.0rc27 (engine/trtllm_versions.py)."""
    with pytest.raises(MissingDependencyError, match=r"1\.3\.0rc27.*found 1\.3\.0rc12") as info:
        rt.check_version("1.3.0rc12")
    assert info.value.exit_code == 3 and "dflash" in str(info.value)


# ----------------------------------------------------------------------------- missing dependency

def test_missing_tensorrt_llm_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # makes the import fail
    with pytest.raises(MissingDependencyError) as info:
        rt.import_tensorrt_llm()
    message = str(info.value)
    assert "tensorrt_llm" in message and "trtllm backend" in message
    assert "NVIDIA's package index" in message and "GPU" in message
    assert info.value.exit_code == 3


def test_runtime_without_tensorrt_llm(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)
    with pytest.raises(MissingDependencyError, match="tensorrt_llm"):
        rt.TrtllmRuntime(make_engine(tmp_path))


# ----------------------------------------------------------------------------- LLM kwargs

def test_llm_kwargs_resolves_drafter_and_target(tmp_path):
    engine = make_engine(tmp_path)
    kwargs = rt.llm_kwargs(engine, rt.read_options(engine))
    assert kwargs["model"] == str(engine / "target")
    spec = kwargs["speculative_config"]
    assert spec == {"decoding_type": "DFlash", "max_draft_len": 9,
                    "speculative_model": str((engine / "drafter").resolve())}
    assert kwargs["max_seq_len"] == 8192
    assert "return_perf_metrics" not in kwargs  # only added when the installed LLM args have it


def test_llm_kwargs_overrides_merge_nested(tmp_path):
    engine = make_engine(tmp_path)
    kwargs = rt.llm_kwargs(engine, rt.read_options(engine),
                           {"kv_cache_config": {"dtype": "fp8"}, "tensor_parallel_size": 8})
    assert kwargs["kv_cache_config"] == {"enable_block_reuse": False, "free_gpu_memory_fraction": 0.8, "dtype": "fp8"}
    assert kwargs["tensor_parallel_size"] == 8


def test_llm_kwargs_builds_config_object_and_checks_fields(tmp_path):
    engine = make_engine(tmp_path, extra_key=None)

    class FakeDFlashConfig:  # pydantic-like: model_fields names the accepted keys
        model_fields = {"decoding_type": 0, "max_draft_len": 0, "speculative_model": 0, "mask_token_id": 0}

        def __init__(self, **kw):
            self.kw = kw
            self.max_draft_len = kw["max_draft_len"]

    options = rt.read_options(engine)
    options.pop("extra_key")
    fields = {"model", "speculative_config", "max_seq_len", "kv_cache_config", "return_perf_metrics"}
    kwargs = rt.llm_kwargs(engine, options, spec_config_cls=FakeDFlashConfig, llm_fields=fields)
    assert isinstance(kwargs["speculative_config"], FakeDFlashConfig)
    assert kwargs["speculative_config"].kw["speculative_model"].endswith("drafter")
    assert kwargs["return_perf_metrics"] is True
    assert rt.max_draft_len_of(kwargs) == 9

    with pytest.raises(InputError, match="takes no argument"):
        rt.llm_kwargs(engine, {**options, "not_an_arg": 1}, llm_fields=fields)
    renamed = {**options, "speculative_config": {**options["speculative_config"], "acceptance_window": 8}}
    with pytest.raises(InputError, match="no field.*acceptance_window"):
        rt.llm_kwargs(engine, renamed, spec_config_cls=FakeDFlashConfig)


def test_llm_kwargs_alias_and_hub_id(tmp_path):
    engine = make_engine(tmp_path, spec={"decoding_type": "DFlash", "max_draft_len": 4,
                                         "speculative_model_dir": "z-lab/gpt-oss-120b-DFlash"})
    spec = rt.llm_kwargs(engine, rt.read_options(engine))["speculative_config"]
    assert spec == {"decoding_type": "DFlash", "max_draft_len": 4, "speculative_model": "z-lab/gpt-oss-120b-DFlash"}


def test_llm_kwargs_absolute_drafter(tmp_path):
    other = tmp_path / "elsewhere"
    other.mkdir()
    engine = make_engine(tmp_path, spec={"decoding_type": "DFlash", "max_draft_len": 3,
                                         "speculative_model": str(other)})
    assert rt.llm_kwargs(engine, rt.read_options(engine))["speculative_config"]["speculative_model"] == str(other)


@pytest.mark.parametrize("spec, field", [
    ({"decoding_type": "Eagle3", "max_draft_len": 3, "speculative_model": "drafter"}, "decoding_type"),
    ({"decoding_type": "DFlash", "max_draft_len": 0, "speculative_model": "drafter"}, "max_draft_len"),
    ({"decoding_type": "DFlash", "max_draft_len": 10, "speculative_model": "drafter"}, "max_draft_len"),  # > B-1
    ({"decoding_type": "DFlash", "max_draft_len": 3}, "speculative_model"),
    ({"decoding_type": "DFlash", "max_draft_len": 3, "speculative_model": "missing_drafter"}, "speculative_model"),
    ({"decoding_type": "DFlash", "max_draft_len": 3, "speculative_model": "./missing/x"}, "speculative_model"),
])
def test_llm_kwargs_bad_spec(tmp_path, spec, field):
    engine = make_engine(tmp_path, spec=spec)
    with pytest.raises(InputError) as info:
        rt.llm_kwargs(engine, rt.read_options(engine))
    assert info.value.field == f"speculative_config.{field}"


def test_read_options_errors(tmp_path):
    with pytest.raises(InputError, match="engine directory not found"):
        rt.read_options(tmp_path / "nope")
    with pytest.raises(InputError, match="no llm_api_options.yaml"):
        rt.read_options(tmp_path)
    (tmp_path / "llm_api_options.yaml").write_text("- a\n- b\n")
    with pytest.raises(InputError, match="must be a mapping"):
        rt.read_options(tmp_path)


def test_llm_kwargs_needs_target(tmp_path):
    engine = make_engine(tmp_path)
    (engine / "target").rmdir()
    with pytest.raises(InputError, match="no target/"):
        rt.llm_kwargs(engine, rt.read_options(engine))


# ----------------------------------------------------------------------------- sampling

def test_sampling_kwargs_greedy():
    kwargs = rt.sampling_kwargs(SamplingParams(max_tokens=17, stop_token_ids=(200002, 200012)))
    assert kwargs == {"max_tokens": 17, "seed": 0, "detokenize": False, "return_perf_metrics": True,
                      "ignore_eos": True, "include_stop_str_in_output": True,
                      "stop_token_ids": [200002, 200012], "temperature": 0.0}


def test_sampling_kwargs_sampled():
    kwargs = rt.sampling_kwargs(SamplingParams(temperature=0.7, top_p=0.9, top_k=50, seed=3))
    assert kwargs["temperature"] == 0.7 and kwargs["top_p"] == 0.9 and kwargs["top_k"] == 50 and kwargs["seed"] == 3
    plain = rt.sampling_kwargs(SamplingParams(temperature=1.0))
    assert "top_p" not in plain and "top_k" not in plain and "stop_token_ids" not in plain


def test_sampling_kwargs_fit_trtllm_fields():
    # Field names of tensorrt_llm.SamplingParams as read in tensorrt_llm/sampling_params.py.
    trtllm_fields = {"end_id", "pad_id", "max_tokens", "stop", "stop_token_ids", "include_stop_str_in_output",
                     "n", "best_of", "use_beam_search", "top_k", "top_p", "seed", "temperature", "min_tokens",
                     "logprobs", "return_perf_metrics", "ignore_eos", "detokenize", "skip_special_tokens"}
    kwargs = rt.sampling_kwargs(SamplingParams(temperature=0.5, top_p=0.5, top_k=2, stop_token_ids=(1,)))
    assert set(kwargs) <= trtllm_fields


# ----------------------------------------------------------------------------- streaming deltas

def test_new_tokens():
    assert rt.new_tokens(0, []) == []
    assert rt.new_tokens(0, [5, 6]) == [5, 6]
    assert rt.new_tokens(2, [5, 6, 7, 8]) == [7, 8]
    assert rt.new_tokens(4, [5, 6, 7, 8]) == []
    assert rt.new_tokens(4, [5, 6]) == []  # a trimmed final list reports nothing new


# ----------------------------------------------------------------------------- statistics

def perf_metrics(accepted=0, drafted=0, times=None):
    """Shaped like tensorrt_llm.bindings.executor.RequestPerfMetrics."""
    timing = SimpleNamespace(**{name: timedelta(seconds=t) for name, t in
                                zip(("arrival_time", "first_scheduled_time", "first_token_time", "last_token_time"),
                                    times or (0, 0, 0, 0))})
    spec = SimpleNamespace(total_accepted_draft_tokens=accepted, total_draft_tokens=drafted,
                           acceptance_rate=accepted / drafted if drafted else 0.0)
    return SimpleNamespace(speculative_decoding=spec, timing_metrics=timing, first_iter=0, last_iter=0, iter=0)


def test_stats_from_draft_totals():
    # K = 3 drafts per step, 5 steps -> 15 drafted, 9 accepted; 1 + 9 + 5 = 15 output tokens.
    stats = trtllm_stats.request_stats_from_metrics(perf_metrics(9, 15, (10.0, 10.5, 11.0, 13.0)), 15, block_size=4)
    assert stats.source == "draft_tokens"
    assert stats.steps == 5 and stats.total_accepted_drafts == 9
    assert stats.acceptance_length == pytest.approx(14 / 5)
    assert stats.draft_acceptance_rate == pytest.approx(0.6)
    assert stats.per_position_acceptance == [] and stats.accepted_histogram == [0, 0, 0, 0]
    assert stats.prefill_time == pytest.approx(0.5) and stats.decode_time == pytest.approx(2.0)
    record = stats.to_dict()
    assert record["acceptance_histogram"] is None and record["per_position_acceptance"] is None
    assert record["steps"] == 5 and record["steps_source"] == "draft_tokens"


def test_stats_from_output_tokens_when_drafts_vary():
    # 14 drafted is not a multiple of K = 3 (a draft_len_schedule cut back): steps from tokens.
    stats = trtllm_stats.request_stats_from_metrics(perf_metrics(9, 14), 15, block_size=4, wall_times=(0.1, 0.9))
    assert stats.source == "output_tokens" and stats.steps == 15 - 1 - 9
    assert (stats.prefill_time, stats.decode_time) == (0.1, 0.9)  # timing metrics unset -> wall clock


def test_stats_dict_shaped_metrics_and_decoding_iter_fallback():
    zeroed = {"speculative_decoding": {"total_accepted_draft_tokens": 0, "total_draft_tokens": 0}}
    stats = trtllm_stats.request_stats_from_metrics(zeroed, 21, block_size=10, decoding_iter=6)
    assert stats.source == "decoding_iter" and stats.steps == 5 and stats.total_accepted_drafts == 15
    assert stats.acceptance_length == pytest.approx(4.0)


def test_stats_without_anything_reports_no_steps():
    stats = trtllm_stats.request_stats_from_metrics(None, 12, block_size=10)
    assert stats.source == "none" and stats.steps == 0 and stats.acceptance_length == 0.0
    assert stats.num_output_tokens == 12


def test_totals_aggregate():
    a = trtllm_stats.request_stats_from_metrics(perf_metrics(9, 15, (100, 100, 101, 103)), 15, block_size=4)
    b = trtllm_stats.request_stats_from_metrics(perf_metrics(3, 6, (100, 100, 102, 103)), 6, block_size=4)
    results = [GenerationResult([1], [0] * 15, "length", a), GenerationResult([1], [0] * 6, "length", b)]
    total = total_stats(results, batch_size=2)
    assert total.steps == 7 and total.total_accepted_drafts == 12 and total.num_output_tokens == 21
    assert total.acceptance_length == pytest.approx(19 / 7)
    assert total.prefill_time == pytest.approx(2.0) and total.decode_time == pytest.approx(2.0)
    mixed = trtllm_stats.TotalsRequestStats(block_size=4)
    reference = RequestStats(4, accepted_histogram=[1, 0, 2, 0])
    mixed.add_counts(reference)
    assert mixed.steps == 3 and mixed.total_accepted_drafts == 4


def test_finish_reason_of():
    assert trtllm_stats.finish_reason_of("stop", 3, 10) == "stop"
    assert trtllm_stats.finish_reason_of("length", 10, 10) == "length"
    assert trtllm_stats.finish_reason_of(None, 10, 10) == "length"
    with pytest.raises(RuntimeError, match="timeout"):
        trtllm_stats.finish_reason_of("timeout", 3, 10)


# ----------------------------------------------------------------------------- runtime on a fake tensorrt_llm

@dataclasses.dataclass
class FakeCompletion:  # CompletionOutput
    index: int = 0
    token_ids: list = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    request_perf_metrics: object = None


class FakeRequestOutput:  # RequestOutput: async-iterable while streaming
    def __init__(self, steps, finish, metrics, decoding_iter):
        self.outputs = [FakeCompletion()]
        self._steps, self._finish, self._metrics = steps, finish, metrics
        self.decoding_iter = 0
        self._final_iter = decoding_iter

    def __aiter__(self):
        return self._stream()

    async def _stream(self):
        for i, chunk in enumerate(self._steps):
            self.outputs[0].token_ids.extend(chunk)  # CompletionOutput.token_ids grows
            self.decoding_iter += 1
            if i == len(self._steps) - 1:
                self.outputs[0].finish_reason = self._finish
                self.outputs[0].request_perf_metrics = self._metrics
                self.decoding_iter = self._final_iter
            yield self


def install_fake_tensorrt_llm(monkeypatch, version="1.4.0rc1", script=None):
    """A stand-in `tensorrt_llm` package with the names the runtime uses."""
    created = []

    @dataclasses.dataclass
    class FakeSamplingParams:
        max_tokens: int = 32
        temperature: float | None = None
        top_p: float | None = None
        top_k: int | None = None
        seed: int | None = None
        stop_token_ids: list | None = None
        include_stop_str_in_output: bool = False
        ignore_eos: bool = False
        detokenize: bool = True
        return_perf_metrics: bool = False

    class FakeDFlashDecodingConfig:
        model_fields = {"decoding_type": 0, "max_draft_len": 0, "speculative_model": 0, "mask_token_id": 0,
                        "target_layer_ids": 0, "attention_backend": 0}

        def __init__(self, **kw):
            unknown = set(kw) - set(self.model_fields)
            assert not unknown, unknown
            self.__dict__.update(kw)

    class FakeLLM:
        def __init__(self, **kwargs):
            self.kwargs, self.requests, self.closed = kwargs, [], False
            created.append(self)

        def generate_async(self, inputs, sampling_params=None, streaming=False):
            assert streaming and isinstance(sampling_params, FakeSamplingParams)
            self.requests.append((inputs["prompt_token_ids"], sampling_params))
            return script(inputs["prompt_token_ids"], sampling_params)

        def shutdown(self):
            self.closed = True

    class FakeTorchLlmArgs:
        model_fields = {name: SimpleNamespace(alias=None) for name in
                        ("model", "speculative_config", "max_seq_len", "kv_cache_config", "return_perf_metrics",
                         "tensor_parallel_size")}

    package = types.ModuleType("tensorrt_llm")
    package.__version__ = version
    package.LLM, package.SamplingParams = FakeLLM, FakeSamplingParams
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    llmapi.DFlashDecodingConfig = FakeDFlashDecodingConfig
    llm_args = types.ModuleType("tensorrt_llm.llmapi.llm_args")
    llm_args.DFlashDecodingConfig, llm_args.TorchLlmArgs = FakeDFlashDecodingConfig, FakeTorchLlmArgs
    package.llmapi, llmapi.llm_args = llmapi, llm_args
    for name, module in (("tensorrt_llm", package), ("tensorrt_llm.llmapi", llmapi),
                         ("tensorrt_llm.llmapi.llm_args", llm_args)):
        monkeypatch.setitem(sys.modules, name, module)
    return created


def test_runtime_streams_and_maps_stats(monkeypatch, tmp_path):
    # Prompt p -> chunks: first token from prefill, then steps of a+1 tokens (K = 3 drafts per step).
    plans = {
        1: ([[10], [11, 12, 13], [14]], "length", perf_metrics(2, 6, (100, 100, 101, 102)), 3),   # a = 2, 0
        2: ([[20], [21, 22], [23]], "stop", perf_metrics(1, 6, (100, 100, 101, 104)), 3),          # a = 1, 0
        3: ([[30], [31, 32, 33, 34]], "length", perf_metrics(3, 3, (100, 100.5, 102, 103)), 2),      # a = 3
    }
    created = install_fake_tensorrt_llm(monkeypatch, script=lambda prompt, sp: FakeRequestOutput(*plans[prompt[0]]))
    engine = make_engine(tmp_path, spec={"decoding_type": "DFlash", "max_draft_len": 3, "speculative_model": "drafter"},
                         block_size=4)
    seen = []
    with rt.TrtllmRuntime(engine, tensor_parallel_size=1) as runtime:
        assert runtime.backend == "trtllm" and runtime.block_size == 4 and runtime.warnings == []
        llm = created[0]
        assert llm.kwargs["model"] == str(engine / "target") and llm.kwargs["return_perf_metrics"] is True
        assert llm.kwargs["speculative_config"].max_draft_len == 3
        params = SamplingParams(max_tokens=5, stop_token_ids=(23,))
        results = runtime.generate([[1, 5], [2], [3, 3, 3]], params, batch_size=2,
                                   on_tokens=lambda i, toks: seen.append((i, toks)))
    assert llm.closed
    assert [r.output_token_ids for r in results] == [[10, 11, 12, 13, 14], [20, 21, 22, 23], [30, 31, 32, 33, 34]]
    assert [r.finish_reason for r in results] == ["length", "stop", "length"]
    for i, result in enumerate(results):  # per request, the callback saw the tokens in commit order
        assert [t for j, toks in seen if j == i for t in toks] == result.output_token_ids
    assert [r.stats.steps for r in results] == [2, 2, 1]
    assert results[0].stats.acceptance_length == pytest.approx(2.0)
    assert results[2].stats.decode_time == pytest.approx(1.0)
    assert results[2].stats.prefill_time == pytest.approx(1.5)
    sent_prompt, sent_params = llm.requests[1]
    assert sent_prompt == [2] and sent_params.temperature == 0.0 and sent_params.stop_token_ids == [23]
    assert sent_params.return_perf_metrics and sent_params.include_stop_str_in_output and not sent_params.detokenize
    total = total_stats(results, batch_size=2)
    assert total.steps == 5 and total.num_output_tokens == 14


def test_runtime_refuses_old_version(monkeypatch, tmp_path):
    install_fake_tensorrt_llm(monkeypatch, version="1.2.1")
    with pytest.raises(MissingDependencyError, match="found 1.2.1"):
        rt.TrtllmRuntime(make_engine(tmp_path))


def test_runtime_needs_dflash_config_class(monkeypatch, tmp_path):
    install_fake_tensorrt_llm(monkeypatch, version="1.3.0rc27")
    monkeypatch.delattr(sys.modules["tensorrt_llm.llmapi"], "DFlashDecodingConfig")
    monkeypatch.delattr(sys.modules["tensorrt_llm.llmapi.llm_args"], "DFlashDecodingConfig")
    with pytest.raises(MissingDependencyError, match="DFlashDecodingConfig.*1.3.0rc27"):
        rt.TrtllmRuntime(make_engine(tmp_path))


# ----------------------------------------------------------------------------- GPU integration

def _gpu_skip_reason() -> str | None:
    if importlib.util.find_spec("tensorrt_llm") is None:
        return "tensorrt_llm is not installed (needs NVIDIA's package index or the NGC container on a GPU host)"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if not os.environ.get("DFLASH_TEST_ENGINE"):
        return "set DFLASH_TEST_ENGINE to a dflash-build engine directory"
    return None


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(_gpu_skip_reason() is not None, reason=str(_gpu_skip_reason()))
def test_gpu_greedy_matches_reference():
    import torch

    from trtllm_dflash.checkpoints.gpt_oss import load_hf_gpt_oss, read_target_config, stop_token_ids
    from trtllm_dflash.models.drafter import load_drafter
    from trtllm_dflash.models.target import GptOssTarget
    from trtllm_dflash.runtime.proposers import DFlashProposer
    from trtllm_dflash.runtime.reference import ReferenceRuntime

    engine = Path(os.environ["DFLASH_TEST_ENGINE"])
    target_dir = engine / "target"
    prompts = [[200006, 1428, 200008, 13225, 0, 200007, 200006, 173781, 200005],
               [200006, 1428, 200008, 2500, 382, 220, 17, 10, 17, 30, 200007, 200006, 173781, 200005]]
    params = SamplingParams(max_tokens=32,
                            stop_token_ids=tuple(stop_token_ids(target_dir, read_target_config(target_dir))))
    with rt.TrtllmRuntime(engine) as runtime:
        drafter_dir = runtime.llm_kwargs["speculative_config"].speculative_model
        results = runtime.generate(prompts, params, batch_size=2)
    assert all(r.stats.steps > 0 for r in results)

    device, dtype = torch.device("cuda"), torch.bfloat16
    target = GptOssTarget(load_hf_gpt_oss(target_dir, device, dtype))
    reference = ReferenceRuntime(target, DFlashProposer(load_drafter(drafter_dir, device, dtype), target,
                                                        runtime.block_size))
    expected = reference.generate(prompts, params, batch_size=1)
    assert [r.output_token_ids for r in results] == [r.output_token_ids for r in expected]
