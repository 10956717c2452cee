"""Conversion throughput and peak RSS vs layer count on gpt-oss-120b-shaped synthetic checkpoints.

Each layer has the real 120b tensors (hidden 2880, 128 experts, MXFP4 experts
``gate_up_proj_blocks [128, 5760, 90, 16]``, 64/8 heads of 64, biases, sinks, router); the vocab is
cut to 8192 so embed/lm_head stay small (the real 201088 would add 2 x 1.16 GB of plain copying).
Each measurement runs in a fresh subprocess that reports its own peak RSS (VmHWM, Linux); the reference is a
plain file copy of the same shards. Both end durable, as every output the toolkit publishes does: the
conversion fsyncs its output before renaming it into place, and the copy fsyncs its files the same way
(``sync_tree``). Without that, a copy smaller than the kernel's dirty-page limit (``vm.dirty_ratio``) only
measures memcpy into the page cache, never the disk. Copy and conversions alternate (copy, recipe 1, recipe 2, ..., repeated
``--repeats`` times, each preceded by an untimed ``sync``) so that load from other jobs on a shared machine
hits both; each row gives medians, and "x copy" is the median over repeats of copy seconds / recipe seconds
from the same round (the fraction of copy throughput reached). Conversion seconds exclude the child's
one-off ``import`` of torch and the converter (a fixed ~1 s, whatever the size); "x copy incl. import"
counts it. NVFP4 gpt-oss experts need calibrated input amax: a constant stands in for it (calibration
itself is not part of the conversion time; listing the names reads only headers). Usage::

    python benchmarks/bench_quant_scale.py --layers 2 4 8 --recipes nvfp4 mxfp4 fp8:2 --repeats 3 --workdir /tmp
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from trtllm_dflash.checkpoints.safetensors_io import StreamingShardWriter, TensorInfo, shard_names, write_index

HIDDEN, EXPERTS, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2880, 128, 2880, 64, 8, 64, 8192


def layer_tensors(i: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """One gpt-oss-120b decoder layer with random weights and realistic E8M0 scales (2**-12..2**0)."""
    p, bf16 = f"model.layers.{i}.", torch.bfloat16
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    t = {
        p + "input_layernorm.weight": torch.ones(HIDDEN, dtype=bf16),
        p + "post_attention_layernorm.weight": torch.ones(HIDDEN, dtype=bf16),
        p + "self_attn.sinks": torch.zeros(HEADS, dtype=bf16),
        p + "mlp.router.weight": torch.randn(EXPERTS, HIDDEN, generator=g).to(bf16),
        p + "mlp.router.bias": torch.zeros(EXPERTS, dtype=bf16),
        p + "mlp.experts.gate_up_proj_bias": torch.zeros(EXPERTS, 2 * INTER, dtype=bf16),
        p + "mlp.experts.down_proj_bias": torch.zeros(EXPERTS, HIDDEN, dtype=bf16),
    }
    for name, out, inp in (("q_proj", q, HIDDEN), ("k_proj", kv, HIDDEN), ("v_proj", kv, HIDDEN), ("o_proj", HIDDEN, q)):
        t[p + f"self_attn.{name}.weight"] = (torch.randn(out, inp, generator=g) * 0.02).to(bf16)
        t[p + f"self_attn.{name}.bias"] = torch.zeros(out, dtype=bf16)
    for name, out, inp in (("gate_up_proj", 2 * INTER, HIDDEN), ("down_proj", HIDDEN, INTER)):
        t[p + f"mlp.experts.{name}_blocks"] = torch.randint(0, 256, (EXPERTS, out, inp // 32, 16), dtype=torch.uint8, generator=g)
        t[p + f"mlp.experts.{name}_scales"] = torch.randint(115, 128, (EXPERTS, out, inp // 32), dtype=torch.uint8, generator=g)
    return t


def make_checkpoint(directory: Path, layers: int) -> int:
    """Write a ``layers``-layer checkpoint, one shard per layer (plus one for embeddings); returns bytes."""
    g = torch.Generator().manual_seed(0)
    names = shard_names(layers + 1)
    weight_map, total = {}, 0
    for k, file in enumerate(names):
        if k == layers:
            tensors = {
                "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g).to(torch.bfloat16),
                "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
                "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=g).to(torch.bfloat16),
            }
        else:
            tensors = layer_tensors(k, g)
        infos = [TensorInfo(n, v.dtype, tuple(v.shape)) for n, v in tensors.items()]
        with StreamingShardWriter(directory / file, infos) as writer:
            for n, v in tensors.items():
                writer.write(n, v)
        weight_map.update({n: file for n in tensors})
        total += sum(i.nbytes for i in infos)
        del tensors
    write_index(directory, weight_map, total)
    config = {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "num_hidden_layers": layers,
        "hidden_size": HIDDEN, "intermediate_size": INTER, "num_local_experts": EXPERTS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": VOCAB,
        "quantization_config": {"quant_method": "mxfp4"},
    }
    (directory / "config.json").write_text(json.dumps(config))
    return total


CHILD = """
import re, shutil, sys, time, json
from pathlib import Path
src, dst, what = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
t = time.perf_counter()
if what == "copy":
    from trtllm_dflash.checkpoints.publish import sync_tree  # a tiny module: no torch import
    imported = time.perf_counter()
    dst.mkdir()
    for f in src.iterdir():
        shutil.copyfile(f, dst / f.name)
    sync_tree(dst)
    written = sum(f.stat().st_size for f in dst.iterdir())
else:
    from trtllm_dflash.quant.convert import convert_checkpoint, needs_input_amax
    imported = time.perf_counter()
    amax = {name: 8.0 for name in needs_input_amax(src, what)}  # stands in for calibration (reads headers only)
    written = convert_checkpoint(src, dst, what, input_amax=amax, progress=False).bytes_written
end = time.perf_counter()
hwm_kib = int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))
print(json.dumps({"seconds": end - imported, "import_seconds": imported - t, "written": written, "peak_rss_mib": hwm_kib / 1024}))
"""


def measure(src: Path, dst: Path, what: str) -> dict:
    os.sync()  # untimed: start every measurement without the previous one's dirty pages still pending
    out = subprocess.run([sys.executable, "-c", CHILD, str(src), str(dst), what], check=True, capture_output=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    shutil.rmtree(dst)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--recipes", nargs="+", default=["nvfp4", "mxfp4", "fp8:2"],
                        help="recipe, or recipe:MAXLAYERS to run it only up to that layer count")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of copy + every recipe, alternating")
    parser.add_argument("--workdir", default=tempfile.gettempdir())
    args = parser.parse_args()
    print("| layers | source GB | what | runs (s) | median s | read GB/s | x copy | x copy incl. import | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for layers in args.layers:
        recipes = []
        for what in args.recipes:
            recipe, _, limit = what.partition(":")
            if not (limit and layers > int(limit)):
                recipes.append(recipe)
        root = Path(tempfile.mkdtemp(prefix="bench_quant_", dir=args.workdir))
        try:
            src = root / "src"
            src.mkdir()
            size = make_checkpoint(src, layers)
            runs: dict[str, list[dict]] = {w: [] for w in ["copy", *recipes]}
            for _ in range(args.repeats):
                for what in runs:
                    runs[what].append(measure(src, root / "out", what))
            for what, rs in runs.items():
                seconds = statistics.median(r["seconds"] for r in rs)
                ratio = statistics.median(c["seconds"] / r["seconds"] for c, r in zip(runs["copy"], rs))
                total = statistics.median(
                    c["seconds"] / (r["seconds"] + r["import_seconds"]) for c, r in zip(runs["copy"], rs)
                )
                times = " / ".join(f"{r['seconds']:.1f}" for r in rs)
                print(f"| {layers} | {size / 1e9:.2f} | {what} | {times} | {seconds:.1f} | {size / 1e9 / seconds:.2f} | "
                      f"{ratio:.2f} | {total:.2f} | {max(r['peak_rss_mib'] for r in rs):.0f} |", flush=True)
        finally:
            shutil.rmtree(root)


if __name__ == "__main__":
    main()
