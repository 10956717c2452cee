"""dflash-run end to end on a tiny random pair, and its errors for bad input (exit 2, no traceback)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from cpu_marks import needs_fbgemm
from run_cli import invoke, json_lines
from trtllm_dflash.models.linear import fbgemm_fp16, native_bf16
from trtllm_dflash.plugins.draft_block.cpu import dot_kernel


def test_json_output_and_baseline(tiny_pair, tmp_path):
    target, drafter = tiny_pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n" + json.dumps({"prompt_token_ids": [5, 6, 7]}) + "\n")
    result = invoke("--target", target, "--drafter", drafter, "--prompt", "import os", "--prompts-file", prompts,
                    "--max-tokens", 12, "--batch-size", 2, "--baseline", "--json", "--repeats", 2, "--threads", 1)
    assert result.exit_code == 0, result.output
    records, summary = json_lines(result)
    assert len(records) == 3
    required = {"prompt", "prompt_token_ids", "output_token_ids", "text", "num_output_tokens", "steps",
                "acceptance_length", "acceptance_histogram", "decode_tokens_per_s", "baseline_output_token_ids",
                "baseline_decode_tokens_per_s", "speedup", "speedup_min", "speedup_max", "matches_baseline",
                "suffix_steps", "draftless_steps"}
    for record in records:
        assert required <= set(record)
        assert record["matches_baseline"] is True
        assert record["num_output_tokens"] == len(record["output_token_ids"]) <= 12
        # a tiny pair's block of 4: suffix steps draft up to 2 x 4 - 1 = 7 tokens, so a step keeps 0..7
        assert len(record["acceptance_histogram"]) == 8
        assert record["speedup_min"] <= record["speedup"] <= record["speedup_max"]
    assert records[2]["prompt_token_ids"] == [5, 6, 7]
    # the summary: pooled tau (committed tokens / verify steps of all prompts), repeats, threads
    settings = (summary["method"], summary["sa_threshold"], summary["sa_max_drafts"], summary["threads"],
                summary["repeats"])
    assert settings == ("dflash-sa", 2, 7, 1, 2)
    committed = sum(sum((a + 1) * n for a, n in enumerate(r["acceptance_histogram"])) for r in records)
    assert summary["steps"] == sum(r["steps"] for r in records)
    assert summary["acceptance_length"] == pytest.approx(committed / summary["steps"])
    assert summary["suffix_steps"] == sum(r["suffix_steps"] for r in records)
    assert summary["draftless_steps"] == sum(r["draftless_steps"] for r in records)
    assert summary["speedup_min"] <= summary["speedup"] <= summary["speedup_max"]
    assert summary["outputs_identical"] == 3 and isinstance(summary["spread_wider_than_effect"], bool)


def test_a_request_without_verify_steps_has_no_tau(tiny_pair):
    target, drafter = tiny_pair
    result = invoke("--target", target, "--drafter", drafter, "--prompt", "abc", "--max-tokens", 1, "--json")
    assert result.exit_code == 0, result.output
    (record,), summary = json_lines(result)
    assert record["steps"] == 0 and record["acceptance_length"] is None and summary["acceptance_length"] is None
    report = invoke("--target", target, "--drafter", drafter, "--prompt", "abc", "--max-tokens", 1, "--no-stream")
    assert report.exit_code == 0 and "acceptance length (tau)" in report.output


@pytest.mark.parametrize("args,title", [([], "DFlash + suffix automaton (threshold 2), adaptive draft length"),
                                        (["--sa-threshold", 4], "DFlash + suffix automaton (threshold 4), adaptive"),
                                        (["--draft-length", "fixed"],
                                         "DFlash + suffix automaton (threshold 2) on the reference backend"),
                                        (["--draft-method", "dflash", "--draft-length", "fixed"],
                                         "DFlash on the reference backend"),
                                        (["--draft-method", "dflash"], "DFlash, adaptive draft length on the"),
                                        (["--draft-method", "ngram"], "n-gram prompt lookup on the reference")])
def test_the_title_names_the_method_that_ran(tiny_pair, args, title):
    target, drafter = tiny_pair
    result = invoke("--target", target, "--drafter", drafter, "--prompt", "abcabc", "--max-tokens", 6, "--no-stream",
                    *args)
    assert result.exit_code == 0 and title in result.output, result.output


def test_spread_wider_than_the_effect_is_a_warning():
    from trtllm_dflash.runtime.report import spread_warning, summary_record
    from trtllm_dflash.runtime.stats import GenerationResult, RequestStats

    def run(decode_time):
        stats = RequestStats(4, num_output_tokens=11, decode_time=decode_time)
        return [GenerationResult([1], [2] * 11, "length", stats)]
    settings = dict(method="dflash", sa_threshold=None, backend="reference", threads=2, repeats=3)
    steady = summary_record(run(1.0), [run(1.0), run(1.02), run(0.98)], [run(1.5)] * 3, 1, **settings)
    assert steady["speedup"] == pytest.approx(1.5) and spread_warning(steady) is None
    noisy = summary_record(run(1.0), [run(1.0), run(0.5), run(2.0)], [run(1.1)] * 3, 1, **settings)
    assert noisy["spread_wider_than_effect"]
    assert (noisy["speedup_min"], noisy["speedup_max"]) == pytest.approx((0.55, 2.2))
    assert "0.55x..2.20x" in spread_warning(noisy) and "--threads 1" in spread_warning(noisy)
    one_thread = summary_record(run(1.0), [run(1.0), run(0.5), run(2.0)], [run(1.1)] * 3, 1,
                                **{**settings, "threads": 1})
    assert "--threads 1" not in spread_warning(one_thread)  # already one thread: not advised again


@pytest.mark.parametrize("args,option", [(["--sa-threshold", 0], "--sa-threshold"),
                                         (["--sa-threshold", -2], "--sa-threshold"),
                                         (["--repeats", 0, "--baseline"], "--repeats"),
                                         (["--threads", 0], "--threads"),
                                         (["--sa-threshold", 3, "--draft-method", "dflash"], "--sa-threshold"),
                                         (["--draft-length", "adaptive", "--draft-method", "ngram"], "--draft-length"),
                                         (["--draft-length", "sometimes"], "--draft-length"),
                                         (["--drafter-gemm-dtype", "bfloat16", "--draft-method", "ngram"],
                                          "--drafter-gemm-dtype"),
                                         (["--drafter-gemm-dtype", "int4"], "--drafter-gemm-dtype"),
                                         (["--sa-threshold", 3, "--draft-method", "ngram"], "--sa-threshold"),
                                         (["--sa-max-drafts", 0], "--sa-max-drafts"),
                                         (["--sa-max-drafts", 2], "--sa-max-drafts"),  # the tiny block drafts 3
                                         (["--sa-max-drafts", 9, "--draft-method", "dflash"], "--sa-max-drafts"),
                                         (["--sa-max-drafts", 9, "--backend", "trtllm"], "--backend"),
                                         (["--repeats", 3], "--repeats")])
def test_bad_speed_and_hybrid_options(tiny_pair, args, option):
    target, drafter = tiny_pair
    result = invoke("--target", target, "--drafter", drafter, "--prompt", "x", "--no-stream", *args)
    assert result.exit_code == 2 and option in result.output and "Traceback" not in result.output, result.output
    assert "tok/s" not in result.output  # nothing ran


@pytest.mark.parametrize("args,longest", [([], 7), (["--block-size", 3], 5), (["--sa-max-drafts", 11], 11),
                                          (["--block-size", 3, "--sa-max-drafts", 2], 2)])
def test_suffix_drafts_default_to_two_verify_blocks(tiny_pair, args, longest):
    """The tiny drafter's block is 4: suffix drafts run to 2 x 4 - 1 = 7, at --block-size 3 to 5, or as asked."""
    target, drafter = tiny_pair
    result = invoke("--target", target, "--drafter", drafter, "--prompt", "abcabcabcabcabc", "--max-tokens", 24,
                    "--json", "--draft-length", "fixed", *args)
    assert result.exit_code == 0, result.output
    (record,), summary = json_lines(result)
    assert summary["sa_max_drafts"] == longest and len(record["acceptance_histogram"]) == longest + 1


@pytest.mark.parametrize("method", ["dflash", "dflash-sa"])
def test_adaptive_draft_length_is_lossless_and_reported(tiny_pair, method):
    target, drafter = tiny_pair
    result = invoke("--target", target, "--drafter", drafter, "--prompt", "abcabcabc", "--prompt", "xyz",
                    "--max-tokens", 16, "--batch-size", 2, "--baseline", "--repeats", 1, "--json",
                    "--draft-method", method, "--draft-length", "adaptive")
    assert result.exit_code == 0, result.output
    records, summary = json_lines(result)
    assert all(record["matches_baseline"] for record in records)
    assert summary["draft_length"] == "adaptive" and summary["method"] == method
    assert "adaptive draft length: step costs at batch 2" in result.stderr


@pytest.mark.parametrize("choice,expected", [
    ("float32", "float32"), ("bfloat16", "bfloat16"),
    pytest.param("float16", "float16", marks=needs_fbgemm),
    pytest.param("int8", "int8", marks=pytest.mark.skipif(dot_kernel(torch.int8) is None,
                                                          reason="no int8 dot GEMM here")),
    ("auto", "int8" if dot_kernel(torch.int8) else "bfloat16" if native_bf16(torch.device("cpu")) or dot_kernel()
     else "float16" if fbgemm_fp16() else "float32")])
def test_drafter_gemm_dtype_is_lossless_and_reported(tiny_pair, choice, expected):
    target, drafter = tiny_pair
    result = invoke("--target", target, "--drafter", drafter, "--prompt", "abcabcabc", "--max-tokens", 12,
                    "--baseline", "--repeats", 1, "--json", "--draft-method", "dflash", "--drafter-gemm-dtype", choice)
    assert result.exit_code == 0, result.output
    records, summary = json_lines(result)
    assert all(record["matches_baseline"] for record in records)
    assert summary["drafter_gemm_dtype"] == expected


@pytest.mark.parametrize("method", ["dflash", "ngram"])
def test_the_summary_says_whether_the_drafter_ran_the_compiled_cpu_kernels(tiny_pair, method):
    """And which of the target's parts ran compiled ones (the tiny target's float32 experts and head_dim 16: all
    three where they build)."""
    from trtllm_dflash.plugins.draft_block.cpu import cpu_kernel
    from trtllm_dflash.plugins.target.cpu import target_kernels

    target, drafter = tiny_pair
    result = invoke("--target", target, "--drafter", drafter, "--prompt", "abcabc", "--max-tokens", 6, "--json",
                    "--draft-method", method)
    assert result.exit_code == 0, result.output
    _, summary = json_lines(result)
    assert summary["drafter_cpu_kernels"] == (None if method == "ngram" else cpu_kernel() is not None)
    built = target_kernels() is not None and cpu_kernel() is not None
    assert summary["target_cpu_kernels"] == (["attention", "moe", "add_rms_norm"] if built else [])


def test_drafter_gemm_dtype_needs_our_drafter():
    from trtllm_dflash.cli.run import check_drafter_gemm
    from trtllm_dflash.errors import InputError

    check_drafter_gemm(None, "ngram", "trtllm")  # not given: nothing to refuse
    check_drafter_gemm("bfloat16", "dflash", "reference")
    for method, backend in (("dflash", "trtllm"), ("ngram", "reference")):
        with pytest.raises(InputError) as raised:
            check_drafter_gemm("bfloat16", method, backend)
        assert raised.value.field == "--drafter-gemm-dtype"


@pytest.mark.parametrize("batch_size", [1, 3])
def test_inflight_batching_gives_the_same_tokens_and_one_summary(tiny_pair, batch_size):
    """--batching inflight: the same outputs as static batches (and as the baseline), the run's totals from the union of
    its requests' decode spans, and the setting in the summary."""
    target, drafter = tiny_pair
    common = ("--target", target, "--drafter", drafter, "--prompt", "def f(x):", "--prompt", "import os",
              "--prompt", "class A:", "--prompt", "x = [", "--max-tokens", 10, "--batch-size", batch_size, "--json",
              "--threads", 1)
    static = invoke(*common)
    inflight = invoke(*common, "--batching", "inflight", "--baseline", "--repeats", 2)
    assert static.exit_code == 0 and inflight.exit_code == 0, static.output + inflight.output
    (static_records, _), (records, summary) = json_lines(static), json_lines(inflight)
    assert [r["output_token_ids"] for r in records] == [r["output_token_ids"] for r in static_records]
    assert summary["batching"] == "inflight" and summary["outputs_identical"] == 4
    assert all(r["matches_baseline"] for r in records) and summary["speedup_min"] <= summary["speedup_max"]


def test_inflight_batching_is_the_reference_runtimes():
    from trtllm_dflash.cli.run import check_batching
    from trtllm_dflash.errors import InputError

    check_batching("inflight", "reference")
    check_batching("static", "trtllm")
    with pytest.raises(InputError) as raised:
        check_batching("inflight", "trtllm")
    assert raised.value.field == "--batching"


def test_draft_length_defaults_and_refusals():
    from trtllm_dflash.cli.run import resolve_draft_length
    from trtllm_dflash.errors import InputError

    assert [resolve_draft_length(None, method, "reference") for method in ("dflash-sa", "dflash", "ngram")] == \
        ["adaptive", "adaptive", "fixed"]
    assert resolve_draft_length(None, "dflash", "trtllm") == "fixed"
    assert resolve_draft_length("fixed", "dflash-sa", "reference") == "fixed"
    with pytest.raises(InputError, match="reference backend only") as raised:
        resolve_draft_length("adaptive", "dflash", "trtllm")
    assert raised.value.field == "--draft-length"


def test_text_prompts_file_and_human_report(tiny_pair, tmp_path):
    target, drafter = tiny_pair
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\nsecond prompt\n")
    result = invoke("--target", target, "--drafter", drafter, "--prompts-file", prompts, "--max-tokens", 6,
                    "--temperature", 0.8, "--top-p", 0.9, "--block-size", 3, "--drafter-gemm-dtype", "bfloat16")
    assert result.exit_code == 0, result.output
    assert "acceptance length" in result.output and "second prompt" in result.output
    assert "drafter GEMMs" in result.output and "bfloat16" in result.output


def copy_pair(tiny_pair, tmp_path):
    target, drafter = tiny_pair
    shutil.copytree(target, tmp_path / "target")
    shutil.copytree(drafter, tmp_path / "drafter")
    return tmp_path / "target", tmp_path / "drafter"


def edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if "." in key:
            outer, inner = key.split(".")
            config[outer][inner] = value
        else:
            config[key] = value
    path.write_text(json.dumps(config))


BAD_CONFIGS = {
    "hidden": ("drafter", {"hidden_size": 32}, "hidden_size"),
    "layer ids": ("drafter", {"dflash_config.target_layer_ids": [1, 9]}, "target_layer_ids"),
    "mask id": ("drafter", {"dflash_config.mask_token_id": 9999}, "mask_token_id"),
    "block": ("drafter", {"block_size": 1}, "block_size"),
    "vocab": ("drafter", {"vocab_size": 300}, "vocab_size"),
    "target layers": ("drafter", {"num_target_layers": 8}, "num_target_layers"),
    "fc width": ("drafter", {"dflash_config.target_layer_ids": [0, 1, 2]}, "fc.weight"),
    "not gpt-oss": ("target", {"model_type": "llama"}, "model_type"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_mismatched_pair_is_a_clear_error(tiny_pair, tmp_path, case):
    target, drafter = copy_pair(tiny_pair, tmp_path)
    which, changes, field = BAD_CONFIGS[case]
    edit_config(drafter if which == "drafter" else target, **changes)
    result = invoke("--target", target, "--drafter", drafter, "--prompt", "x", "--max-tokens", 2)
    assert result.exit_code == 2, result.output
    assert field in result.output
    assert "config.json" in result.output or "safetensors" in result.output
    assert "Traceback" not in result.output


def test_missing_and_truncated_weights(tiny_pair, tmp_path):
    target, drafter = copy_pair(tiny_pair, tmp_path)
    weights = drafter / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    result = invoke("--target", target, "--drafter", drafter, "--prompt", "x")
    assert result.exit_code == 2 and "model.safetensors" in result.output and "truncated" in result.output
    weights.unlink()
    result = invoke("--target", target, "--drafter", drafter, "--prompt", "x")
    assert result.exit_code == 2 and "no weights found" in result.output


def test_missing_tokenizer_only_matters_for_text(tiny_pair, tmp_path):
    target, drafter = copy_pair(tiny_pair, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (target / name).unlink()
    result = invoke("--target", target, "--drafter", drafter, "--prompt", "hello")
    assert result.exit_code == 2 and "tokenizer.json" in result.output
    ids = tmp_path / "ids.jsonl"
    ids.write_text(json.dumps({"prompt_token_ids": [1, 2, 3]}) + "\n")
    assert invoke("--target", target, "--drafter", drafter, "--prompts-file", ids, "--max-tokens", 3).exit_code == 0


def test_bad_options(tiny_pair):
    target, drafter = tiny_pair
    assert "block_size" in invoke("--target", target, "--drafter", drafter, "--prompt", "x", "--block-size", 9).output
    result = invoke("--target", target, "--drafter", drafter, "--prompt", "x", "--top-p", 0)
    assert result.exit_code == 2 and "top_p" in result.output


def test_outputs_stats_file_and_ngram(tiny_pair, tmp_path):
    target, drafter = tiny_pair
    out, steps = tmp_path / "out.jsonl", tmp_path / "steps.jsonl"
    result = invoke("--target", target, "--drafter", drafter, "--prompt", "abcabcabc", "--prompt", "xyz",
                    "--max-tokens", 10, "--draft-method", "ngram", "--output", out, "--stats-file", steps,
                    "--no-stream")
    assert result.exit_code == 0, result.output
    *records, summary = [json.loads(line) for line in out.read_text().splitlines()]  # the same lines as --json
    assert summary["summary"] and summary["method"] == "ngram" and summary["sa_threshold"] is None
    step_records = [json.loads(line) for line in steps.read_text().splitlines()]
    for i, record in enumerate(records):
        mine = [s["accepted"] for s in step_records if s["request"] == i]
        assert len(mine) == record["steps"]
        assert [mine.count(a) for a in range(len(record["acceptance_histogram"]))] == record["acceptance_histogram"]


def test_streamed_text_equals_final_text(tiny_pair):
    target, drafter = tiny_pair
    streamed = invoke("--target", target, "--drafter", drafter, "--prompt", "hello", "--prompt", "world",
                      "--max-tokens", 12, "--batch-size", 2)
    final = invoke("--target", target, "--drafter", drafter, "--prompt", "hello", "--prompt", "world",
                   "--max-tokens", 12, "--batch-size", 2, "--json")
    assert streamed.exit_code == 0 and final.exit_code == 0
    texts = [record["text"] for record in json_lines(final)[0]]
    body = streamed.stdout.split(" on the reference backend")[0]
    positions = [body.index(text) for text in texts]
    assert positions == sorted(positions)  # every final text appears, in prompt order


def test_chat_template_applied_when_present(tiny_pair, tmp_path):
    target, drafter = copy_pair(tiny_pair, tmp_path)
    result = invoke("--target", target, "--drafter", drafter, "--prompt", "hi", "--chat")
    assert result.exit_code == 2 and "chat_template" in result.output
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    config_path.write_text(json.dumps(config))
    result = invoke("--target", target, "--drafter", drafter, "--prompt", "hi", "--chat", "--json", "--max-tokens", 2)
    assert result.exit_code == 0, result.output
    assert json_lines(result)[0][0]["prompt_token_ids"] == list(b"<user>hi<assistant>")


def test_ctrl_c_prints_statistics_and_exits_130(tiny_pair):
    """SIGINT to a running dflash-run: exit status 130, the summary so far, no traceback."""
    import os
    import signal
    import subprocess
    import sys
    import time

    target, drafter = tiny_pair
    code = "from trtllm_dflash.cli.run import main; main()"
    # A suite started in the background by a non-interactive shell inherits SIGINT ignored, and Python
    # then keeps it ignored: restore the default so the child behaves as in a terminal.
    # 16 prompts of 4000 tokens (the tiny target holds 4096 positions): a CI machine decoded one in under the second
    # below, and the signal then fell after the loop (round 29)
    proc = subprocess.Popen([sys.executable, "-u", "-c", code, "--target", str(target), "--drafter", str(drafter),
                             *["--prompt", "stream me"] * 16, "--max-tokens", "4000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = ""
    deadline = time.time() + 60
    while "stream me" not in seen and time.time() < deadline:  # the prompt header precedes streamed tokens
        seen += proc.stdout.read(1)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err + out
    assert "acceptance length" in out


def test_ctrl_c_before_the_loop_exits_130_in_one_line(tiny_pair, monkeypatch):
    """SIGINT while the pair loads (before the loop that reports what it did): 130 and one line, not click's
    "Aborted!" and exit 1."""
    import trtllm_dflash.checkpoints.validate as validate

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(validate, "validate_pair", interrupted)
    target, drafter = tiny_pair
    result = invoke("--target", target, "--drafter", drafter, "--prompt", "hi")
    assert result.exit_code == 130 and result.output.strip() == "interrupted"


def test_ctrl_c_before_any_result_exits_130_without_statistics(tiny_pair, monkeypatch):
    """SIGINT inside the loop before a request has a result (a KeyboardInterrupt the runtime could not turn into
    partial results): 130 and one line, not an IndexError from the empty statistics (CI, round 32)."""
    from trtllm_dflash.runtime.reference import ReferenceRuntime

    generate = ReferenceRuntime.generate

    def interrupted(self, prompts, params, *args, **kwargs):
        if params.max_tokens == 3:  # the warm-up
            return generate(self, prompts, params, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(ReferenceRuntime, "generate", interrupted)
    target, drafter = tiny_pair
    result = invoke("--target", target, "--drafter", drafter, "--prompt", "hi", "--max-tokens", "8")
    assert result.exit_code == 130, result.output
    assert result.output.strip().endswith("interrupted before any request was decoded")
    assert "Traceback" not in result.output


@pytest.mark.parametrize("ignored", [True, False])
def test_ctrl_c_while_the_interpreter_exits_is_ignored_once_a_command_ran(ignored):
    """A SIGINT during interpreter exit, after the command reported, raised KeyboardInterrupt in torch's exit hooks
    (a traceback after the report, round 33). Every command registers `ignore_interrupts_at_exit`; an exit hook that
    signals the process, registered before it as torch's are, then raises nothing (and does without it)."""
    import subprocess
    import sys

    # Python's own SIGINT handler, whatever the parent left (a background job of a non-interactive shell starts
    # with SIGINT ignored, and Python then installs none)
    script = ("import atexit, os, signal, time\n"
              "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
              "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(0.5)))\n"
              "from trtllm_dflash.cli.common import clean_errors\n"
              f"clean_errors(lambda: None)() if {ignored} else None\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    assert ("KeyboardInterrupt" in done.stderr) is not ignored, done.stderr


def test_no_arguments_without_embedded_pair_is_a_clear_error(monkeypatch, tmp_path):
    import trtllm_dflash.embedded as embedded

    monkeypatch.setattr(embedded, "TARGET_DIR", tmp_path / "missing")
    result = invoke()
    assert result.exit_code == 2 and "embedded default pair" in result.output


def test_unusable_prompts_and_output_paths_fail_before_the_run(tiny_pair, tmp_path):
    target, drafter = tiny_pair
    binary = tmp_path / "prompts.txt"
    binary.write_bytes(b"\xff\xfe\x00bad\n")
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    for args, message in [
        (["--prompts-file", binary], "not UTF-8 text (byte 0xff at offset 0)"),
        (["--prompts-file", tmp_path], "is a directory"),
        (["--prompt", "x", "--output", a_file / "out.jsonl"], "notes.txt is a file, not a directory"),
        (["--prompt", "x", "--stats-file", tmp_path], "expected a file here, found a directory"),
        (["--prompt", "x", "--batch-size", 0], "--batch-size"),
    ]:
        result = invoke("--target", target, "--drafter", drafter, "--no-stream", *args)
        assert result.exit_code == 2 and message in result.output, result.output
        assert "Traceback" not in result.output and "tok/s" not in result.output  # nothing ran
    result = invoke("--target", target / "config.json", "--drafter", drafter, "--prompt", "x")
    assert result.exit_code == 2 and "is a file; expected the directory that holds config.json" in result.output


def test_a_failed_file_operation_is_one_line_naming_the_file():
    import click

    from trtllm_dflash.cli.common import clean_errors

    @click.command()
    @clean_errors
    def write():
        raise OSError(28, "No space left on device", "/engines/target/model-00001.safetensors")

    result = CliRunner().invoke(write, [])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.strip() == "error: /engines/target/model-00001.safetensors: No space left on device"


def test_bad_prompt_ids_devices_and_lengths_are_refused_before_loading(tiny_pair, tmp_path):
    target, drafter = tiny_pair  # vocab 258, max_position_embeddings 4096
    cases = [
        ({"prompt_token_ids": [5, 258]}, "outside [0, 258)"),
        ({"prompt_token_ids": [5, -1]}, "outside [0, 258)"),
        ({"prompt_token_ids": []}, "prompt 0 is empty"),
        ({"prompt_token_ids": [5, 1.5]}, "integer token ids"),
        ({"prompt_token_ids": [5, "3"]}, "integer token ids"),
        ({"prompt_token_ids": [5, True]}, "integer token ids"),
        ({"prompt_token_ids": [5, None]}, "integer token ids"),
        ({"prompt": ""}, "prompt 0 is empty"),
    ]
    for record, message in cases:
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text(json.dumps(record) + "\n")
        result = invoke("--target", target, "--drafter", drafter, "--prompts-file", prompts, "--no-stream")
        assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output, record
    for args, message in [
        (["--device", "tpu"], "expected auto, cpu, cuda or cuda:N"),
        (["--device", "meta"], "expected auto, cpu, cuda or cuda:N"),
        (["--device", ""], "expected auto, cpu, cuda or cuda:N"),
        (["--device", "cpu:1"], "expected auto, cpu, cuda or cuda:N"),
        (["--device", "cuda:"], "expected auto, cpu, cuda or cuda:N"),
        (["--max-tokens", 4095], "max_position_embeddings (4096)"),
        (["--temperature", "inf"], "finite and >= 0"),
        (["--temperature", "nan"], "finite and >= 0"),
    ]:
        result = invoke("--target", target, "--drafter", drafter, "--prompt", "ab", "--no-stream", *args)
        assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output, args


def test_expert_dtype_is_reported_and_refused_where_it_cannot_apply(tiny_pair):
    """The tiny pair's random float32 experts have one storage: auto and float32 run it, bfloat16 is refused
    (exit 2), as is the option on the trtllm backend."""
    target, drafter = tiny_pair
    common = ("--target", target, "--drafter", drafter, "--prompt", "abcabc", "--max-tokens", 4, "--json")
    for choice in ("auto", "float32"):
        result = invoke(*common, "--expert-dtype", choice)
        assert result.exit_code == 0, result.output
        assert json_lines(result)[1]["expert_dtype"] == "float32"
    refused = invoke(*common, "--expert-dtype", "bfloat16")
    assert refused.exit_code == 2 and "--expert-dtype" in refused.output and "Traceback" not in refused.output
    on_trtllm = invoke(*common, "--expert-dtype", "float32", "--backend", "trtllm")
    assert on_trtllm.exit_code == 2 and "TensorRT-LLM runs the engine's own MoE kernels" in on_trtllm.output
