"""`dflash-train --extra-sequences`: pools of other lengths mixed into one run, one pool per step."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from trtllm_dflash.errors import InputError
from trtllm_dflash.models.random_pair import save_byte_tokenizer, save_random_target, tiny_target_config
from trtllm_dflash.train import drafter as train_drafter
from trtllm_dflash.train.data import SequencePool, extra_pools, pick_pool
from trtllm_dflash.train.drafter import TrainConfig, train


def test_pick_pool_follows_the_shares_and_a_lone_pool_draws_nothing():
    own, short, long = (SequencePool(torch.zeros(1, 8, dtype=torch.long), 1, share) for share in (0.5, 0.2, 0.3))
    gen = torch.Generator().manual_seed(0)
    picks = [pick_pool([own, short, long], gen) for _ in range(4000)]
    for index, share in enumerate((0.5, 0.2, 0.3)):
        assert abs(picks.count(index) / len(picks) - share) < 0.03
    state = gen.get_state()
    assert pick_pool([own], gen) == 0 and torch.equal(gen.get_state(), state)  # the old random stream


def test_extra_pools_are_checked(tmp_path):
    good = tmp_path / "good.pt"
    torch.save(torch.randint(0, 100, (4, 24)), good)
    assert [p.sequences.shape for p in extra_pools([[str(good), 8, 0.25]], 4, 100)] == [(4, 24)]
    floats, flat, text = tmp_path / "floats.pt", tmp_path / "flat.pt", tmp_path / "notes.txt"
    torch.save(torch.rand(4, 24), floats)
    torch.save(torch.arange(24), flat)
    text.write_text("not a tensor")
    for specs, message in [
        ([[str(tmp_path / "missing.pt"), 8, 0.2]], "no such file"),
        ([[str(text), 8, 0.2]], "not a saved tensor"),
        ([[str(floats), 8, 0.2]], "2-D integer tensor"),
        ([[str(flat), 8, 0.2]], "2-D integer tensor"),
        ([[str(good), 21, 0.2]], "PROMPT_TOKENS 21 leaves no anchor"),
        ([[str(good), 0, 0.2]], "PROMPT_TOKENS 0"),
        ([[str(good), 8, 1.0]], "SHARE 1"),
        ([[str(good), 8, 0.6], [str(good), 8, 0.4]], "sum to 1"),
    ]:
        with pytest.raises(InputError, match=message) as error:
            extra_pools(specs, 4, 100)
        assert "--extra-sequences" in str(error.value)
    with pytest.raises(InputError, match="outside the target's vocabulary of 50"):
        extra_pools([[str(good), 8, 0.2]], 4, 50)


def test_a_run_trains_on_both_lengths_and_keeps_the_pool_across_a_resume(tmp_path, monkeypatch):
    target_dir = save_random_target(tmp_path / "target", tiny_target_config(initializer_range=0.2), seed=3)
    save_byte_tokenizer(target_dir)
    gen = torch.Generator().manual_seed(1)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": torch.randint(0, 256, (16,), generator=gen).tolist()})
                               + "\n" for _ in range(8)))
    long = tmp_path / "long.pt"  # another length: 40-token prompts + 24 tokens (not regenerated: mechanics only)
    torch.save(torch.randint(0, 256, (6, 64), generator=gen), long)
    seen = []  # (sequence length, smallest anchor) of every batch

    def recording_loss(drafter, target, sequences, anchors, *args, **kwargs):
        seen.append((sequences.shape[1], int(anchors.min())))
        return loss(drafter, target, sequences, anchors, *args, **kwargs)

    loss = train_drafter.drafter_loss
    monkeypatch.setattr(train_drafter, "drafter_loss", recording_loss)
    cfg = TrainConfig(block_size=4, num_features=2, prompt_tokens=16, response_tokens=16, num_samples=8,
                      anchors_per_sequence=4, batch_size=4, steps=10, lr=1e-2, save_every_s=1e9,
                      extra_sequences=[[str(long), 40, 0.5]])
    out = tmp_path / "run"
    train(target_dir, out, cfg, "file", prompts, None, torch.device("cpu"), None)
    cfg.steps, cfg.cache_features = 16, True  # the resume caches both pools' features
    train(target_dir, out, cfg, "file", prompts, None, torch.device("cpu"), None)
    history = json.loads((out / "history.json").read_text())
    assert len(seen) == 16 and len(history["loss"]) == 16
    assert history["pools"] == [int(length == 64) for length, _ in seen]  # each step's pool, across the resume
    lengths = {length for length, _ in seen}
    assert lengths == {32, 64}
    assert all(first >= (16 if length == 32 else 40) for length, first in seen)  # anchors in each pool's responses
    moved = [[str(long), 32, 0.5]]
    with pytest.raises(InputError, match="--extra-sequences"):
        train(target_dir, out, TrainConfig(**{**cfg.__dict__, "extra_sequences": moved}), "file", prompts, None,
              torch.device("cpu"), None)


def test_bad_extra_sequences_exit_2_before_the_run_directory_exists(tmp_path):
    target_dir = save_random_target(tmp_path / "target", tiny_target_config())
    save_byte_tokenizer(target_dir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": list(range(16))}) + "\n")
    out = tmp_path / "run"
    result = CliRunner().invoke(train_drafter.main, [
        "--target", str(target_dir), "--prompts", str(prompts), "--out", str(out), "--prompt-tokens", "16",
        "--steps", "1", "--device", "cpu", "--extra-sequences", str(tmp_path / "missing.pt"), "8", "0.2"])
    assert result.exit_code == 2 and "missing.pt" in result.output and "--extra-sequences" in result.output
    assert "Traceback" not in result.output and not out.exists()


class CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def test_package_windows_never_read_the_evaluation_packages_or_vendored_copies(tmp_path):
    from trtllm_dflash.train.packages import package_windows

    for rel, marker in (("numpy/core.py", "a"), ("numpy/_vendor/rich.py", "v"), ("click/core.py", "c")):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(marker * 40000)
    windows = package_windows(CharTokenizer(), 8, 16, seed=1, root=tmp_path, packages=("numpy", "absent"))
    assert len(windows) == 8 and {c for w in windows for c in w} == {ord("a")}
    assert windows == package_windows(CharTokenizer(), 8, 16, seed=1, root=tmp_path, packages=("numpy",))
    with pytest.raises(ValueError, match="third-party evaluation"):
        package_windows(CharTokenizer(), 8, 16, seed=1, root=tmp_path, packages=("numpy", "click"))
