"""dflash-bench --protocol openai against a TEST DOUBLE (tests/bench_doubles.py) of an OpenAI-
compatible streaming /v1/completions server on 127.0.0.1; bad endpoints exit 2 with a clear error,
and a server that dies mid-sweep leaves its partial results."""

from __future__ import annotations

import json
import socket

import pytest
from bench_doubles import KServeGenerateStreamDouble, OpenAICompletionsDouble
from click.testing import CliRunner

from trtllm_dflash.bench.endpoints import OpenAIEndpoint
from trtllm_dflash.bench.points import BenchPoint
from trtllm_dflash.bench.schedule import measured_on, schedule_from_bench
from trtllm_dflash.engine.profiles import load_profile
from trtllm_dflash.cli.bench import main


def bench(url, tmp_path, *args, protocol="openai"):
    return CliRunner().invoke(main, ["--endpoint", url, "--protocol", protocol, "--synthetic-input-len", "5",
                                     "--vocab-size", "100", "--num-prompts", "4", "--max-tokens", "6", "--requests",
                                     "4", "--repeats", "2", "--no-plot", "--output-dir", str(tmp_path / "out"), *args])


def table_rows(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.strip().startswith("dflash K=")]


def test_client_streams_one_request_and_reads_the_usage_count():
    with OpenAICompletionsDouble(delay_s=0.01) as double:
        endpoint = OpenAIEndpoint(double.url, "dflash", max_tokens=5)
        endpoint.check()
        record = endpoint.send([5, 6, 7])
    assert record.ok and record.output_tokens == 5 and len(record.chunks) == 5
    assert record.ttft >= 0.01 and record.tpot == pytest.approx(0.01, abs=0.008)
    assert record.tau is None and record.accepted_drafts is None  # like most servers: no DFlash statistics
    sent = double.requests[0]
    assert sent["stream"] is True and sent["prompt"] == [5, 6, 7] and sent["max_tokens"] == 5
    assert sent["ignore_eos"] is True and sent["stream_options"] == {"include_usage": True}


def test_sweep_against_the_double_reports_serving_metrics_and_not_reported_tau(tmp_path):
    with OpenAICompletionsDouble(delay_s=0.002) as double:
        result = bench(double.url, tmp_path, "--concurrency", "1,2", "--model", "dflash=3",
                       "--server-device", "NVIDIA B200")
    assert result.exit_code == 0, result.output
    document = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert document["measured_on"] == {"runner": "endpoint", "device": "NVIDIA B200", "url": double.url,
                                       "protocol": "openai", "models": {"dflash": 3}}
    assert (document["machine"], document["device"]) == ("NVIDIA B200", "cuda")  # what dflash-build checks
    assert document["cost_model"] is None
    points = [BenchPoint.from_dict(raw) for raw in document["points"]]
    assert {(p.draft_len, p.concurrency) for p in points} == {(3, 1), (3, 2)}
    for p in points:
        assert p.requests == 4 and p.failed == 0 and p.tau is None and p.step_s is None
        assert p.latency["ttft_s"]["p50"] > 0 and p.latency["tpot_s"]["p50"] > 0
    assert [row.split()[-1] for row in table_rows(result.output)] == ["n/r", "n/r"]  # tau: not reported
    assert "not fitted" in result.output
    assert len(double.requests) == 1 + 2 * 2 * 4  # warm-up, then 2 levels x 2 repeats x 4 requests
    assert "AR (draft length 0)" in document["schedule"]["reason"]


def test_client_reads_trtllm_serve_per_request_metrics():
    with OpenAICompletionsDouble(delay_s=0.001, trtllm_perf_metrics=True, acceptance_length=2.5) as double:
        endpoint = OpenAIEndpoint(double.url, "dflash", max_tokens=5)
        first, second = endpoint.send([5, 6, 7]), endpoint.send([8])
    for record in first, second:  # each matched to its own entry of /perf_metrics by its stream id
        assert record.ok and (record.accepted_drafts, record.drafted, record.tau) == (6, 28, 2.5)


def test_sweep_against_trtllm_serve_metrics_reports_tau(tmp_path):
    with OpenAICompletionsDouble(delay_s=0.002, trtllm_perf_metrics=True, acceptance_length=2.5) as double:
        result = bench(double.url, tmp_path, "--concurrency", "1,2", "--model", "dflash=3")
    assert result.exit_code == 0, result.output
    document = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert [BenchPoint.from_dict(p).tau for p in document["points"]] == [2.5, 2.5]
    assert [row.split()[-1] for row in table_rows(result.output)] == ["2.50", "2.50"]  # the tau column


def test_a_schedule_measured_on_a_server_is_what_dflash_build_reads(tmp_path):
    # The double's 'dflash' streams 4x faster than its 'ar': speculation wins at every concurrency.
    with OpenAICompletionsDouble(model="dflash", delay_s=0.001, extra_models={"ar": 0.004}) as double:
        result = bench(double.url, tmp_path, "--concurrency", "1,2", "--model", "ar=0", "--model", "dflash=3",
                       "--schedule-source", "measured", "--repeats", "3", "--server-device", "NVIDIA B200")
    assert result.exit_code == 0, result.output
    document = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert document["measured_on"]["device"] == "NVIDIA B200" and document["measured_on"]["runner"] == "endpoint"
    assert document["schedule"]["recommended"], document["schedule"]["reason"]
    assert schedule_from_bench(tmp_path / "out" / "bench.json") == {2: 3}  # K=3 up to batch 2, off above
    where = measured_on(tmp_path / "out" / "bench.json")  # what dflash-build checks against the profile
    assert load_profile("b200-latency").runs_on(**where) and not load_profile("h200-latency").runs_on(**where)
    assert document["headline"]["interactivity_gain_at_smallest_batch"]["ratio"] > 2


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_dead_endpoint_exits_2_naming_it(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    result = bench(url, tmp_path)
    assert result.exit_code == 2 and f"nothing answers at {url} (connection refused)" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


def test_the_wrong_protocol_exits_2_and_names_the_other(tmp_path):
    with KServeGenerateStreamDouble() as triton:
        result = bench(triton.url, tmp_path, protocol="openai")
    assert result.exit_code == 2 and "--protocol" in result.output and "(--protocol triton)" in result.output
    with OpenAICompletionsDouble() as openai:
        result = bench(openai.url, tmp_path, protocol="triton")
    assert result.exit_code == 2 and "(--protocol openai)" in result.output


def test_a_model_the_server_lacks_exits_2_listing_what_it_serves(tmp_path):
    with OpenAICompletionsDouble(model="gpt-oss-dflash") as double:
        result = bench(double.url, tmp_path, "--model", "dflash")
    assert result.exit_code == 2 and "no model 'dflash'; it serves gpt-oss-dflash" in result.output


def test_a_server_dying_mid_sweep_exits_2_and_keeps_partial_results(tmp_path):
    # warm-up + c=1 (4 requests) succeed, then every request is refused.
    with OpenAICompletionsDouble(delay_s=0.001, fail_after=5) as double:
        result = bench(double.url, tmp_path, "--concurrency", "1,2")
    assert result.exit_code == 2 and "every request of dflash K=? at c=2 failed: HTTP 500" in result.output
    document = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert document["partial"] is True and "HTTP 500" in document["error"]
    assert [BenchPoint.from_dict(p).label for p in document["points"]] == ["c=1"]
    assert (tmp_path / "out" / "bench.csv").is_file() and "partial results kept" in result.output

