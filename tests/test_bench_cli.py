"""dflash-bench end to end on a tiny random pair: outputs, their schema, and bad input."""

from __future__ import annotations

import csv
import json

import pytest
from click.testing import CliRunner

from trtllm_dflash.cli.bench import main
from trtllm_dflash.bench.points import CSV_COLUMNS, BenchPoint
from trtllm_dflash.bench.schedule import check_schedule, schedule_from_bench


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt_token_ids": [3 + i, 40, 41, 7 * i + 1, 9]}) + "\n" for i in range(3)))
    return path


def test_sweep_runs_end_to_end_and_writes_json_csv_plot(tiny_pair, prompts_file, tmp_path):
    target, drafter = tiny_pair
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["--target", str(target), "--drafter", str(drafter), "--prompts-file",
                                       str(prompts_file), "--concurrency", "1,2,4", "--draft-lengths", "1,3",
                                       "--max-tokens", "5", "--output-dir", str(out)])
    assert result.exit_code == 0, result.output
    document = json.loads((out / "bench.json").read_text())
    assert document["schema"] == "dflash-bench/1"
    assert {"created", "command", "machine", "pair", "prompts", "settings", "points", "headline", "cost_model",
            "schedule"} <= set(document)
    points = [BenchPoint.from_dict(raw) for raw in document["points"]]
    assert {(p.method, p.draft_len) for p in points} == {("ar", 0), ("dflash", 1), ("dflash", 3), ("dflash-sa", 3)}
    assert {p.concurrency for p in points} == {1, 2, 4}
    for p in points:
        assert p.tokens_per_s > 0 and p.tokens_per_s_user > 0 and len(p.per_position_acceptance) == p.draft_len
        assert p.decode_tokens == 4 * p.concurrency  # fixed-length outputs: max_tokens - 1 decoded each
        assert p.tokens_per_s == pytest.approx(p.tokens_per_s_user * p.concurrency, rel=0.5)
    assert document["cost_model"]["holdout"]["heldout_concurrency"] == [2]
    # dflash-sa is measured beside DFlash but TensorRT-LLM's cost model and schedule ignore it
    assert {row["method"] for row in document["cost_model"]["holdout"]["points"]} <= {"ar", "dflash"}
    assert set(document["headline"]) == {"throughput_gain_at_equal_interactivity",
                                         "interactivity_gain_at_smallest_batch"}
    rows = list(csv.reader((out / "bench.csv").open()))
    assert rows[0] == CSV_COLUMNS and len(rows) == 1 + len(points)
    assert (out / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    schedule = schedule_from_bench(out / "bench.json")
    check_schedule(schedule, document["schedule"]["max_draft_len"] if schedule else None)
    assert "draft_len_schedule" in result.output


@pytest.mark.parametrize("args, message", [
    (["--draft-lengths", "9"], "--draft-lengths"),
    (["--concurrency", "1,x"], "--concurrency"),
    (["--concurrency", "0"], "--concurrency"),
    (["--repeats", "0"], "--repeats"),
])
def test_bad_options_exit_2_with_the_field(tiny_pair, prompts_file, tmp_path, args, message):
    target, drafter = tiny_pair
    result = CliRunner().invoke(main, ["--target", str(target), "--drafter", str(drafter), "--prompts-file",
                                       str(prompts_file), "--output-dir", str(tmp_path), "--no-plot", *args])
    assert result.exit_code == 2 and message in result.output


def test_missing_prompts_file_exits_2(tiny_pair, tmp_path):
    target, drafter = tiny_pair
    result = CliRunner().invoke(main, ["--target", str(target), "--drafter", str(drafter), "--prompts-file",
                                       str(tmp_path / "none.jsonl")])
    assert result.exit_code == 2 and "none.jsonl" in result.output


def test_sweep_below_the_block_size_schedules_only_swept_lengths(tiny_pair, prompts_file, tmp_path):
    target, drafter = tiny_pair
    result = CliRunner().invoke(main, ["--target", str(target), "--drafter", str(drafter), "--prompts-file",
                                       str(prompts_file), "--concurrency", "1,2", "--draft-lengths", "1",
                                       "--max-tokens", "4", "--no-plot", "--output-dir", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    schedule = json.loads((tmp_path / "out" / "bench.json").read_text())["schedule"]
    assert set(schedule["best_per_band"].values()) <= {0, 1}


def test_unusable_output_dir_fails_before_the_sweep(tiny_pair, prompts_file, tmp_path):
    target, drafter = tiny_pair
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    result = CliRunner().invoke(main, ["--target", str(target), "--drafter", str(drafter), "--prompts-file",
                                       str(prompts_file), "--output-dir", str(a_file / "bench")])
    assert result.exit_code == 2 and "--output-dir" in result.output and "notes.txt is a file" in result.output
    assert "sweep" not in result.output
