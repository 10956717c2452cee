"""TensorRT plugin ``dflash::DraftBlockAttention`` (Quickly Deployable Plugin API) and the drafter build.

``register_trt_plugin()`` registers, with ``tensorrt.plugin``:

* ``@trtp.register``: output = ``q``'s shape and dtype; attributes ``block_size``, ``scale``,
  ``sliding_window`` (0 = full context) — the ONNX node's attributes (``onnx_export.py``).
* ``@trtp.autotune``: fp16 / bf16 / fp32 activations (all five tensors and the output alike),
  int32 lengths, linear layout, one tactic.
* ``@trtp.aot_impl``: the fused Triton kernel (``triton_kernels.draft_block_attn_fused_kernel``)
  compiled to PTX at engine-build time, so the engine runs without Python. The fused kernel is
  used because a QDP AOT implementation is one kernel launch without a workspace; the split-K path
  (two launches plus partials) stays on the torch/CUDA path. Grid (b, Hkv) comes from the input
  shapes, and the integer arguments (S_cap and element strides of the contiguous TensorRT tensors)
  are symbolic expressions TensorRT evaluates per launch.

TensorRT is imported lazily; without it every entry point raises ``MissingDependencyError``, except
``build_trt_drafter``, which still writes the ONNX file and reports why no engine was built.
"""

from __future__ import annotations

import functools
import shutil
from dataclasses import dataclass
from pathlib import Path

from trtllm_dflash.errors import MissingDependencyError

PLUGIN_ID = "dflash::DraftBlockAttention"
TRITON_POINTER_TYPES = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}
FUSED_SCALAR_ARGS = ("s_cap", "stride_qt", "stride_qh", "stride_bt", "stride_bh",
                     "stride_cb", "stride_ch", "stride_cs", "stride_ot", "stride_oh")


def import_tensorrt():
    """(tensorrt, tensorrt.plugin) or a MissingDependencyError saying what to install."""
    try:
        import tensorrt as trt
        import tensorrt.plugin as trtp
    except ImportError as err:
        raise MissingDependencyError(
            "TensorRT with the Python plugin API (tensorrt.plugin, TensorRT >= 10.7)",
            "the DraftBlockAttention TensorRT plugin",
            hint=f"Install TensorRT from NVIDIA's package index on a CUDA host ({err}).",
        ) from err
    return trt, trtp


def fused_scalar_args(q_shape, ctx_shape) -> list:
    """Values of FUSED_SCALAR_ARGS for contiguous q/out ``[b*B, Hq, D]`` and arenas ``[b, Hkv, S_cap, D]``.

    Works on ints and on TensorRT symbolic expressions alike (only ``*`` is used).
    """
    _, q_heads, head_dim = q_shape
    _, kv_heads, s_cap, _ = ctx_shape
    q_strides = [q_heads * head_dim, head_dim]
    ctx_strides = [kv_heads * s_cap * head_dim, s_cap * head_dim, head_dim]
    return [s_cap, *q_strides, kv_heads * head_dim, head_dim, *ctx_strides, *q_strides]


def fused_kernel_signature(dtype_name: str, constexprs: dict) -> dict[str, str]:
    """Triton ``ASTSource`` signature of the fused kernel: pointers, i32 scalars, then constexprs."""
    ptr = TRITON_POINTER_TYPES[dtype_name]
    signature = {name: ptr for name in ("q_ptr", "k_blk_ptr", "v_blk_ptr", "ctx_k_ptr", "ctx_v_ptr")}
    signature["ctx_lens_ptr"] = "*i32"
    signature.update({name: "i32" for name in FUSED_SCALAR_ARGS})
    signature["out_ptr"] = ptr
    signature.update({name: "constexpr" for name in constexprs})
    return signature


def compile_fused_kernel(meta, dtype_name: str, target=None):
    """Compile the fused kernel for ``target`` (default: the current GPU) -> triton CompiledKernel.

    Compilation needs no GPU when ``target`` is given (e.g. ``GPUTarget("cuda", 90, 32)``).
    """
    import triton

    from .triton_kernels import DEFAULT_LAUNCH, draft_block_attn_fused_kernel

    constexprs = meta.constexprs()
    source = triton.compiler.ASTSource(
        fn=draft_block_attn_fused_kernel,
        signature=fused_kernel_signature(dtype_name, constexprs),
        constexprs=constexprs,
    )
    options = {"num_warps": DEFAULT_LAUNCH.num_warps, "num_stages": DEFAULT_LAUNCH.num_stages}
    return triton.compile(source, target=target, options=options)


@functools.cache
def register_trt_plugin() -> None:
    """Register ``dflash::DraftBlockAttention`` with TensorRT's plugin registry (once per process)."""
    trt, trtp = import_tensorrt()
    from .triton_kernels import BlockAttnMeta

    dtype_names = {trt.float16: "float16", trt.bfloat16: "bfloat16", trt.float32: "float32"}

    @trtp.register(PLUGIN_ID)
    def describe(q: trtp.TensorDesc, k_blk: trtp.TensorDesc, v_blk: trtp.TensorDesc, ctx_k: trtp.TensorDesc,
                 ctx_v: trtp.TensorDesc, ctx_lens: trtp.TensorDesc, block_size: int, scale: float,
                 sliding_window: int) -> trtp.TensorDesc:
        return q.like()

    @trtp.autotune(PLUGIN_ID)
    def combinations(q: trtp.TensorDesc, k_blk: trtp.TensorDesc, v_blk: trtp.TensorDesc, ctx_k: trtp.TensorDesc,
                     ctx_v: trtp.TensorDesc, ctx_lens: trtp.TensorDesc, outputs: tuple[trtp.TensorDesc]
                     ) -> list[trtp.AutoTuneCombination]:
        act = "FP16|BF16|FP32"
        return [trtp.AutoTuneCombination(", ".join([act] * 5 + ["INT32", act]), "LINEAR")]

    @trtp.aot_impl(PLUGIN_ID)
    def aot(q: trtp.TensorDesc, k_blk: trtp.TensorDesc, v_blk: trtp.TensorDesc, ctx_k: trtp.TensorDesc,
            ctx_v: trtp.TensorDesc, ctx_lens: trtp.TensorDesc, block_size: int, scale: float, sliding_window: int,
            outputs: tuple[trtp.TensorDesc], tactic: int):
        kv_heads, head_dim = int(ctx_k.shape_expr[1].constant_value), int(ctx_k.shape_expr[3].constant_value)
        meta = BlockAttnMeta(
            block=block_size, group=int(q.shape_expr[1].constant_value) // kv_heads, head_dim=head_dim,
            window=sliding_window, scale=scale, dot_precision="ieee" if q.dtype == trt.float32 else "tf32",
        )
        compiled = compile_fused_kernel(meta, dtype_names[q.dtype])
        if compiled.metadata.global_scratch_size:
            raise RuntimeError("the fused kernel needs Triton global scratch, which a TensorRT AOT launch does not pass")
        launch = trtp.KernelLaunchParams()
        launch.grid_x = ctx_k.shape_expr[0]
        launch.grid_y = kv_heads
        launch.block_x = compiled.metadata.num_warps * 32
        launch.shared_mem = compiled.metadata.shared
        scalars = fused_scalar_args(tuple(q.shape_expr), tuple(ctx_k.shape_expr))
        extra = trtp.SymIntExprs(len(scalars))
        for i, value in enumerate(scalars):
            extra[i] = trtp.SymInt32(value)
        return compiled.metadata.name, compiled.asm["ptx"], launch, extra


def profile_shapes(shape: tuple[int, ...], max_batch: int, max_context: int) -> tuple[tuple[int, ...], ...]:
    """(min, opt, max) of one drafter-step input: dim 0 is the batch, dim 2 of an arena is S_cap."""
    low, opt, high = list(shape), list(shape), list(shape)
    dynamic = {0: max_batch, 2: max_context} if len(shape) == 4 else {0: max_batch}
    for dim, limit in dynamic.items():
        if shape[dim] == -1:
            low[dim], opt[dim], high[dim] = 1, max(1, limit // 2), limit
    return tuple(low), tuple(opt), tuple(high)


@dataclass(frozen=True)
class TrtDrafterBuild:
    """What ``build_trt_drafter`` wrote; ``engine`` is None with ``skipped`` saying why."""

    onnx: Path
    engine: Path | None
    skipped: str | None


def build_trt_drafter(
    drafter_onnx_path: str | Path, out_dir: str | Path, *, max_batch: int = 64, max_context: int = 32768
) -> TrtDrafterBuild:
    """Write ``out_dir/drafter_trt/drafter.onnx`` and, where TensorRT and a GPU exist, ``drafter.engine``.

    The engine is strongly typed (precision comes from the ONNX tensors) with one optimisation
    profile covering batch 1..max_batch and S_cap 1..max_context.
    """
    target_dir = Path(out_dir) / "drafter_trt"
    target_dir.mkdir(parents=True, exist_ok=True)
    onnx_path = target_dir / "drafter.onnx"
    if Path(drafter_onnx_path).resolve() != onnx_path.resolve():
        shutil.copyfile(drafter_onnx_path, onnx_path)
    try:
        trt, _ = import_tensorrt()
    except MissingDependencyError as err:
        return TrtDrafterBuild(onnx_path, None, str(err))
    import torch

    if not torch.cuda.is_available():
        return TrtDrafterBuild(onnx_path, None, "no CUDA GPU: TensorRT engines are built on the GPU they run on")
    register_trt_plugin()
    engine_path = target_dir / "drafter.engine"
    engine_path.write_bytes(_build_engine(trt, onnx_path, max_batch, max_context))
    return TrtDrafterBuild(onnx_path, engine_path, None)


def _build_engine(trt, onnx_path: Path, max_batch: int, max_context: int) -> bytes:
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        profile.set_shape(tensor.name, *profile_shapes(tuple(tensor.shape), max_batch, max_context))
    config.add_optimization_profile(profile)
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        raise RuntimeError(f"TensorRT failed to build an engine from {onnx_path}")
    return bytes(engine)
