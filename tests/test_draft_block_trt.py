"""TensorRT plugin and drafter build: pure helpers here; the registration only where tensorrt imports.

The Triton-to-PTX compile of every kernel for sm_90 needs no GPU and runs in a subprocess (this
session's triton may be in interpreter mode).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from trtllm_dflash.errors import MissingDependencyError
from trtllm_dflash.plugins.draft_block.tensorrt_plugin import (
    build_trt_drafter,
    fused_scalar_args,
    import_tensorrt,
    profile_shapes,
    register_trt_plugin,
)

HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None


def test_scalar_args_are_contiguous_strides():
    q = torch.empty(20, 64, 64)
    ctx = torch.empty(2, 8, 300, 64)
    k_blk = torch.empty(20, 8, 64)
    expected = [300, *q.stride()[:2], *k_blk.stride()[:2], *ctx.stride()[:3], *q.stride()[:2]]
    assert fused_scalar_args(tuple(q.shape), tuple(ctx.shape)) == expected


def test_profile_shapes():
    assert profile_shapes((-1, 8, -1, 64), 64, 4096) == ((1, 8, 1, 64), (32, 8, 2048, 64), (64, 8, 4096, 64))
    assert profile_shapes((-1, 10, 2880), 64, 4096) == ((1, 10, 2880), (32, 10, 2880), (64, 10, 2880))
    assert profile_shapes((-1,), 8, 4096) == ((1,), (4,), (8,))


@pytest.mark.skipif(HAS_TENSORRT, reason="tensorrt is installed")
def test_missing_tensorrt_is_a_clear_error(tmp_path):
    with pytest.raises(MissingDependencyError, match="TensorRT"):
        import_tensorrt()
    with pytest.raises(MissingDependencyError):
        register_trt_plugin()
    source = tmp_path / "step.onnx"
    source.write_bytes(b"onnx bytes")
    build = build_trt_drafter(source, tmp_path / "out")
    assert build.onnx == tmp_path / "out" / "drafter_trt" / "drafter.onnx"
    assert build.onnx.read_bytes() == b"onnx bytes"
    assert build.engine is None and "TensorRT" in build.skipped


@pytest.mark.skipif(not HAS_TENSORRT, reason="tensorrt (with tensorrt.plugin) is not installed here")
def test_plugin_registers_with_tensorrt():
    trt, trtp = import_tensorrt()
    register_trt_plugin()
    assert hasattr(trtp.op.dflash, "DraftBlockAttention")


COMPILE_ALL_KERNELS = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from trtllm_dflash.plugins.draft_block import triton_kernels as k
    from trtllm_dflash.plugins.draft_block.tensorrt_plugin import compile_fused_kernel

    target = GPUTarget("cuda", 90, 32)
    meta = k.BlockAttnMeta(block=10, group=8, head_dim=64, window=0, scale=0.125, dot_precision="tf32")
    fused = compile_fused_kernel(meta, "bfloat16", target=target)
    assert fused.metadata.global_scratch_size == 0, "TensorRT AOT launches pass no scratch"

    def compile(fn, constexprs, pointer_types):
        sig = {name: ("constexpr" if name in constexprs else pointer_types.get(name, "i32")) for name in fn.arg_names}
        return triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=target)

    ptrs = {n: "*bf16" for n in ("q_ptr", "k_blk_ptr", "v_blk_ptr", "ctx_k_ptr", "ctx_v_ptr", "out_ptr")}
    ptrs.update(ctx_lens_ptr="*i32", part_acc_ptr="*fp32", part_ml_ptr="*fp32")
    windowed = k.BlockAttnMeta(block=10, group=8, head_dim=64, window=128, scale=0.125, dot_precision="tf32")
    compile(k.draft_block_attn_split_kernel, windowed.constexprs(), ptrs)
    combine = {n: windowed.constexprs()[n] for n in ("BLOCK", "GROUP", "D", "WINDOW", "BLOCK_M")}
    compile(k.draft_block_attn_combine_kernel, combine, ptrs)
    compile(k.greedy_accept_kernel, {"BLOCK_K": 16}, {n: "*i64" for n in k.greedy_accept_kernel.arg_names[:3]}
            | {"num_accepted_ptr": "*i64", "bonus_ptr": "*i64", "new_lengths_ptr": "*i32"})
    print("compiled", fused.metadata.name, fused.metadata.shared)
""")


def test_kernels_compile_for_hopper_without_gpu():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run([sys.executable, "-c", COMPILE_ALL_KERNELS], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "compiled draft_block_attn_fused_kernel" in result.stdout
