"""The shipped embedded pair: it loads offline, fits together, and the no-argument commands run on it."""

from __future__ import annotations

import json

from click.testing import CliRunner

from trtllm_dflash.checkpoints.validate import validate_pair
from trtllm_dflash.embedded import PROMPTS_FILE, ROOT, heldout_prompts, pair_paths


def test_pair_is_shipped_small_and_fits():
    target, drafter = pair_paths()
    pair = validate_pair(target, drafter)
    assert pair.target_config["quantization_config"]["quant_method"] == "mxfp4"  # stored as gpt-oss ships
    assert pair.drafter_config.mask_token_id == 1
    size = sum(f.stat().st_size for f in ROOT.rglob("*") if f.is_file())
    assert size < 25e6
    assert len(heldout_prompts()) == 4 and len(PROMPTS_FILE.read_text().splitlines()) == 64


def test_heldout_prompts_come_from_heldout_files():
    split = json.loads((ROOT / "corpus_split.json").read_text())
    heldout = set(split["heldout_files"])
    for line in PROMPTS_FILE.read_text().splitlines():
        assert json.loads(line)["source"].rsplit(":", 1)[0] in heldout


def test_dflash_run_without_arguments(tmp_path, monkeypatch):
    from trtllm_dflash.cli.run import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the embedded engine is built once, here
    result = CliRunner().invoke(main, ["--max-tokens", "24", "--json"])
    assert result.exit_code == 0, result.output
    *records, summary = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(records) == 4 and all(r["num_output_tokens"] > 0 for r in records) and summary["summary"]
    assert (tmp_path / "trtllm-dflash").is_dir()
    again = CliRunner().invoke(main, ["--max-tokens", "8", "--baseline"])  # reuses the cached engine
    assert again.exit_code == 0 and "building the embedded default engine" not in again.output
    assert "outputs identical to baseline" in again.output
