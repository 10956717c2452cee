"""The drafter-training recipe: its attention mask, its block inputs, and a short real run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from trtllm_dflash.checkpoints.gpt_oss import load_hf_gpt_oss
from trtllm_dflash.errors import InputError
from trtllm_dflash.models.drafter import load_drafter
from trtllm_dflash.models.random_pair import (drafter_config_for, save_byte_tokenizer, save_random_drafter,
                                             save_random_target, tiny_target_config)
from trtllm_dflash.models.target import GptOssTarget
from trtllm_dflash.runtime.proposers import DFlashProposer
from trtllm_dflash.runtime.reference import ReferenceRuntime
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.train.anchors import mix_anchors, sample_anchors, walk_anchors
from trtllm_dflash.train.drafter import TrainConfig, train
from trtllm_dflash.train.step import RecordingProposer, block_inputs, drafter_block_logits, training_mask


def test_training_mask_follows_the_three_rules():
    gen = torch.Generator().manual_seed(0)
    block, seq_len = 4, 20
    anchors = sample_anchors(3, 5, 2, seq_len - block, gen)
    mask = training_mask(anchors, block, seq_len)
    n, queries, keys = mask.shape
    assert (n, queries, keys) == (3, 5 * block, seq_len + 5 * block)
    for s in range(n):
        for q in range(queries):
            own = q // block
            for k in range(keys):
                if k < seq_len:  # rule 1: context strictly before the block's anchor
                    expected = k < int(anchors[s, own])
                else:  # rules 2-3: bidirectional inside a block, blocks mutually invisible
                    expected = (k - seq_len) // block == own
                assert bool(mask[s, q, k]) == expected


def test_block_inputs_anchor_masks_and_labels():
    sequences = torch.arange(100, 130)[None]
    anchors = torch.tensor([[3, 10]])
    tokens, positions, labels = block_inputs(sequences, anchors, 4, mask_token_id=7)
    assert tokens.tolist() == [[103, 7, 7, 7, 110, 7, 7, 7]]
    assert positions.tolist() == [[3, 4, 5, 6, 10, 11, 12, 13]]
    assert labels.tolist() == [[103, 104, 105, 106, 110, 111, 112, 113]]  # slot k predicts its own position


def test_walk_anchors_follow_the_runtime():
    """The next anchor is one past the accepted prefix: the verify keeps the leading correct drafts
    and the target's own token follows (a wrong slot 1 drafts again right after the anchor)."""
    anchors = torch.tensor([[3, 10, 20]])
    correct = torch.tensor([[[True, True, False], [False, True, True], [True, True, True]]])
    assert walk_anchors(anchors, correct).tolist() == [[6, 11, 24]]


def test_mix_anchors_takes_walk_positions_then_uniform_ones():
    uniform = torch.tensor([[2, 5, 7, 9], [1, 3, 4, 8]])
    candidates = torch.tensor([[5, 6, 6, 30], [-1, -1, -1, -1]])  # a repeat, one past `last`; none yet
    mixed = mix_anchors(uniform, candidates, fraction=0.75, last=20)
    # row 0: walk positions 5 and 6 (6 once, 30 out of range), then uniform ones not already taken
    assert mixed.tolist() == [[2, 5, 6, 7], [1, 3, 4, 8]]
    assert mix_anchors(uniform, candidates, fraction=0.0, last=20).tolist() == uniform.tolist()


def short_training_run(tmp_path, device: torch.device, resume: bool) -> tuple[Path, Path, list[float]]:
    """40 steps on a tiny random target (12 + 28 resumed on cached features with walk anchors when
    `resume`) -> (target dir, drafter dir, loss history). Shared with the CUDA check in test_gpu.py."""
    # Larger initial weights than the shared fixture: a near-uniform LM head would make the
    # drafter's (frozen, borrowed) logits too flat to show learning in 40 steps.
    target_dir = save_random_target(tmp_path / "target", tiny_target_config(initializer_range=0.2), seed=3)
    save_byte_tokenizer(target_dir)
    prompts = tmp_path / "prompts.jsonl"
    gen = torch.Generator().manual_seed(1)
    prompts.write_text("".join(json.dumps({"prompt_token_ids": torch.randint(0, 256, (16,), generator=gen).tolist()})
                               + "\n" for _ in range(24)))
    cfg = TrainConfig(block_size=4, num_features=2, prompt_tokens=16, response_tokens=32, num_samples=24,
                      anchors_per_sequence=4, batch_size=8, steps=12 if resume else 40, lr=1e-2, save_every_s=1e9)
    out = tmp_path / "run"
    drafter_dir = train(target_dir, out, cfg, "file", prompts, None, device, None)
    if resume:  # the resumed part runs on cached (bf16) target features, half its anchors at walk positions
        cfg.steps, cfg.cache_features, cfg.walk_anchor_fraction = 40, True, 0.5
        drafter_dir = train(target_dir, out, cfg, "file", prompts, None, device, None)  # resumes at 12
    history = json.loads((out / "history.json").read_text())["loss"]
    assert len(history) == 40
    assert sum(history[-5:]) / 5 < 0.9 * sum(history[:5]) / 5
    return target_dir, drafter_dir, history


def check_drafter_is_lossless(target_dir: Path, drafter_dir: Path, device: str) -> None:
    target = GptOssTarget(load_hf_gpt_oss(target_dir, device))
    drafter = load_drafter(drafter_dir, device)
    assert drafter.config.mask_token_id == 257 and drafter.config.block_size == 4
    prompt = torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(2)).tolist()
    spec = ReferenceRuntime(target, DFlashProposer(drafter, target)).generate([prompt], SamplingParams(max_tokens=24))
    ar = ReferenceRuntime(target, None).generate([prompt], SamplingParams(max_tokens=24))
    assert spec[0].output_token_ids == ar[0].output_token_ids


def test_short_run_learns_resumes_and_writes_a_loadable_drafter(tmp_path):
    target_dir, drafter_dir, _ = short_training_run(tmp_path, torch.device("cpu"), resume=True)
    walk = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["walk"]
    assert (walk >= 16).sum() > 0  # walk positions were recorded (and checkpointed) for later visits
    check_drafter_is_lossless(target_dir, drafter_dir, "cpu")


def test_training_forward_gives_the_runtime_drafter_logits(tmp_path):
    """Same weights, same committed sequence, same anchor: the block logits of the training forward
    (`drafter_block_logits`) equal those the runtime's DFlashProposer produced inside the loop
    (prefill + verify features, incremental context K/V, ragged batch, sliding-window target)."""
    config = tiny_target_config()  # sliding window 8: prompts and outputs run past it
    target = GptOssTarget(load_hf_gpt_oss(save_random_target(tmp_path / "target", config, seed=1)))
    drafter = load_drafter(save_random_drafter(tmp_path / "drafter",
                                               drafter_config_for(config, num_layers=2, block_size=4), seed=2))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 256, (n,), generator=gen).tolist() for n in (13, 21)]
    proposer = RecordingProposer(drafter, target)
    results = ReferenceRuntime(target, proposer).generate(prompts, SamplingParams(max_tokens=30), batch_size=2)
    assert len(proposer.positions) > 5
    b = drafter.config.block_size
    checked = 0
    for row, (prompt, result) in enumerate(zip(prompts, results)):
        sequence = torch.tensor([prompt + result.output_token_ids + [0] * b])  # a late block may run past the end
        runtime, anchors = [], []
        for positions, logits in zip(proposer.positions, proposer.logits):
            # rows leave the batch when they finish; both requests decode the same length here
            if row < len(positions):
                anchors.append(int(positions[row]))
                runtime.append(logits[row])
        trained = drafter_block_logits(drafter, target, sequence, torch.tensor([anchors]))[0]
        torch.testing.assert_close(trained, torch.stack(runtime), rtol=1e-4, atol=1e-4)
        checked += len(anchors)
    assert checked == sum(len(p) for p in proposer.positions)


def test_distillation_mixes_cross_entropy_with_the_kl_from_the_targets_next_token_distribution(tmp_path):
    """--distill a: each slot's loss is (1 - a) CE(token) + a KL(target || drafter), with the target's logits at the
    position before the slot's (they predict it), weighted as the CE was; a = 0 is the CE loss itself."""
    from trtllm_dflash.train.step import drafter_loss

    config = tiny_target_config()
    target = GptOssTarget(load_hf_gpt_oss(save_random_target(tmp_path / "target", config, seed=1)))
    drafter = load_drafter(save_random_drafter(tmp_path / "drafter",
                                               drafter_config_for(config, num_layers=1, block_size=4), seed=2))
    drafter.requires_grad_(True)  # as training makes it
    sequences = torch.randint(2, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([[3, 9, 15], [1, 8, 19]])
    gamma = 2.0
    ce, _ = drafter_loss(drafter, target, sequences, anchors, gamma)
    assert torch.equal(drafter_loss(drafter, target, sequences, anchors, gamma, distill=0.0)[0], ce)
    with torch.no_grad():
        teacher, _ = target(sequences, torch.arange(24).expand(2, -1), target.new_cache(2, 24), [])
        drafts = drafter_block_logits(drafter, target, sequences, anchors)  # [2, A, B-1, V]
    previous = anchors[:, :, None] + torch.arange(0, 3)  # slot k's token sits at anchor + k, predicted from one before
    p = torch.log_softmax(teacher[torch.arange(2)[:, None, None], previous], -1)
    kl = (p.exp() * (p - torch.log_softmax(drafts, -1))).sum(-1)  # [2, A, B-1]
    weights = torch.exp(-torch.arange(3) / gamma).expand_as(kl)
    expected_kl = (kl * weights).sum() / weights.sum()
    for share in (1.0, 0.25):
        loss, _ = drafter_loss(drafter, target, sequences, anchors, gamma, distill=share)
        torch.testing.assert_close(loss, (1 - share) * ce.detach() + share * expected_kl, rtol=1e-4, atol=1e-5)
    loss.backward()
    assert all(p.grad is not None for p in drafter.fc.parameters())
    with pytest.raises(ValueError, match="cached features"):
        drafter_loss(drafter, target, sequences, anchors, gamma, torch.zeros(2, 24, 3 * config.hidden_size), distill=1.0)


def warm_started(tmp_path, drafter_layers: int, block_size: int):
    """A 1-layer block-4 drafter saved on a random target, and a fresh `drafter_layers`-layer drafter of `block_size`
    warm-started from it -> (target, the source, the warm-started drafter, the names `warm_start` left fresh)."""
    from trtllm_dflash.train.drafter import new_drafter, warm_start

    config = tiny_target_config()
    target = GptOssTarget(load_hf_gpt_oss(save_random_target(tmp_path / "target", config, seed=1)))
    source_dir = save_random_drafter(tmp_path / "drafter", drafter_config_for(config, block_size=4,
                                                                             target_layer_ids=[0, 2]), seed=2)
    source = load_drafter(source_dir)
    cfg = TrainConfig(drafter_layers=drafter_layers, block_size=block_size, target_layer_ids=[0, 2],
                      intermediate_size=source.config.intermediate_size)
    drafter = new_drafter(target, cfg, source.config.mask_token_id)
    return target, source, drafter, warm_start(drafter, source_dir)


def test_warm_start_grows_a_drafter_without_changing_its_output(tmp_path):
    """--init-from: a 2-layer drafter started from a 1-layer one gives the 1-layer logits at step 0."""
    target, shallow, deep, fresh = warm_started(tmp_path, drafter_layers=2, block_size=4)
    assert fresh and all(name.startswith("layers.1.") for name in fresh)
    sequence = torch.randint(2, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([[3, 9, 15]])
    torch.testing.assert_close(drafter_block_logits(deep, target, sequence, anchors),
                               drafter_block_logits(shallow, target, sequence, anchors))


def test_warm_start_takes_every_tensor_of_a_drafter_with_another_block_size(tmp_path):
    """--init-from a block-4 drafter into a block-6 run: no tensor depends on the block, so all are copied."""
    _, source, wider, fresh = warm_started(tmp_path, drafter_layers=1, block_size=6)
    assert fresh == [] and wider.config.block_size == 6
    for name, tensor in source.state_dict().items():
        torch.testing.assert_close(wider.state_dict()[name], tensor, rtol=0, atol=0)


def test_bad_training_input_fails_before_the_run_directory_exists(tmp_path):
    from click.testing import CliRunner

    from trtllm_dflash.train.drafter import main

    target_dir = save_random_target(tmp_path / "target", tiny_target_config())
    save_byte_tokenizer(target_dir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": list(range(16))}) + "\n")
    broken = save_random_drafter(tmp_path / "broken", drafter_config_for(tiny_target_config()))
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "hidden_size": 2 * config["hidden_size"]}))
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    out = tmp_path / "run"
    for args, message in [
        (["--target-layer-ids", "0,9"], "--target-layer-ids"),
        (["--target-layer-ids", "0,x"], "--target-layer-ids"),
        (["--block-size", "1"], "--block-size"),
        (["--batch-size", "0"], "--batch-size"),
        (["--init-from", broken], "broken"),
        (["--prompts", tmp_path / "missing.jsonl"], "missing.jsonl"),
        (["--out", a_file / "run"], "notes.txt is a file"),
        (["--distill", "0.5", "--cache-features"], "--distill"),
        (["--distill", "1.5"], "--distill"),
    ]:
        result = CliRunner().invoke(main, [str(a) for a in ["--target", target_dir, "--prompts", prompts,
                                                            "--out", out, "--prompt-tokens", 16, "--steps", 1,
                                                            "--device", "cpu", *args]])
        assert result.exit_code == 2 and message in result.output, result.output
        assert "Traceback" not in result.output
        assert not out.exists() and not (a_file / "run").exists()


def test_a_resume_with_other_settings_is_refused(tmp_path):
    target_dir, _, _ = short_training_run(tmp_path, torch.device("cpu"), resume=False)
    saved = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["config"]
    cfg = TrainConfig(**{k: v for k, v in saved.items()})
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "run"
    for change in ({"block_size": 8}, {"drafter_layers": 2}, {"response_tokens": 48}):
        with pytest.raises(InputError, match=f"--{next(iter(change)).replace('_', '-')}"):
            train(target_dir, out, dataclasses.replace(cfg, **change), "file", prompts, None, torch.device("cpu"),
                  None)
    (out / "checkpoint.pt").unlink()  # the cached responses alone also fix the sequence length
    with pytest.raises(InputError, match="cached sequences are 48 tokens long"):
        train(target_dir, out, dataclasses.replace(cfg, response_tokens=40), "file", prompts, None,
              torch.device("cpu"), None)


@pytest.mark.parametrize("num_layers", range(2, 49))
def test_default_feature_layers_are_distinct_and_below_the_last(num_layers):
    from trtllm_dflash.train.drafter import training_layer_ids

    for num_features in range(1, min(num_layers - 1, 6) + 1):
        ids = training_layer_ids(num_layers, num_features)
        assert len(ids) == num_features and len(set(ids)) == num_features, ids
        assert all(0 <= i < num_layers - 1 for i in ids), ids
    with pytest.raises(InputError, match="--num-features"):
        training_layer_ids(num_layers, num_layers)


def test_feature_layers_follow_z_lab_when_deep_enough_and_repeats_are_refused():
    from trtllm_dflash.train.drafter import check_training_layer_ids, training_layer_ids

    assert training_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # z-lab's spread over [1, L-3]
    assert training_layer_ids(4, 3) == [0, 1, 2]  # z-lab's rule gives [1, 1, 1] here
    with pytest.raises(InputError, match=r"ids \[1\] are repeated"):
        check_training_layer_ids([1, 1, 2], 4)
    assert check_training_layer_ids([0, 1, 2], 4) is None
    warning = check_training_layer_ids([1, 3], 4)
    assert "layer 3, the target's last layer" in warning and "TensorRT-LLM" in warning


def test_replayed_walk_anchors_are_the_runtimes_anchors():
    """On the shipped pair, where drafts are often accepted: the walk `replay_walk` replays on the
    committed sequence visits exactly the anchors the runtime drafted from, and gets its tau."""
    from trtllm_dflash.embedded import heldout_prompts, pair_paths
    from trtllm_dflash.prompts import encode_prompts, load_tokenizer
    from trtllm_dflash.train.anchors import replay_walk
    from trtllm_dflash.train.data import target_features

    target_dir, drafter_dir = pair_paths()
    target = GptOssTarget(load_hf_gpt_oss(target_dir))
    drafter = load_drafter(drafter_dir)
    prompt = encode_prompts(heldout_prompts(2)[1:], load_tokenizer(target_dir))[0]
    proposer = RecordingProposer(drafter, target)
    result = ReferenceRuntime(target, proposer).generate([prompt], SamplingParams(max_tokens=40))[0]
    sequence = torch.tensor([prompt + result.output_token_ids])
    runtime = [int(p[0]) for p in proposer.positions]
    features = target_features(target, sequence, drafter.config.target_layer_ids)
    paths, tau = replay_walk(drafter, target, sequence, features, len(prompt))
    b = drafter.config.block_size
    assert paths[0].tolist() == [a for a in runtime if a <= sequence.shape[1] - b]  # the walk stops at a full block
    assert len(runtime) < 30  # drafts were accepted: the walk skips positions
    n = len(paths[0])
    assert n < len(runtime) and tau == pytest.approx((runtime[n] - runtime[0]) / n)  # tokens per block


def test_path_rows_take_a_share_of_the_batch_from_replayed_sequences():
    from trtllm_dflash.train.anchors import path_rows

    paths = {5: torch.tensor([20, 21, 25]), 9: torch.tensor([30, 34])}
    rows = torch.arange(100, 164)
    gen = torch.Generator().manual_seed(0)
    mixed, candidates = path_rows(rows, paths, 0.5, 4, gen)
    pooled = mixed < 100
    assert 16 < int(pooled.sum()) < 48 and set(mixed[pooled].tolist()) <= {5, 9}
    assert (mixed[~pooled] == rows[~pooled]).all() and (candidates[~pooled] == -1).all()
    for row, picked in zip(mixed[pooled].tolist(), candidates[pooled].tolist()):
        taken = [p for p in picked if p >= 0]
        assert sorted(taken) == sorted(paths[row].tolist())  # shorter paths than --anchors: all of them
    assert path_rows(rows, paths, 0.0, 4, gen)[0].tolist() == rows.tolist()


def test_build_validation_warns_on_a_drafter_that_reads_the_last_layer(tmp_path):
    from click.testing import CliRunner

    from trtllm_dflash.checkpoints.validate import validate_pair
    from trtllm_dflash.cli.build import main as build_main

    config = tiny_target_config()
    target_dir = save_random_target(tmp_path / "target", config)
    save_byte_tokenizer(target_dir)
    portable = save_random_drafter(tmp_path / "portable", drafter_config_for(config, target_layer_ids=[0, 2]))
    last = save_random_drafter(tmp_path / "last", drafter_config_for(config, target_layer_ids=[1, 3]))
    assert validate_pair(target_dir, portable).warnings == ()
    (warning,) = validate_pair(target_dir, last).warnings
    assert "layer 3, the target's last layer" in warning and "hidden_states[4]" in warning
    result = CliRunner().invoke(build_main, ["--target", str(target_dir), "--drafter", str(last), "-o",
                                             str(tmp_path / "engine"), "--profile", "cpu-reference", "--check"])
    assert result.exit_code == 0 and "warning:" in result.output and "last layer" in result.output, result.output
