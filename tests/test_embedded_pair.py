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


def test_shipped_drafter_reads_no_last_layer_and_has_a_window():
    target, drafter = pair_paths()
    pair = validate_pair(target, drafter)
    assert pair.warnings == ()
    last = pair.target_config["num_hidden_layers"] - 1
    assert last not in pair.drafter_config.target_layer_ids
    assert pair.drafter_config.sliding_window is not None


def hf_convention_dflash(hf, drafter, prompt: list[int], max_tokens: int) -> tuple[list[int], list[int]]:
    """A greedy DFlash loop on transformers alone, fed as z-lab's reference feeds a drafter: the context
    features of target layer i are `hidden_states[i + 1]` of `output_hidden_states` (after the final
    norm for the last layer). No caches: the target reruns the whole sequence every step, and the
    next block's context features come from that verify pass. -> (output tokens, accepted per step)."""
    import torch

    from trtllm_dflash.train.step import training_mask

    cfg, b = drafter.config, drafter.config.block_size

    def run(ids):
        with torch.no_grad():
            return hf(torch.tensor([ids]), output_hidden_states=True)

    ids = list(prompt)
    out = run(ids)
    ids.append(int(out.logits[0, -1].argmax()))
    accepted = []
    while len(ids) - len(prompt) < max_tokens:
        s = len(ids) - 1  # the anchor: context is [0, s)
        features = torch.cat([out.hidden_states[i + 1][:, :s] for i in cfg.target_layer_ids], dim=-1)
        block = torch.tensor([[ids[s]] + [cfg.mask_token_id] * (b - 1)])
        with torch.no_grad():
            hidden = drafter.forward_train(features, torch.arange(s)[None], hf.get_input_embeddings()(block),
                                           s + torch.arange(b)[None], training_mask(torch.tensor([[s]]), b, s,
                                                                                    cfg.sliding_window))
            drafts = hf.lm_head(hidden[:, 1:]).argmax(-1)[0].tolist()
        out = run(ids + drafts)
        verdict = out.logits[0, s:].argmax(-1).tolist()
        m = 0
        while m < b - 1 and drafts[m] == verdict[m]:
            m += 1
        accepted.append(m)
        ids += drafts[:m] + [verdict[m]]
    return ids[len(prompt):][:max_tokens], accepted


def test_a_transformers_feature_loop_drafts_like_our_runtime():
    """z-lab portability: the shipped drafter fed HF-convention features gets our runtime's tokens
    and per-step acceptance (it would not if it read the last layer: that one is post-norm in HF)."""
    import torch

    from trtllm_dflash.checkpoints.gpt_oss import load_hf_gpt_oss
    from trtllm_dflash.models.drafter import load_drafter
    from trtllm_dflash.models.target import GptOssTarget
    from trtllm_dflash.prompts import encode_prompts, load_tokenizer
    from trtllm_dflash.runtime.proposers import DFlashProposer
    from trtllm_dflash.runtime.reference import ReferenceRuntime
    from trtllm_dflash.runtime.sampling import SamplingParams

    target_dir, drafter_dir = pair_paths()
    hf = load_hf_gpt_oss(target_dir, "cpu", torch.float32)
    target, drafter = GptOssTarget(hf), load_drafter(drafter_dir)
    for prompt in encode_prompts(heldout_prompts(2), load_tokenizer(target_dir)):
        ours = ReferenceRuntime(target, DFlashProposer(drafter, target)).generate([prompt], SamplingParams(max_tokens=48))
        tokens, accepted = hf_convention_dflash(hf, drafter, prompt, 48)
        assert tokens == ours[0].output_token_ids
        assert accepted == ours[0].stats.accepted_per_step and max(accepted) > 0
