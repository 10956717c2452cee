"""Converter tests on tiny synthetic gpt-oss and DFlash-drafter checkpoints.

Closeness metric for the round trip: per tensor, relative Frobenius error ||dq - ref|| / ||ref||
against the exactly decoded source. Expected: 0 for none/mxfp4 (lossless), 0 for NVFP4 experts
(exact MXFP4 re-expression), <= 0.05 for FP8 tensors (E4M3 keeps 3 mantissa bits: ~2**-5 rms),
<= 0.15 for NVFP4 tensors quantized from bf16 (drafter MLP).

gpt-oss layout (TensorRT-LLM's modeling_gpt_oss.load_nvfp4_weights): NVFP4 experts
``[E, in/2, out]`` uint8 + ``[E, in/16, out]`` e4m3 + scalar fp32 ``*_weight_scale_2`` and
``*_input_scale``; quant_algo NVFP4; attention bf16. fp8 on gpt-oss: FP8 attention, bf16 experts.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from pathlib import Path

import pytest
import torch

from trtllm_dflash.checkpoints import safetensors_io
from trtllm_dflash.checkpoints.safetensors_io import FileRange, ShardedReader, StreamingShardWriter, TensorInfo, save_sharded
from trtllm_dflash.errors import InputError
from trtllm_dflash.quant import jobs as jobs_mod
from trtllm_dflash.quant.codecs import e2m1_decode, mxfp4_decode, mxfp4_encode
from trtllm_dflash.quant.convert import convert_checkpoint, load_dequantized_state_dict
from trtllm_dflash.quant.recipes import RECIPES

transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)

LAYERS, HIDDEN, EXPERTS = 2, 64, 4
EXPERT_PARAMS = ("experts.gate_up_proj", "experts.down_proj")
# calibrated input amax for every gpt-oss expert tensor: NVFP4 experts cannot be converted without it
EXPERT_AMAX = {f"model.layers.{i}.mlp.{p}": 4.0 + i for i in range(LAYERS) for p in EXPERT_PARAMS}


def amax_for(recipe: str) -> dict[str, float] | None:
    return EXPERT_AMAX if recipe == "nvfp4" else None


def tiny_config() -> transformers.GptOssConfig:
    return transformers.GptOssConfig(
        num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=EXPERTS, num_experts_per_tok=2, vocab_size=128,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"], max_position_embeddings=4096,
    )


@pytest.fixture(scope="module")
def gptoss_dir(tmp_path_factory) -> Path:
    """Random tiny GptOss saved like the released checkpoint: MXFP4 experts, bf16 rest, 3 shards."""
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(tiny_config())
    state = {}
    for name, value in model.state_dict().items():
        if name.endswith(EXPERT_PARAMS):  # transformers holds [E, in, out]; the checkpoint [E, out, in]
            state[name + "_blocks"], state[name + "_scales"] = mxfp4_encode(value.transpose(-1, -2))
        else:
            state[name] = value.to(torch.bfloat16)
    directory = tmp_path_factory.mktemp("gptoss")
    save_sharded(directory, state, max_shard_bytes=120_000)
    config = tiny_config().to_dict() | {
        "architectures": ["GptOssForCausalLM"],
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]},
    }
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text('{"eos_token_id": 1}')
    (directory / "tokenizer_config.json").write_text("{}")
    return directory


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory) -> Path:
    """A 1-layer DFlash drafter with the z-lab tensor names (no model. prefix, no embeddings)."""
    g = torch.Generator().manual_seed(1)
    h, inter = 64, 96

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    state = {"fc.weight": w(h, 3 * h), "hidden_norm.weight": w(h), "norm.weight": w(h)}
    p = "layers.0."
    for name, out in (("q_proj", 64), ("k_proj", 32), ("v_proj", 32), ("o_proj", h)):
        state[p + f"self_attn.{name}.weight"] = w(out, 64 if name == "o_proj" else h)
    state[p + "self_attn.q_proj.bias"] = w(64)
    state.update({p + "self_attn.q_norm.weight": w(16), p + "self_attn.k_norm.weight": w(16)})
    state.update({p + "input_layernorm.weight": w(h), p + "post_attention_layernorm.weight": w(h)})
    state.update({p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h), p + "mlp.down_proj.weight": w(h, inter)})
    directory = tmp_path_factory.mktemp("drafter")
    save_sharded(directory, state)
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 8,
              "dflash_config": {"mask_token_id": 5, "target_layer_ids": [0, 1, 2]}}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def check_index(directory: Path) -> dict[str, str]:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    reader = ShardedReader(directory)
    assert index["weight_map"] == {n: f.name for n, f in reader.files.items()}
    assert index["metadata"]["total_size"] == sum(i.nbytes for i in reader.infos.values())
    return index["weight_map"]


# ----------------------------------------------------------------------------------------------
# source fixture matches transformers


def test_fixture_decodes_like_transformers(gptoss_dir):
    model = transformers.GptOssForCausalLM.from_pretrained(
        gptoss_dir, dtype=torch.bfloat16, quantization_config=transformers.Mxfp4Config(dequantize=True)
    )
    ours = load_dequantized_state_dict(gptoss_dir)
    theirs = model.state_dict()
    for layer in range(LAYERS):
        for param in EXPERT_PARAMS:
            name = f"model.layers.{layer}.mlp.{param}"
            assert torch.equal(theirs[name].float(), ours[name]), name
    assert set(ours) == set(theirs)


# ----------------------------------------------------------------------------------------------
# every recipe on the gpt-oss target


def expected_tensor(name: str, recipe: str, reader: ShardedReader) -> list[tuple[str, torch.dtype, tuple]]:
    """The output tensors (name, dtype, shape) a source tensor should turn into."""
    info = reader.infos[name]
    expert = name.endswith(tuple(p + "_blocks" for p in EXPERT_PARAMS))
    attention = name.endswith("_proj.weight") and "self_attn" in name
    if name.endswith(tuple(p + "_scales" for p in EXPERT_PARAMS)):  # consumed with its blocks
        return [(name, torch.uint8, info.shape)] if recipe == "mxfp4" else []
    if expert:
        base = name.removesuffix("_blocks")
        e, out, nb, _ = info.shape
        if recipe == "mxfp4":
            return [(name, torch.uint8, info.shape)]
        if recipe in ("none", "fp8"):  # fp8 keeps gpt-oss experts bf16 (no FP8 expert path in TensorRT-LLM)
            return [(base, torch.bfloat16, (e, nb * 32, out))]
        # nvfp4: [E, in/2, out] codes, [E, in/16, out] block scales, scalar global and input scales
        return [(base, torch.uint8, (e, nb * 16, out)), (base + "_weight_scale", torch.float8_e4m3fn, (e, nb * 2, out)),
                (base + "_weight_scale_2", torch.float32, ()), (base + "_input_scale", torch.float32, ())]
    if attention and recipe == "fp8":  # nvfp4 keeps gpt-oss attention bf16 (TensorRT-LLM forces it)
        return [(name, torch.float8_e4m3fn, info.shape), (name + "_scale", torch.float32, ())]
    return [(name, info.dtype, info.shape)]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_on_gptoss(gptoss_dir, tmp_path, recipe):
    dst = tmp_path / "out"
    result = convert_checkpoint(gptoss_dir, dst, recipe, kv_cache_dtype="fp8", input_amax=amax_for(recipe), progress=False)
    source = ShardedReader(gptoss_dir)
    out = ShardedReader(dst)
    want = {n: (d, s) for name in source.infos for n, d, s in expected_tensor(name, recipe, source)}
    assert {n: (i.dtype, i.shape) for n, i in out.infos.items()} == want
    check_index(dst)
    assert (dst / "generation_config.json").exists() and (dst / "tokenizer_config.json").exists()
    assert not list(tmp_path.glob(".out.*"))  # temporary directory renamed away

    config = json.loads((dst / "config.json").read_text())
    hf_quant_path = dst / "hf_quant_config.json"
    if recipe == "mxfp4":
        assert config["quantization_config"]["quant_method"] == "mxfp4" and not hf_quant_path.exists()
    else:
        hf_quant = json.loads(hf_quant_path.read_text())["quantization"]
        assert hf_quant["kv_cache_quant_algo"] == "FP8"
        assert {"lm_head", "*router*", "*embed_tokens*"} <= set(hf_quant["exclude_modules"])
        assert hf_quant["quant_algo"] == {"none": None, "fp8": "FP8", "nvfp4": "NVFP4"}[recipe]
        assert "quantized_layers" not in hf_quant  # GptOssForCausalLM ignores per-layer configs
        assert config["quantization_config"]["quant_method"] == "modelopt"
        assert config["quantization_config"]["quant_algo"] == hf_quant["quant_algo"]
    if recipe == "nvfp4":
        assert hf_quant["group_size"] == 16 and "*self_attn*" in hf_quant["exclude_modules"]
        assert set(result.formats) == set(EXPERT_AMAX)  # experts only
    if recipe == "fp8":
        assert "*mlp.experts*" in hf_quant["exclude_modules"]
        assert all("self_attn" in n for n in result.formats) and len(result.formats) == LAYERS * 4

    ref, dq = load_dequantized_state_dict(gptoss_dir), load_dequantized_state_dict(dst)
    assert dq.keys() == ref.keys()
    for name in ref:
        err = rel_err(dq[name], ref[name])
        quantized = name in result.formats
        expert = name.endswith(EXPERT_PARAMS)
        limit = 0.05 if quantized and not (expert and recipe in ("nvfp4", "mxfp4")) else 0.0
        assert err <= limit, (name, err)


def test_none_recipe_loads_in_transformers_with_identical_logits(gptoss_dir, tmp_path):
    convert_checkpoint(gptoss_dir, tmp_path / "bf16", "none", progress=False)
    plain = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    mx = transformers.GptOssForCausalLM.from_pretrained(
        gptoss_dir, dtype=torch.bfloat16, quantization_config=transformers.Mxfp4Config(dequantize=True)
    )
    ids = torch.arange(12).view(1, 12)
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, mx(ids).logits)


def test_input_amax_becomes_input_scale(gptoss_dir, tmp_path):
    amax = EXPERT_AMAX | {"model.layers.1.mlp.experts.down_proj": 12.0}
    convert_checkpoint(gptoss_dir, tmp_path / "o", "nvfp4", input_amax=amax, progress=False)
    reader = ShardedReader(tmp_path / "o")
    assert reader.read("model.layers.1.mlp.experts.down_proj_input_scale").item() == pytest.approx(12.0 / (6 * 448))
    convert_checkpoint(gptoss_dir, tmp_path / "f", "fp8", input_amax={"model.layers.0.self_attn.q_proj.weight": 3.0},
                       progress=False)
    assert ShardedReader(tmp_path / "f").read("model.layers.0.self_attn.q_proj.input_scale").item() == pytest.approx(3.0 / 448)
    with pytest.raises(InputError, match="input_amax"):
        convert_checkpoint(gptoss_dir, tmp_path / "p", "nvfp4", input_amax={"model.norm.weight": 1.0}, progress=False)
    with pytest.raises(InputError, match="no FP8/NVFP4 weight"):  # gpt-oss attention stays bf16 under nvfp4
        convert_checkpoint(gptoss_dir, tmp_path / "q", "nvfp4",
                           input_amax=EXPERT_AMAX | {"model.layers.0.self_attn.q_proj.weight": 3.0}, progress=False)


@pytest.mark.parametrize("drop", [None, "model.layers.1.mlp.experts.down_proj"])
def test_nvfp4_gptoss_refused_without_calibration(gptoss_dir, tmp_path, drop):
    """TensorRT-LLM's NVFP4 MoE loader needs gate_up/down *_input_scale: no amax, no checkpoint."""
    amax = None if drop is None else {k: v for k, v in EXPERT_AMAX.items() if k != drop}
    with pytest.raises(InputError) as info:
        convert_checkpoint(gptoss_dir, tmp_path / "o", "nvfp4", input_amax=amax, progress=False)
    message = str(info.value)
    missing = drop or "model.layers.0.mlp.experts.down_proj"
    assert f"input_amax[{missing!r}]" in message and "_input_scale" in message
    assert "quant.calibrate" in message and "dflash-build" in message
    assert not (tmp_path / "o").exists() and os.listdir(tmp_path) == []


def unpack_input_dim(q: torch.Tensor) -> torch.Tensor:
    """``[E, in/2, out]`` uint8 -> ``[E, in, out]`` FP4 codes, low nibble = even input element (the
    loader's convention; written independently of the converter's own decode)."""
    return torch.stack((q & 0x0F, q >> 4), dim=2).flatten(1, 2)


def test_nvfp4_gptoss_layout_matches_trtllm_loader(gptoss_dir, tmp_path):
    """Names, dtypes, shapes and values as TensorRT-LLM's gpt-oss NVFP4 loader reads them, and a
    bit-exact decode (in that orientation) against the MXFP4 source."""
    convert_checkpoint(gptoss_dir, tmp_path / "o", "nvfp4", input_amax=EXPERT_AMAX, progress=False)
    out, src = ShardedReader(tmp_path / "o"), ShardedReader(gptoss_dir)
    hf_quant = json.loads((tmp_path / "o" / "hf_quant_config.json").read_text())["quantization"]
    assert hf_quant["quant_algo"] == "NVFP4" and hf_quant["group_size"] == 16 and hf_quant["exclude_modules"]
    assert "quantized_layers" not in hf_quant and hf_quant["kv_cache_quant_algo"] is None
    for layer in range(LAYERS):
        for param, (n_in, n_out) in (("gate_up_proj", (HIDDEN, 128)), ("down_proj", (64, HIDDEN))):
            base = f"model.layers.{layer}.mlp.experts.{param}"
            q, ws = out.read(base), out.read(base + "_weight_scale")
            ws2, inp = out.read(base + "_weight_scale_2"), out.read(base + "_input_scale")
            assert q.dtype == torch.uint8 and q.shape == (EXPERTS, n_in // 2, n_out)
            assert ws.dtype == torch.float8_e4m3fn and ws.shape == (EXPERTS, n_in // 16, n_out)
            assert ws2.dtype == torch.float32 and ws2.shape == () and inp.dtype == torch.float32 and inp.shape == ()
            assert inp.item() == pytest.approx(EXPERT_AMAX[base] / (6 * 448))
            blocks, scales = src.read(base + "_blocks"), src.read(base + "_scales")
            # global = 2**(layer-wide largest block exponent - 8)
            assert ws2.item() == 2.0 ** (int(scales.max()) - 127 - 8)
            # codes: the source bytes, transposed (each byte = two neighbouring input elements)
            assert torch.equal(q, blocks.flatten(-2).transpose(-1, -2))
            ref = mxfp4_decode(blocks, scales).transpose(-1, -2)  # [E, in, out], transformers orientation
            dq = e2m1_decode(unpack_input_dim(q)) * ws.float().repeat_interleave(16, dim=1) * ws2
            assert torch.equal(dq, ref), base
            assert torch.equal(load_dequantized_state_dict(tmp_path / "o")[base], ref)
        assert out.infos[f"model.layers.{layer}.self_attn.q_proj.weight"].dtype == torch.bfloat16


def test_fp8_gptoss_keeps_experts_bf16(gptoss_dir, tmp_path):
    result = convert_checkpoint(gptoss_dir, tmp_path / "o", "fp8", progress=False)
    out, ref = ShardedReader(tmp_path / "o"), load_dequantized_state_dict(gptoss_dir)
    for layer in range(LAYERS):
        for param in EXPERT_PARAMS:
            name = f"model.layers.{layer}.mlp.{param}"
            assert name not in result.formats and out.infos[name].dtype == torch.bfloat16
            assert torch.equal(out.read(name).float(), ref[name])
            assert not any(n.startswith(name + "_") and "scale" in n for n in out.infos)
        q = f"model.layers.{layer}.self_attn.q_proj.weight"
        assert out.infos[q].dtype == torch.float8_e4m3fn and out.infos[q.replace("weight", "weight_scale")].shape == ()
    hf_quant = json.loads((tmp_path / "o" / "hf_quant_config.json").read_text())["quantization"]
    assert hf_quant["quant_algo"] == "FP8" and "*mlp.experts*" in hf_quant["exclude_modules"]


def test_nvfp4_from_bf16_experts_uses_one_global_scale(gptoss_dir, tmp_path):
    """bf16 experts (computed path): scalar global = max |w| over all experts / (6 * 448), same layout."""
    convert_checkpoint(gptoss_dir, tmp_path / "bf16", "none", progress=False)
    convert_checkpoint(tmp_path / "bf16", tmp_path / "o", "nvfp4", input_amax=EXPERT_AMAX, progress=False)
    out, ref = ShardedReader(tmp_path / "o"), load_dequantized_state_dict(tmp_path / "bf16")
    dq = load_dequantized_state_dict(tmp_path / "o")
    for layer in range(LAYERS):
        for param in EXPERT_PARAMS:
            name = f"model.layers.{layer}.mlp.{param}"
            ws2 = out.read(name + "_weight_scale_2")
            assert ws2.shape == () and ws2.item() == pytest.approx(float(ref[name].abs().max()) / (6 * 448), rel=1e-6)
            assert out.infos[name].shape == (EXPERTS, ref[name].shape[1] // 2, ref[name].shape[2])
            assert rel_err(dq[name], ref[name]) <= 0.15, name


# ----------------------------------------------------------------------------------------------
# drafter


def test_nvfp4_on_drafter(drafter_dir, tmp_path):
    result = convert_checkpoint(drafter_dir, tmp_path / "d", "nvfp4", progress=False)
    reader = ShardedReader(tmp_path / "d")
    infos = reader.infos
    assert infos["fc.weight"].dtype == torch.float8_e4m3fn and "fc.weight_scale" in infos
    assert infos["layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert infos["layers.0.mlp.gate_proj.weight"].dtype == torch.uint8
    assert infos["layers.0.mlp.gate_proj.weight_scale"].shape == (96, 4)
    assert infos["layers.0.mlp.down_proj.weight_scale_2"].shape == ()
    for kept in ("hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight", "layers.0.self_attn.q_proj.bias"):
        assert infos[kept].dtype == torch.bfloat16
    layers = json.loads((tmp_path / "d" / "hf_quant_config.json").read_text())["quantization"]["quantized_layers"]
    assert layers["fc"] == {"quant_algo": "FP8"} and layers["layers.0.mlp.up_proj"]["quant_algo"] == "NVFP4"
    assert json.loads((tmp_path / "d" / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [0, 1, 2]
    ref, dq = load_dequantized_state_dict(drafter_dir), load_dequantized_state_dict(tmp_path / "d")
    for name in ref:
        limit = {"fp8": 0.05, "nvfp4": 0.15}.get(getattr(result.formats.get(name), "value", ""), 0.0)
        assert rel_err(dq[name], ref[name]) <= limit, name


def test_mxfp4_recipe_leaves_drafter_unquantized(drafter_dir, tmp_path):
    result = convert_checkpoint(drafter_dir, tmp_path / "d", "mxfp4", progress=False)
    assert result.formats == {}
    assert "quantization_config" not in json.loads((tmp_path / "d" / "config.json").read_text())


# ----------------------------------------------------------------------------------------------
# streaming and atomicity


def test_streaming_writes_pieces_into_many_shards(gptoss_dir, tmp_path, monkeypatch):
    """One writer open at a time, experts arrive one at a time, shards close at the size limit."""
    monkeypatch.setattr(jobs_mod, "CHUNK_ELEMENTS", 1)  # force one expert per piece
    open_writers, max_open, pieces = [0], [0], []
    real_init, real_close = safetensors_io.StreamingShardWriter.__init__, safetensors_io.StreamingShardWriter.close
    real_write = safetensors_io.StreamingShardWriter.write

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        open_writers[0] += 1
        max_open[0] = max(max_open[0], open_writers[0])

    def close(self):
        open_writers[0] -= 1
        real_close(self)

    def write(self, name, piece, **kwargs):
        pieces.append((name, piece.nbytes if isinstance(piece, FileRange) else piece.numel() * piece.element_size()))
        return real_write(self, name, piece, **kwargs)

    monkeypatch.setattr(safetensors_io.StreamingShardWriter, "__init__", init)
    monkeypatch.setattr(safetensors_io.StreamingShardWriter, "close", close)
    monkeypatch.setattr(safetensors_io.StreamingShardWriter, "write", write)
    result = convert_checkpoint(gptoss_dir, tmp_path / "o", "nvfp4", input_amax=EXPERT_AMAX, max_shard_bytes=20_000,
                                progress=False)
    assert max_open[0] == 1 and open_writers[0] == 0
    assert result.shards == len(set(check_index(tmp_path / "o").values())) >= 4
    expert_pieces = [b for n, b in pieces if n == "model.layers.0.mlp.experts.gate_up_proj"]
    assert len(expert_pieces) == EXPERTS  # never the whole tensor at once
    largest_tensor = max(i.nbytes for i in ShardedReader(tmp_path / "o").infos.values())
    assert max(b for _, b in pieces) <= largest_tensor


def test_failure_leaves_no_partial_output(gptoss_dir, tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(jobs_mod, "mxfp4_to_nvfp4", boom)
    monkeypatch.setattr(jobs_mod, "mxfp4_to_nvfp4_scales", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        convert_checkpoint(gptoss_dir, tmp_path / "o", "nvfp4", input_amax=EXPERT_AMAX, progress=False)
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------------------------
# exact MXFP4 -> NVFP4 fast path and file-to-file copies: the output does not depend on them


def output_bytes(directory: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def wide_span_dir(gptoss_dir, tmp_path_factory) -> Path:
    """gptoss_dir with expert 2 of layer 1's gate_up_proj spanning 30 binades: its blocks far below
    the layer's largest are beyond E4M3's range under the global scale, so that expert (only) needs
    the computed NVFP4 path."""
    reader = ShardedReader(gptoss_dir)
    state = {n: reader.read(n) for n in reader.infos}
    scales = state["model.layers.1.mlp.experts.gate_up_proj_scales"]
    scales[2, 0] = int(scales.max()) + 1  # expert 2 holds the layer-wide largest block
    scales[2, 1::2] = int(scales.max()) - 30
    directory = tmp_path_factory.mktemp("wide")
    save_sharded(directory, state, max_shard_bytes=120_000)
    for f in ("config.json", "generation_config.json", "tokenizer_config.json"):
        (directory / f).write_bytes((gptoss_dir / f).read_bytes())
    return directory


def test_exact_fp4_fast_path_gives_the_computed_bytes(wide_span_dir, tmp_path, monkeypatch):
    """MXFP4 -> NVFP4 experts: FP4 code bytes reused (transposed, no decode) where every block scale
    fits E4M3 under the layer-wide global scale (the computed path where one does not) give
    byte-identical shards to the computed path alone, and decode bit-exactly where exact."""
    monkeypatch.setattr(jobs_mod, "CHUNK_ELEMENTS", 1)  # one expert per chunk: exact and computed experts mix
    computed, exact = [], []
    real_compute, real_scales = jobs_mod.mxfp4_to_nvfp4, jobs_mod.mxfp4_to_nvfp4_scales

    def compute(blocks, scales, **kwargs):
        computed.append(kwargs["name"])
        return real_compute(blocks, scales, **kwargs)

    def rescale(blocks, scales, **kwargs):
        result = real_scales(blocks, scales, **kwargs)
        exact.append(result.exact)
        return result

    monkeypatch.setattr(jobs_mod, "mxfp4_to_nvfp4", compute)
    monkeypatch.setattr(jobs_mod, "mxfp4_to_nvfp4_scales", rescale)
    convert_checkpoint(wide_span_dir, tmp_path / "fast", "nvfp4", input_amax=EXPERT_AMAX, max_shard_bytes=50_000,
                       progress=False)
    assert computed == ["model.layers.1.mlp.experts.gate_up_proj"]  # only the wide-span expert
    assert sum(exact) == LAYERS * len(EXPERT_PARAMS) * EXPERTS - 1

    computed.clear()
    monkeypatch.setattr(jobs_mod, "COPY_EXACT_FP4", False)
    convert_checkpoint(wide_span_dir, tmp_path / "slow", "nvfp4", input_amax=EXPERT_AMAX, max_shard_bytes=50_000,
                       progress=False)
    assert len(computed) == LAYERS * len(EXPERT_PARAMS) * EXPERTS
    assert output_bytes(tmp_path / "fast") == output_bytes(tmp_path / "slow")
    ref, dq = load_dequantized_state_dict(wide_span_dir), load_dequantized_state_dict(tmp_path / "fast")
    for layer in range(LAYERS):
        for param in EXPERT_PARAMS:
            name = f"model.layers.{layer}.mlp.{param}"
            wide = (layer, param) == (1, "experts.gate_up_proj")
            assert torch.equal(dq[name][:2], ref[name][:2]) and (wide or torch.equal(dq[name], ref[name])), name
            if wide:  # the far-below blocks took the computed path: not exact, yet within NVFP4's bound
                assert not torch.equal(dq[name][2], ref[name][2]) and torch.equal(dq[name][3], ref[name][3])
                assert rel_err(dq[name][2], ref[name][2]) <= 0.15


def kernel_copy_failing_after(limit: int):
    """An ``os.copy_file_range`` that copies ``limit`` bytes (in small calls), then fails like an old kernel."""
    real, budget = os.copy_file_range, [limit]

    def copy_file_range(src, dst, count, offset_src=None, offset_dst=None):
        if budget[0] <= 0:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        copied = real(src, dst, min(count, 97, budget[0]), offset_src, offset_dst)
        budget[0] -= copied
        return copied

    return copy_file_range


@pytest.mark.parametrize("failure", ["oserror", "partial-then-oserror", "copies-nothing", "unavailable"])
@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
def test_copy_fallback_gives_identical_output(gptoss_dir, tmp_path, monkeypatch, recipe, failure):
    """Without a working os.copy_file_range the buffered copy takes over (from where the kernel
    copy stopped) and writes the same bytes."""
    convert_checkpoint(gptoss_dir, tmp_path / "kernel", recipe, input_amax=amax_for(recipe), max_shard_bytes=50_000,
                       progress=False)
    monkeypatch.setattr(safetensors_io, "COPY_BUFFER_BYTES", 1000)  # many buffered chunks per tensor
    if failure == "unavailable":
        monkeypatch.delattr(os, "copy_file_range")
    else:
        broken = {
            "oserror": kernel_copy_failing_after(0),
            "partial-then-oserror": kernel_copy_failing_after(5000),
            "copies-nothing": lambda *args: 0,
        }[failure]
        monkeypatch.setattr(os, "copy_file_range", broken)
    convert_checkpoint(gptoss_dir, tmp_path / "buffered", recipe, input_amax=amax_for(recipe), max_shard_bytes=50_000,
                       progress=False)
    assert output_bytes(tmp_path / "kernel") == output_bytes(tmp_path / "buffered")


@pytest.mark.parametrize("kernel_copy", [True, False])
def test_copy_past_end_of_source_is_an_error(tmp_path, monkeypatch, kernel_copy):
    """A source that ends early (changed after its header was checked) fails the write, not silently."""
    if not kernel_copy:
        monkeypatch.delattr(os, "copy_file_range")
    source = tmp_path / "src.bin"
    source.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(InputError, match="src.bin: file is truncated"):
        with StreamingShardWriter(tmp_path / "out.safetensors", [TensorInfo("t", torch.uint8, (2048,))]) as writer:
            writer.write("t", FileRange(source, 0, 1024))
            writer.write("t", FileRange(source, 512, 1024))  # 512 bytes short
    (tmp_path / "ok").mkdir()
    with StreamingShardWriter(tmp_path / "ok" / "model.safetensors", [TensorInfo("t", torch.uint8, (1024,))]) as writer:
        writer.write("t", FileRange(source, 0, 1024))
    assert torch.equal(ShardedReader(tmp_path / "ok").read("t"), torch.arange(256, dtype=torch.uint8).repeat(4))


def test_overwrite_replaces_only_when_asked(gptoss_dir, tmp_path):
    convert_checkpoint(gptoss_dir, tmp_path / "o", "mxfp4", progress=False)
    with pytest.raises(InputError, match="already exists"):
        convert_checkpoint(gptoss_dir, tmp_path / "o", "fp8", progress=False)
    convert_checkpoint(gptoss_dir, tmp_path / "o", "fp8", overwrite=True, progress=False)
    assert (tmp_path / "o" / "hf_quant_config.json").exists() and sorted(os.listdir(tmp_path)) == ["o"]


# ----------------------------------------------------------------------------------------------
# bad input


def copy_source(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_missing_config_is_an_input_error(gptoss_dir, tmp_path):
    src = copy_source(gptoss_dir, tmp_path / "src")
    (src / "config.json").unlink()
    with pytest.raises(InputError, match="config.json: file not found"):
        convert_checkpoint(src, tmp_path / "o", progress=False)


def test_ordered_map_keeps_order_bounds_lookahead_and_raises():
    started, consumed = [], []

    def work(i):
        started.append(i)
        time.sleep(0.002 * (i % 3))  # later items often finish first
        if i == 7:
            raise ValueError("item 7")
        return i * i

    results = jobs_mod.ordered_map(work, ((i,) for i in range(7)), threads=2)
    for value in results:
        consumed.append(value)
        assert max(started) < len(consumed) + 4  # never more than 2 * threads ahead of the consumer
        time.sleep(0.01)  # a slow consumer: unbounded workers would race ahead
    assert consumed == [i * i for i in range(7)]
    with pytest.raises(ValueError, match="item 7"):
        list(jobs_mod.ordered_map(work, ((i,) for i in range(9)), threads=2))


@pytest.mark.parametrize("shape", [(3, 5760 // 64, 1440 // 64), (2, 1, 7), (1, 9, 1), (4, 33, 17), (0, 4, 6)])
def test_byte_transpose_matches_torch(shape):
    """The OpenCV path for uint8 (odd and degenerate shapes, a non-contiguous input) and the torch
    path for other dtypes both equal torch's own transpose."""
    g = torch.Generator().manual_seed(0)
    wide = torch.randint(0, 256, shape[:-1] + (2 * shape[-1],), dtype=torch.uint8, generator=g)
    for t in (wide[..., ::2], wide[..., : shape[-1]].float()):
        out = jobs_mod._transposed(t)
        assert out.is_contiguous() and out.dtype == t.dtype
        assert torch.equal(out, t.transpose(-1, -2))


def test_mapped_tensors_equal_read_ones_and_never_write_the_file(gptoss_dir):
    reader = ShardedReader(gptoss_dir)
    before = {f: f.read_bytes() for f in set(reader.files.values())}
    for name in reader.infos:
        view = reader.mapped(name)
        assert view.dtype == reader.infos[name].dtype and torch.equal(view, reader.read(name)), name
        rows = reader.infos[name].shape[0] if reader.infos[name].shape else 0
        for start, stop in ((1, None), (None, 2), (1, rows - 1), (rows, None)):
            if rows:
                assert torch.equal(reader.mapped(name, start, stop), reader.read(name, start, stop)), (name, start, stop)
        if view.numel():
            view.view(-1)[0] = 1 - view.view(-1)[0]  # copy-on-write: a private page, not the file
    assert {f: f.read_bytes() for f in before} == before


def test_truncated_shard_names_file_and_tensor(gptoss_dir, tmp_path):
    src = copy_source(gptoss_dir, tmp_path / "src")
    shard = sorted(src.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(InputError, match=rf"{shard.name}: field '.+': file is truncated"):
        convert_checkpoint(src, tmp_path / "o", progress=False)
    assert not (tmp_path / "o").exists()


def test_missing_shard_and_bad_header(gptoss_dir, tmp_path):
    src = copy_source(gptoss_dir, tmp_path / "src")
    shard = sorted(src.glob("model-*.safetensors"))[-1]
    shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(InputError, match="header is not valid JSON"):
        convert_checkpoint(src, tmp_path / "o", progress=False)
    shard.unlink()
    with pytest.raises(InputError, match="shard listed in model.safetensors.index.json is missing"):
        convert_checkpoint(src, tmp_path / "o", progress=False)


def test_non_finite_weight_names_file_and_tensor(drafter_dir, tmp_path):
    src = copy_source(drafter_dir, tmp_path / "src")
    state = {n: ShardedReader(src).read(n) for n in ShardedReader(src).infos}
    state["layers.0.self_attn.k_proj.weight"][3, 4] = float("nan")
    for f in src.glob("*.safetensors*"):
        f.unlink()
    save_sharded(src, state)
    with pytest.raises(InputError, match=r"model.safetensors: field 'layers.0.self_attn.k_proj.weight'.*non-finite"):
        convert_checkpoint(src, tmp_path / "o", "fp8", progress=False)


def test_already_quantized_source_is_refused(gptoss_dir, tmp_path):
    convert_checkpoint(gptoss_dir, tmp_path / "q", "fp8", progress=False)
    with pytest.raises(InputError, match="already ModelOpt-quantized"):
        convert_checkpoint(tmp_path / "q", tmp_path / "o", "nvfp4", progress=False)


def test_exact_mxfp4_source_decode_matches_codec(gptoss_dir):
    reader = ShardedReader(gptoss_dir)
    name = "model.layers.0.mlp.experts.down_proj"
    want = mxfp4_decode(reader.read(name + "_blocks"), reader.read(name + "_scales")).transpose(-1, -2)
    assert torch.equal(load_dequantized_state_dict(gptoss_dir)[name], want)
