"""dflash-bench --protocol triton: the KServe generate_stream client against a TEST DOUBLE of the
protocol (tests/bench_doubles.py), always; and against a real Triton server: `dflash-serve` on the
embedded engine in the serve venv (.ci/run's serve stage, where DFLASH_REQUIRE_SERVER=1 makes a
missing piece a failure), or the server DFLASH_BENCH_TRITON_URL names; skipped otherwise."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from bench_doubles import KServeGenerateStreamDouble
from click.testing import CliRunner

from trtllm_dflash.bench.endpoints import TritonEndpoint
from trtllm_dflash.bench.points import BenchPoint
from trtllm_dflash.cli.bench import main

REAL_SERVER = os.environ.get("DFLASH_BENCH_TRITON_URL")
REAL_MODEL = os.environ.get("DFLASH_BENCH_TRITON_MODEL", "dflash")


def test_client_counts_streamed_ids_and_reads_acceptance_statistics():
    with KServeGenerateStreamDouble(delay_s=0.005, tokens_per_chunk=3, acceptance_length=2.75) as double:
        endpoint = TritonEndpoint(double.url, "dflash", max_tokens=7)
        endpoint.check()
        record = endpoint.send([4, 5, 6])
        text_record = endpoint.send("hello")
    assert record.ok and record.output_tokens == 7 and [n for _, n in record.chunks] == [3, 3, 1]
    assert record.tau == 2.75 and (record.accepted_drafts, record.drafted) == (6, 28)
    assert len(record.itls) == 2 and record.tpot == pytest.approx(record.decode_time / 6)
    sent, sent_text = double.requests
    assert sent == {"input_ids": [4, 5, 6], "streaming": True, "sampling_param_max_tokens": 7,
                    "sampling_param_temperature": 0.0}
    assert sent_text["text_input"] == "hello" and "input_ids" not in sent_text and text_record.ok


def test_sweep_against_the_double_reports_tau_from_the_server(tmp_path):
    with KServeGenerateStreamDouble(delay_s=0.002, tokens_per_chunk=2) as double:
        result = CliRunner().invoke(main, ["--endpoint", double.url, "--synthetic-input-len", "4", "--vocab-size",
                                           "50", "--max-tokens", "6", "--concurrency", "1,2", "--requests", "2",
                                           "--repeats", "2", "--model", "dflash=3", "--no-plot", "--output-dir",
                                           str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    document = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert document["measured_on"]["protocol"] == "triton"
    points = [BenchPoint.from_dict(raw) for raw in document["points"]]
    assert all(p.tau == 2.5 and p.requests == 2 and p.latency["itl_s"]["p50"] > 0 for p in points)
    assert "2.50" in result.output


def test_a_model_the_triton_server_lacks_exits_2(tmp_path):
    with KServeGenerateStreamDouble(model="dflash") as double:
        result = CliRunner().invoke(main, ["--endpoint", double.url, "--model", "other", "--no-plot",
                                           "--output-dir", str(tmp_path / "out")])
    assert result.exit_code == 2 and "no model 'other'; it serves dflash" in result.output


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    """The URL of a real Triton server: DFLASH_BENCH_TRITON_URL, or dflash-serve started here on
    free 127.0.0.1 ports (test_triton_server's Server: readiness, clean SIGTERM)."""
    if REAL_SERVER:
        yield REAL_SERVER
        return
    from test_triton_server import Server, bin_path, needs_server

    needs_server()
    from trtllm_dflash.embedded import pair_paths

    target, drafter = pair_paths()
    engine = tmp_path_factory.mktemp("bench_serve") / "engine"
    subprocess.run([bin_path("dflash-build"), "--target", str(target), "--drafter", str(drafter), "--output",
                    str(engine), "--quiet"], check=True, timeout=300)
    server = Server(engine)
    try:
        yield server.url
    finally:
        server.stop()


def test_bench_against_the_real_triton_server(real_server, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["--endpoint", real_server, "--protocol", "triton", "--model", REAL_MODEL,
                                       "--max-tokens", "8", "--concurrency", "1,4", "--requests", "4", "--repeats",
                                       "2", "--no-plot", "--output-dir", str(out)])
    assert result.exit_code == 0, result.output
    points = [BenchPoint.from_dict(raw) for raw in json.loads((out / "bench.json").read_text())["points"]]
    assert {p.concurrency for p in points} == {1, 4}
    for p in points:
        assert p.failed == 0 and p.requests == 4 and p.tau is not None and p.tau >= 1.0
        assert 0 < p.latency["ttft_s"]["p50"] <= p.latency["e2e_s"]["p50"]
    result = CliRunner().invoke(main, ["--endpoint", real_server, "--model", "no-such-model", "--no-plot",
                                       "--output-dir", str(tmp_path / "bad")])
    assert result.exit_code == 2 and "no model 'no-such-model'" in result.output
    result = CliRunner().invoke(main, ["--endpoint", real_server, "--protocol", "openai", "--no-plot",
                                       "--output-dir", str(tmp_path / "bad")])
    assert result.exit_code == 2 and "(--protocol triton)" in result.output
