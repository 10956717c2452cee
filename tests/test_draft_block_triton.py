"""Triton kernels of the draft-block op, run on CPU by Triton's interpreter, against the reference.

Triton fixes interpreter vs compiled mode when ``triton`` is first imported (its standard library
is ``@triton.jit`` code too), so ``TRITON_INTERPRET=1`` must be set before that. This module sets it
when triton is not imported yet; if something imported triton first in compiled mode (this
suite's conftest does, through torch._dynamo), the module skips itself and
``test_draft_block_interpreter.py`` runs it in a fresh interpreter-mode subprocess instead. The
variable stays set for the rest of the session, the only mode in which Triton kernels can run on a
GPU-less machine anyway.
"""

from __future__ import annotations

import os
import sys

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    if "triton" in sys.modules:
        pytest.skip("triton already imported in compiled mode; run in a subprocess by "
                    "test_draft_block_interpreter.py", allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

import torch  # noqa: E402

from draft_block_cases import check_against_float64, problem  # noqa: E402

from trtllm_dflash.plugins.draft_block import triton_kernels as kernels  # noqa: E402
from trtllm_dflash.plugins.draft_block.reference import greedy_accept_reference  # noqa: E402


@pytest.mark.parametrize("window", [None, 1, 7, 150])
@pytest.mark.parametrize("split_size", [None, 64, 128])  # None: one split -> fused kernel
def test_ragged_batch(window, split_size):
    args = problem(4, 3, 6, 2, 16, 300, [0, 1, 130, 300], seed=0)
    check_against_float64(args, 0.3, window, split_size)


@pytest.mark.parametrize("window", [None, 100])
def test_real_drafter_shapes(window):
    """gpt-oss-120b drafter: Hq 64, Hkv 8, D 64, B 10; a few hundred context positions."""
    args = problem(2, 10, 64, 8, 64, 320, [320, 77], seed=1)
    check_against_float64(args, 64**-0.5, window, split_size=128)


def test_strided_arena_view():
    """A per-layer slice of a layer-stacked arena is not contiguous; strides are honoured."""
    q, k_blk, v_blk, ctx_k, ctx_v, lens = problem(2, 4, 4, 2, 16, 96, [50, 96], seed=2)
    stacked_k = torch.stack([torch.zeros_like(ctx_k), ctx_k], dim=1)  # [b, layers, Hkv, S, D]
    stacked_v = torch.stack([torch.zeros_like(ctx_v), ctx_v], dim=1)
    args = (q, k_blk, v_blk, stacked_k[:, 1], stacked_v[:, 1], lens)
    assert not args[3].is_contiguous()
    check_against_float64(args, 0.25, None, split_size=64)


def test_fp16_inputs():
    args = [t.half() if t.is_floating_point() else t for t in problem(2, 5, 4, 2, 32, 200, [200, 9], seed=3)]
    check_against_float64(args, 0.2, None, split_size=64, tol=3e-3)


@pytest.mark.parametrize("batch,kv_heads,span,sms,expected", [
    (1, 8, 32768, 132, 1024),  # small batch: ~2 waves of programs
    (8, 8, 32768, 132, 6592),  # 5 splits: 320 programs, ~2.4 per SM
    (64, 8, 32768, 132, 32768),  # the batch alone fills the GPU: one split (fused kernel)
    (1, 8, 600, 132, 640),  # never below MIN_SPLIT positions
    (1, 8, 0, 132, 64),  # empty span still yields one valid split
])
def test_split_plan(batch, kv_heads, span, sms, expected):
    assert kernels.plan_split_size(batch, kv_heads, span, sms) == expected


def test_context_span():
    assert kernels.context_span(4096, None) == 4096
    assert kernels.context_span(4096, 128) == 127
    assert kernels.context_span(64, 128) == 64


@pytest.mark.parametrize("num_drafts", [0, 1, 9])
@pytest.mark.parametrize("length_dtype", [torch.int32, torch.int64])
def test_greedy_accept_kernel(num_drafts, length_dtype):
    g = torch.Generator().manual_seed(num_drafts)
    batch = 12
    target = torch.randint(0, 4, (batch, num_drafts + 1), generator=g)
    drafts = torch.where(torch.rand(batch, num_drafts, generator=g) < 0.8, target[:, :-1], 5)
    drafts[0] = target[0, :-1]  # one request accepts everything
    lengths = torch.randint(0, 1000, (batch,), generator=g).to(length_dtype)
    got = kernels.greedy_accept_triton(drafts, target, lengths)
    expected = greedy_accept_reference(drafts, target, lengths)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert int(got[0][0]) == num_drafts
