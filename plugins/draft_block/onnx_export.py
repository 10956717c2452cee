"""ONNX export of one drafter step with block attention as a TensorRT plugin node.

The exported step takes the block embeddings ``[b, B, hidden]``, ``ctx_lens [b]`` (int32) and, per
drafter layer ``l``, the context arenas ``ctx_k_l, ctx_v_l: [b, Hkv, S_cap, D]``, and returns the
logits of slots 1..B-1. Batch and ``S_cap`` are dynamic axes.

Every ``dflash::draft_block_attention`` call becomes one node

    domain "dflash", op_type "DraftBlockAttention",
    attributes plugin_namespace="dflash", block_size, scale, sliding_window (0 = none), aot=1

which is what TensorRT's ONNX parser needs to bind it to the ``dflash::DraftBlockAttention``
Quickly Deployable Plugin (``tensorrt_plugin.py``): op type = plugin name, ``plugin_namespace`` =
namespace, ``aot`` selects the ahead-of-time (Python-free) implementation. A custom domain keeps the
graph valid for ``onnx.checker``; the parser keys on op type and namespace.

``block_size`` is an attribute because the kernel compiles it in, while the batch axis is dynamic,
so it cannot be recovered from shapes at engine-build time.

On CPU the node runs in onnxruntime as a Python op of onnxruntime-extensions (which accepts only
the ``ai.onnx.contrib`` domain): ``run_on_cpu`` retargets the domain and computes the node with the
plain torch reference, so the check covers the exact exported graph.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import torch

from . import ops  # noqa: F401 -- registers the torch.ops.dflash ops the exporter translates
from .reference import draft_block_attention_reference

DOMAIN = "dflash"
OP_TYPE = "DraftBlockAttention"
PLUGIN_NAMESPACE = "dflash"
CPU_DOMAIN = "ai.onnx.contrib"
OPSET = 20


def step_input_names(num_layers: int) -> list[str]:
    """Input order of an exported drafter step: embeddings, lengths, then (k, v) per layer."""
    return ["block_embeds", "ctx_lens"] + [f"ctx_{kv}_{layer}" for layer in range(num_layers) for kv in "kv"]


def step_dynamic_shapes(num_layers: int) -> tuple:
    """torch.export dynamic shapes of ``forward(block_embeds, ctx_lens, *ctx_kv)``: batch and S_cap dynamic."""
    batch, s_cap = torch.export.Dim("batch"), torch.export.Dim("s_cap")
    return ({0: batch}, {0: batch}, ({0: batch, 2: s_cap},) * (2 * num_layers))


def register_onnx_schema() -> None:
    """Declare ``dflash::DraftBlockAttention`` to onnx so onnxscript can emit it and the checker accepts it."""
    if onnx.defs.has(OP_TYPE, DOMAIN):
        return
    param = onnx.defs.OpSchema.FormalParameter
    attr = onnx.defs.OpSchema.Attribute
    kinds = onnx.defs.OpSchema.AttrType
    schema = onnx.defs.OpSchema(
        OP_TYPE, DOMAIN, 1,
        doc="DFlash drafter block attention (see trtllm_dflash.plugins.draft_block.reference).",
        inputs=[param(n, "T") for n in ("q", "k_blk", "v_blk", "ctx_k", "ctx_v")] + [param("ctx_lens", "I")],
        outputs=[param("out", "T")],
        type_constraints=[
            ("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "activations"),
            ("I", ["tensor(int32)", "tensor(int64)"], "context lengths"),
        ],
        attributes=[
            attr("plugin_namespace", kinds.STRING, "TensorRT plugin namespace"),
            attr("block_size", kinds.INT, "block size B"),
            attr("scale", kinds.FLOAT, "softmax scale"),
            attr("sliding_window", kinds.INT, "context window W, 0 = full context"),
            attr("aot", kinds.INT, "1: TensorRT uses the ahead-of-time implementation"),
        ],
    )
    onnx.defs.register_schema(schema)


def block_attention_translation(block_size: int):
    """onnxscript translation of ``dflash::draft_block_attention`` into the plugin node."""
    from onnxscript.values import Opset

    register_onnx_schema()
    dflash = Opset(DOMAIN, 1)

    def translate(q, k_blk, v_blk, ctx_k, ctx_v, ctx_lens, scale: float, sliding_window: int | None = None):
        return dflash.DraftBlockAttention(
            q, k_blk, v_blk, ctx_k, ctx_v, ctx_lens,
            plugin_namespace=PLUGIN_NAMESPACE, block_size=block_size, scale=float(scale),
            sliding_window=sliding_window or 0, aot=1,
        )

    return translate


def export_drafter_step(
    step: torch.nn.Module,
    example_args: Sequence[torch.Tensor],
    path: str | Path,
    *,
    num_layers: int,
    output_names: Sequence[str] = ("logits",),
) -> onnx.ModelProto:
    """Export ``step(block_embeds, ctx_lens, ctx_k_0, ctx_v_0, ...)`` to ``path`` and check it.

    Any module whose attention calls ``dflash::draft_block_attention`` works; ``block_embeds`` is
    ``[b, B, hidden]`` and fixes B. Returns the checked model (external data is not used: drafter
    weights stay under the 2 GiB protobuf limit).
    """
    block_size = example_args[0].shape[1]
    table = {torch.ops.dflash.draft_block_attention.default: block_attention_translation(block_size)}
    program = torch.onnx.export(
        step, tuple(example_args), dynamo=True, opset_version=OPSET, custom_translation_table=table,
        input_names=step_input_names(num_layers), output_names=list(output_names),
        dynamic_shapes=step_dynamic_shapes(num_layers), verbose=False,
    )
    model = program.model_proto
    onnx.checker.check_model(model)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return model


def plugin_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The DraftBlockAttention nodes of a graph (one per drafter layer)."""
    return [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE]


def with_domain(model: onnx.ModelProto, domain: str) -> onnx.ModelProto:
    """Copy of ``model`` with the plugin nodes (and opset import) moved to ``domain``."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for node in plugin_nodes(out):
        node.domain = domain
    kept = [o for o in out.opset_import if o.domain != DOMAIN]
    del out.opset_import[:]
    out.opset_import.extend(kept + [onnx.helper.make_opsetid(domain, 1)])
    return out


@functools.cache
def _register_cpu_python_op() -> None:
    """Register (once per process) the reference block attention as an onnxruntime-extensions Python op."""
    from onnxruntime_extensions import PyCustomOpDef, onnx_op

    @onnx_op(
        op_type=OP_TYPE, domain=CPU_DOMAIN,
        inputs=[PyCustomOpDef.dt_float] * 5 + [PyCustomOpDef.dt_int32],
        outputs=[PyCustomOpDef.dt_float],
        attrs={"plugin_namespace": PyCustomOpDef.dt_string, "block_size": PyCustomOpDef.dt_int64,
               "scale": PyCustomOpDef.dt_float, "sliding_window": PyCustomOpDef.dt_int64,
               "aot": PyCustomOpDef.dt_int64},
    )
    def draft_block_attention_cpu(q, k_blk, v_blk, ctx_k, ctx_v, ctx_lens, **attrs):
        tensors = [torch.from_numpy(np.ascontiguousarray(x)) for x in (q, k_blk, v_blk, ctx_k, ctx_v, ctx_lens)]
        window = int(attrs["sliding_window"]) or None
        return draft_block_attention_reference(*tensors, float(attrs["scale"]), window).numpy()


def run_on_cpu(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run an exported float32 step in onnxruntime CPU, the plugin nodes computed by the torch reference."""
    import onnxruntime as ort
    from onnxruntime_extensions import get_library_path

    _register_cpu_python_op()
    options = ort.SessionOptions()
    options.register_custom_ops_library(get_library_path())
    cpu_model = with_domain(model, CPU_DOMAIN)
    session = ort.InferenceSession(cpu_model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)
