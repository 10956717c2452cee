"""dflash-bench end to end on a tiny random pair: outputs, their schema, progress, refusals and bad input."""

from __future__ import annotations

import builtins
import csv
import json

import pytest
from click.testing import CliRunner

from trtllm_dflash.bench.points import CSV_COLUMNS, BenchPoint
from trtllm_dflash.bench.schedule import check_schedule, schedule_from_bench
from trtllm_dflash.cli.bench import main
from trtllm_dflash.errors import InputError


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt_token_ids": [3 + i, 40, 41, 7 * i + 1, 9]}) + "\n" for i in range(3)))
    return path


def bench(tiny_pair, prompts_file, *args):
    target, drafter = tiny_pair
    return CliRunner().invoke(main, ["--target", str(target), "--drafter", str(drafter), "--prompts-file",
                                     str(prompts_file), *args])


def test_sweep_runs_end_to_end_and_writes_json_csv_plots(tiny_pair, prompts_file, tmp_path):
    out = tmp_path / "out"
    result = bench(tiny_pair, prompts_file, "--concurrency", "1,2,4", "--draft-lengths", "1,3", "--max-tokens", "5",
                   "--requests", "4", "--repeats", "2", "--output-dir", str(out))
    assert result.exit_code == 0, result.output
    document = json.loads((out / "bench.json").read_text())
    assert document["schema"] == "dflash-bench/2"
    assert {"created", "command", "machine", "device", "measured_on", "pair", "prompts", "settings", "points",
            "headline", "headline_ci95", "spread", "cost_model", "schedule"} <= set(document)
    assert document["measured_on"]["runner"] == "in-process" and document["measured_on"]["threads"] == 1
    points = [BenchPoint.from_dict(raw) for raw in document["points"]]
    assert {(p.method, p.draft_len) for p in points} == {("ar", 0), ("dflash", 1), ("dflash", 3), ("dflash-sa", 3)}
    assert {p.concurrency for p in points} == {1, 2, 4}
    for p in points:
        assert p.tokens_per_s > 0 and p.tokens_per_s_user > 0 and len(p.per_position_acceptance) == p.draft_len
        assert p.decode_tokens == 4 * 4  # 4 requests per run (full rounds), max_tokens - 1 decoded each
        assert len(p.tokens_per_s_repeats) == p.repeats == 2 and p.spread() is not None
        for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
            stats = p.latency[name]
            assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"]
        assert len(p.samples["e2e_s"]) == 2 * 4  # every request of both repeats
        assert p.latency["ttft_s"]["p50"] < p.latency["e2e_s"]["p50"]
    assert document["cost_model"]["holdout"]["heldout_concurrency"] == [2]
    # dflash-sa is measured beside DFlash but TensorRT-LLM's cost model and schedule ignore it
    assert {row["method"] for row in document["cost_model"]["holdout"]["points"]} <= {"ar", "dflash"}
    assert set(document["headline"]) == set(document["headline_ci95"]) == {
        "throughput_gain_at_equal_interactivity", "interactivity_gain_at_smallest_batch"}
    rows = list(csv.reader((out / "bench.csv").open()))
    assert rows[0] == CSV_COLUMNS and len(rows) == 1 + len(points) and "ttft_p99_s" in rows[0]
    for name in ("pareto.png", "latency_cdf.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    schedule = document["schedule"]
    assert isinstance(schedule["recommended"], bool) and schedule["reason"]
    if schedule["recommended"]:
        parsed = schedule_from_bench(out / "bench.json")
        check_schedule(parsed, schedule["max_draft_len"] if parsed else None)
        assert "draft_len_schedule" in result.output
    else:
        assert "schedule NOT recommended" in result.output


def test_without_a_terminal_each_finished_point_prints_a_line(tiny_pair, prompts_file, tmp_path):
    result = bench(tiny_pair, prompts_file, "--concurrency", "1,2", "--draft-lengths", "1", "--max-tokens", "3",
                   "--requests", "2", "--repeats", "2", "--no-plot", "--output-dir", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("[")]
    assert len(lines) == 3 * 2 * 2  # runners (AR, K=1, dflash-sa) x levels x repeats
    assert lines[0].startswith("[1/12] ar K=0 c=1 repeat 1: ") and "tok/s/user" in lines[0] and "TTFT p50" in lines[0]
    assert lines[-1].startswith("[12/12] dflash-sa K=1 c=2 repeat 2")


def test_one_repeat_recommends_no_schedule_and_exits_0(tiny_pair, prompts_file, tmp_path):
    out = tmp_path / "out"
    result = bench(tiny_pair, prompts_file, "--concurrency", "1,2,4", "--draft-lengths", "1", "--max-tokens", "3",
                   "--requests", "2", "--repeats", "1", "--no-plot", "--output-dir", str(out))
    assert result.exit_code == 0, result.output
    assert "schedule NOT recommended: one repeat per point" in result.output
    schedule = json.loads((out / "bench.json").read_text())["schedule"]
    assert schedule["recommended"] is False and "draft_len_schedule" not in schedule
    assert "candidate_draft_len_schedule" in schedule
    with pytest.raises(InputError, match="did not recommend a schedule: one repeat per point"):
        schedule_from_bench(out / "bench.json")  # what dflash-build --schedule-from reads


@pytest.fixture
def no_matplotlib(monkeypatch):
    real_import = builtins.__import__

    def guarded(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", guarded)


def test_missing_matplotlib_fails_before_any_work(tiny_pair, prompts_file, tmp_path, no_matplotlib):
    out = tmp_path / "out"
    result = bench(tiny_pair, prompts_file, "--output-dir", str(out))
    assert result.exit_code == 3 and "matplotlib is required for the bench plots" in result.output
    assert "--no-plot" in result.output and "repeat" not in result.output and not out.exists()
    result = bench(tiny_pair, prompts_file, "--concurrency", "1", "--draft-lengths", "1", "--max-tokens", "3",
                   "--requests", "1", "--repeats", "1", "--no-plot", "--output-dir", str(out))
    assert result.exit_code == 0, result.output  # --no-plot needs no matplotlib


@pytest.mark.parametrize("args, message", [
    (["--draft-lengths", "9"], "--draft-lengths"),
    (["--concurrency", "1,x"], "--concurrency"),
    (["--concurrency", "0"], "--concurrency"),
    (["--repeats", "0"], "--repeats"),
    (["--request-rate", "0"], "--request-rate"),
    (["--duration", "-1"], "--duration"),
    (["--model", "dflash"], "--model"),
    (["--sharegpt", "x.json"], "--sharegpt"),
])
def test_bad_options_exit_2_with_the_field(tiny_pair, prompts_file, tmp_path, args, message):
    result = bench(tiny_pair, prompts_file, "--output-dir", str(tmp_path), "--no-plot", *args)
    assert result.exit_code == 2 and message in result.output, result.output


def test_missing_prompts_file_exits_2(tiny_pair, tmp_path):
    target, drafter = tiny_pair
    result = CliRunner().invoke(main, ["--target", str(target), "--drafter", str(drafter), "--prompts-file",
                                       str(tmp_path / "none.jsonl")])
    assert result.exit_code == 2 and "none.jsonl" in result.output


def test_open_loop_synthetic_prompts_in_process(tiny_pair, tmp_path):
    target, drafter = tiny_pair
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["--target", str(target), "--drafter", str(drafter), "--synthetic-input-len",
                                       "6", "--num-prompts", "4", "--request-rate", "50", "--requests", "6",
                                       "--draft-lengths", "1", "--max-tokens", "3", "--repeats", "2", "--max-batch",
                                       "4", "--no-plot", "--output-dir", str(out)])
    assert result.exit_code == 0, result.output
    document = json.loads((out / "bench.json").read_text())
    assert document["prompts"]["count"] == 4 and document["prompts"]["input_tokens_mean"] == 6
    points = [BenchPoint.from_dict(raw) for raw in document["points"]]
    assert {(p.load, p.rate, p.label) for p in points} == {("rate", 50.0, "rate=50/s")}
    assert all(p.requests == 6 and p.failed == 0 for p in points)
    assert "needs a concurrency sweep" in document["schedule"]["reason"]


def test_unusable_output_dir_fails_before_the_sweep(tiny_pair, prompts_file, tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    result = bench(tiny_pair, prompts_file, "--output-dir", str(a_file / "bench"))
    assert result.exit_code == 2 and "--output-dir" in result.output and "notes.txt is a file" in result.output
    assert "repeat" not in result.output



def test_the_in_process_closed_loop_batches_in_flight(random_pair, monkeypatch):
    """c users are c rows of one `generate` call: each user's next request joins at the step after its last one ended
    (sent then), and the step figures come from the runtime's own counts."""
    from trtllm_dflash.bench.load import LoadShape
    from trtllm_dflash.bench.points import CONCURRENCY
    from trtllm_dflash.bench.sweep import InProcessRunner
    from trtllm_dflash.runtime.proposers import DFlashProposer
    from trtllm_dflash.runtime.reference import ReferenceRuntime

    target, drafter, prompts, _ = random_pair
    runtime = ReferenceRuntime(target, DFlashProposer(drafter, target), inflight=True)
    calls = []
    generate = runtime.generate
    monkeypatch.setattr(runtime, "generate", lambda first, *args, **kwargs: calls.append(len(first))
                        or generate(first, *args, **kwargs))
    run = InProcessRunner("dflash", 3, runtime, max_tokens=12).run(prompts[:7], LoadShape(CONCURRENCY, 3, 7))
    assert calls == [3] and len(run.records) == 7 and all(r.ok for r in run.records)
    sends = [r.send for r in run.records]
    assert sends[:3] == [sends[0]] * 3 and sends[3] > sends[0] and sends == sorted(sends)
    for later in run.records[3:]:  # each joined as an earlier request ended
        assert later.send >= min(r.end for r in run.records[:3])
    figures = run.runtime
    assert figures["steps"] > 0 and 1 < figures["mean_batch"] <= 3 and figures["decode_tokens"] == 7 * 11
    with pytest.raises(ValueError, match="in flight"):
        InProcessRunner("ar", 0, ReferenceRuntime(target, None), max_tokens=4)
