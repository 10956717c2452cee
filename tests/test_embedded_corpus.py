"""Embedded default target: corpus split, tokenizer, training loop, resume and MXFP4 export."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from trtllm_dflash.quant.codecs import mxfp4_decode
from trtllm_dflash.train import corpus, target, tokenizer

torch.set_num_threads(1)

CODE_SAMPLES = [
    "def f(x):\n\tif x:\n        return  'é'  \n\n\n",
    "class A:\n    def __init__(self, a, b):\n        self.a = a  # trailing   \n        self.b = b\r\n",
    "    \n  x = [1,\n       2]\n\u00a0weird\u200bspace = '日本語'\n",
    "",
]

# Tiny model for tests: hidden 64 keeps H/32 = 2 MXFP4 blocks per row.
TINY = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=8)


@pytest.fixture(scope="module")
def split():
    return corpus.split_files()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, split):
    """A small BPE (vocab 320) trained on a slice of the train split, saved like the real one."""
    root = corpus.stdlib_root()
    texts = [corpus.read_source(root / f) for f in split["train"][:40]]
    out = tmp_path_factory.mktemp("tok")
    tokenizer.save(tokenizer.train_bpe(texts, vocab_size=320), out)
    return out


def test_split_is_disjoint_deterministic_and_by_hash(split):
    assert split["train"] and split["heldout"]
    assert not set(split["train"]) & set(split["heldout"])
    assert corpus.split_files() == split
    assert all(corpus.is_heldout(f) for f in split["heldout"])
    assert not any(corpus.is_heldout(f) for f in split["train"])
    frac = len(split["heldout"]) / (len(split["train"]) + len(split["heldout"]))
    assert 0.02 < frac < 0.10
    assert not any(part in corpus.SKIP_DIRS for f in split["train"] for part in f.split("/")[:-1])
    rec = corpus.split_record()
    assert rec["heldout_files"] == split["heldout"]
    assert rec["list_sha256"] == corpus.split_record()["list_sha256"]
    json.dumps(rec)


def test_corpus_v2_adds_test_suites_and_moves_no_v1_file(split):
    v2 = corpus.split_files(version=2)
    assert set(split["train"]) < set(v2["train"]) and set(split["heldout"]) < set(v2["heldout"])
    assert not set(v2["train"]) & set(v2["heldout"])
    added = set(v2["train"]) - set(split["train"])
    assert all("test" in f.split("/")[:-1] for f in added)
    assert not any(part in {"tests", "idle_test"} for f in added for part in f.split("/")[:-1])
    assert all(corpus.is_heldout(f) for f in v2["heldout"])
    assert corpus.split_record(version=2)["corpus_version"] == 2


def test_heldout_prompts_come_from_heldout_files(split):
    prompts = corpus.heldout_prompts(50)
    assert prompts == corpus.heldout_prompts(50)
    root = corpus.stdlib_root()
    for p in prompts:
        assert p.path in split["heldout"]
        n = p.text.count("\n") + 1
        assert corpus.PROMPT_MIN_LINES <= n <= corpus.PROMPT_MAX_LINES and p.text.splitlines()[0].strip()
        lines = corpus.read_source(root / p.path).splitlines(keepends=True)
        assert "".join(lines[p.line - 1 : p.line - 1 + n]) == p.text + "\n"  # whole lines, last newline cut
        assert len(lines) > p.line - 1 + n


def test_tokenizer_round_trips_code_and_has_dedicated_specials(tok_dir, split):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    assert json.loads((tok_dir / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tok.eos_token == tokenizer.EOS_TOKEN and tok.pad_token_id == tok.eos_token_id
    assert tok.mask_token == tokenizer.MASK_TOKEN and tok.mask_token_id != tok.eos_token_id
    assert tok.encode(tokenizer.EOS_TOKEN) == [tok.eos_token_id]
    assert tok.encode(tokenizer.MASK_TOKEN) == [tok.mask_token_id]
    root = corpus.stdlib_root()
    for text in CODE_SAMPLES + [corpus.read_source(root / f) for f in split["heldout"][:3]]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.eos_token_id not in ids and tok.mask_token_id not in ids
    ids = tok.encode("x = 1" + tokenizer.EOS_TOKEN + tokenizer.MASK_TOKEN)
    assert ids[-2:] == [tok.eos_token_id, tok.mask_token_id]


def test_training_steps_decrease_loss(tok_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    model = target.build_model(target.model_config(len(tok), tok.eos_token_id, **TINY)).train()
    opt = target.make_optimizer(model, lr=3e-3)
    ids = tok.encode(CODE_SAMPLES[1] * 8)[:65]
    batch = torch.tensor([ids, ids])
    losses = []
    for _ in range(15):
        ce, loss = target.lm_loss(model, batch, aux=True)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(ce.item())
    assert losses[-1] < losses[0] - 1.0


def _fake_texts(split_name: str, root=None, version: int = 1):
    root = corpus.stdlib_root()
    files = corpus.split_files(version=version)[split_name][:3]
    return iter(corpus.read_source(root / f)[:4000] for f in files)


def _run(out: Path, tok_dir: Path, monkeypatch, interrupt_at: int | None = None) -> dict:
    """Train 6 steps of the tiny model; optionally SIGINT the process while drawing batch ``interrupt_at``."""
    monkeypatch.setattr(corpus, "iter_texts", _fake_texts)
    real_get_batch = target.get_batch

    def get_batch(data, step, batch, seq_len, seed=target.SEED):
        if step == interrupt_at:
            os.kill(os.getpid(), signal.SIGINT)
        return real_get_batch(data, step, batch, seq_len, seed)

    monkeypatch.setattr(target, "get_batch", get_batch)
    return target.train(out, tok_dir, total_steps=6, max_minutes=10, seq_len=32, long_seq_len=64, eval_every=1000,
                        log_every=1000, config_overrides=TINY)


def test_resume_continues_same_steps_and_weights(tmp_path, tok_dir, monkeypatch):
    straight = _run(tmp_path / "a", tok_dir, monkeypatch)
    assert straight["step"] == 6
    first = _run(tmp_path / "b", tok_dir, monkeypatch, interrupt_at=2)
    assert first["step"] == 3  # the signalled step finishes, then the run checkpoints and stops
    assert torch.load(tmp_path / "b" / "ckpt.pt", weights_only=False)["step"] == 3
    resumed = _run(tmp_path / "b", tok_dir, monkeypatch)
    assert resumed["step"] == 6 and resumed["tokens"] == straight["tokens"]
    a = torch.load(tmp_path / "a" / "ckpt.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "b" / "ckpt.pt", weights_only=False)["model"]
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
    evals = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [6] and evals[0]["heldout_loss"] > 0


def test_init_from_starts_a_new_run_from_the_weights_and_the_corpus_is_fixed(tmp_path, tok_dir, monkeypatch):
    _run(tmp_path / "a", tok_dir, monkeypatch)
    source = torch.load(tmp_path / "a" / "ckpt.pt", weights_only=False)
    meta = target.train(tmp_path / "b", tok_dir, total_steps=0, max_minutes=1, init_from=tmp_path / "a" / "ckpt.pt")
    assert meta["step"] == 0 and meta["init_from"] == str(tmp_path / "a" / "ckpt.pt")
    started = torch.load(tmp_path / "b" / "ckpt.pt", weights_only=False)
    for k, v in source["model"].items():
        torch.testing.assert_close(started["model"][k], v, rtol=0, atol=0, msg=k)
    assert not started["optimizer"]["state"]  # fresh optimizer: a warm restart, not a resume
    with pytest.raises(SystemExit, match="started on corpus v1, not v2"):
        target.train(tmp_path / "b", tok_dir, total_steps=1, max_minutes=1, corpus_version=2)


def test_export_is_gpt_oss_mxfp4_and_loads_with_transformers(tmp_path, tok_dir):
    from transformers import GptOssForCausalLM, Mxfp4Config

    torch.manual_seed(0)
    model = target.build_model(target.model_config(320, 0, **TINY)).eval()
    with torch.no_grad():  # non-trivial biases and sinks, so their export is checked too
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith("_bias") or name.endswith("sinks"):
                p.normal_(0, 0.1)
    dest = target.export(model, tok_dir, tmp_path / "export")

    cfg = json.loads((dest / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"
    assert cfg["model_type"] == "gpt_oss" and cfg["vocab_size"] == 320 and cfg["rope_scaling"]["rope_type"] == "yarn"
    assert json.loads((dest / "generation_config.json").read_text())["eos_token_id"] == [0]
    E, H, I = 4, 64, 64
    with safe_open(dest / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
        gu_b = f.get_tensor("model.layers.0.mlp.experts.gate_up_proj_blocks")
        gu_s = f.get_tensor("model.layers.0.mlp.experts.gate_up_proj_scales")
        assert gu_b.dtype == torch.uint8 and gu_b.shape == (E, 2 * I, H // 32, 16) and gu_s.shape == (E, 2 * I, H // 32)
        d_b = f.get_tensor("model.layers.1.mlp.experts.down_proj_blocks")
        assert d_b.shape == (E, H, I // 32, 16)
        # stored [E, out=2I, in=H] is the in-memory [E, H, 2I] transposed (gate/up interleave kept)
        in_memory = model.model.layers[0].mlp.experts.gate_up_proj.detach().transpose(1, 2)
        cos = torch.nn.functional.cosine_similarity(mxfp4_decode(gu_b, gu_s).flatten(), in_memory.flatten(), dim=0)
        assert cos > 0.98, cos
        for k in keys:
            if not k.endswith(("_blocks", "_scales")):
                assert f.get_tensor(k).dtype == torch.bfloat16, k
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in keys)

    loaded = GptOssForCausalLM.from_pretrained(str(dest), quantization_config=Mxfp4Config(dequantize=True),
                                               attn_implementation="eager", dtype=torch.float32).eval()
    x = torch.randint(0, 320, (2, 24))
    with torch.no_grad():
        original = model(x).logits
        got = loaded(x).logits
        ref = target.apply_mxfp4_roundtrip_(model)
        for p in ref.parameters():  # the file stores everything else in bf16 (buffers like inv_freq stay fp32)
            p.copy_(p.to(torch.bfloat16))
        expected = ref(x).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    err = (got - original).abs().max() / original.abs().max()
    assert err < 0.05, err
