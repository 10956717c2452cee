"""Draft-block plugin: the drafter's block attention and the fused accept op.

Importing this package registers the torch custom ops ``dflash::draft_block_attention`` and
``dflash::dflash_accept`` (CPU reference, CUDA Triton, fake kernels). Triton, ONNX and TensorRT are
imported only by the modules that need them (``triton_kernels``, ``onnx_export``,
``tensorrt_plugin``).
"""

from .ops import draft_block_attention, greedy_accept_update, rejection_accept_update

__all__ = ["draft_block_attention", "greedy_accept_update", "rejection_accept_update"]
