"""ONNX export of a drafter step with the DraftBlockAttention plugin node; numerics in onnxruntime CPU.

The step module below mirrors one DFlash drafter layer (RMSNorm, biased q/k/v/o, per-head q/k
RMSNorm, RoPE at absolute positions ctx_len + j, SwiGLU MLP, final norm, LM head) with its attention
calling ``dflash::draft_block_attention``; the real drafter plugs into the same exporter.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("onnxscript")
pytest.importorskip("onnxruntime_extensions")

from trtllm_dflash.plugins.draft_block import draft_block_attention  # noqa: E402
from trtllm_dflash.plugins.draft_block.onnx_export import (  # noqa: E402
    PLUGIN_NAMESPACE,
    export_drafter_step,
    plugin_nodes,
    run_on_cpu,
    step_input_names,
)

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB, BLOCK = 64, 4, 2, 16, 2, 97, 4


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX-style rotation of [rows, heads, D] by per-row cos/sin [rows, 1, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class DrafterLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_norm, self.post_norm = RMSNorm(HIDDEN), RMSNorm(HIDDEN)
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN)
        self.q_norm, self.k_norm = RMSNorm(HEAD_DIM), RMSNorm(HEAD_DIM)
        self.gate, self.up = nn.Linear(HIDDEN, 2 * HIDDEN, bias=False), nn.Linear(HIDDEN, 2 * HIDDEN, bias=False)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN, bias=False)

    def forward(self, x, ctx_k, ctx_v, ctx_lens, cos, sin):
        h = self.input_norm(x)
        q = rope(self.q_norm(self.q_proj(h).view(-1, HEADS, HEAD_DIM)), cos, sin)
        k = rope(self.k_norm(self.k_proj(h).view(-1, KV_HEADS, HEAD_DIM)), cos, sin)
        v = self.v_proj(h).view(-1, KV_HEADS, HEAD_DIM)
        attn = draft_block_attention(q, k, v, ctx_k, ctx_v, ctx_lens, HEAD_DIM**-0.5)
        x = x + self.o_proj(attn.reshape(-1, HEADS * HEAD_DIM))
        h = self.post_norm(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


class DrafterStep(nn.Module):
    """block_embeds [b, B, hidden], ctx_lens [b], (ctx_k, ctx_v) per layer -> logits [b, B-1, vocab]."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(DrafterLayer() for _ in range(LAYERS))
        self.norm = RMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, block_embeds, ctx_lens, *ctx_kv):
        b, block, _ = block_embeds.shape
        positions = ctx_lens.to(torch.float32)[:, None] + torch.arange(block, dtype=torch.float32)
        angles = (positions.reshape(-1, 1) * self.inv_freq)[:, None, :]
        cos, sin = angles.cos(), angles.sin()
        x = block_embeds.reshape(b * block, HIDDEN)
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx_kv[2 * i], ctx_kv[2 * i + 1], ctx_lens, cos, sin)
        return self.lm_head(self.norm(x)).view(b, block, VOCAB)[:, 1:]


def step_inputs(batch: int, s_cap: int, lens: list[int], seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    arena = [torch.randn(batch, KV_HEADS, s_cap, HEAD_DIM, generator=g) for _ in range(2 * LAYERS)]
    embeds = torch.randn(batch, BLOCK, HIDDEN, generator=g)
    return (embeds, torch.tensor(lens, dtype=torch.int32), *arena)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    step = DrafterStep().eval()
    path = tmp_path_factory.mktemp("onnx") / "drafter_step.onnx"
    model = export_drafter_step(step, step_inputs(2, 24, [5, 24], seed=1), path, num_layers=LAYERS)
    return step, model, path


def test_graph_has_one_plugin_node_per_layer(exported):
    _, model, path = exported
    assert path.exists()
    nodes = plugin_nodes(model)
    assert len(nodes) == LAYERS
    attrs = {a.name: a for a in nodes[0].attribute}
    assert attrs["plugin_namespace"].s.decode() == PLUGIN_NAMESPACE
    assert attrs["block_size"].i == BLOCK and attrs["sliding_window"].i == 0 and attrs["aot"].i == 1
    assert attrs["scale"].f == pytest.approx(HEAD_DIM**-0.5)
    assert [i.name for i in model.graph.input] == step_input_names(LAYERS)


@pytest.mark.parametrize("batch,s_cap,lens", [(2, 24, [5, 24]), (3, 40, [0, 17, 40])])
def test_onnxruntime_matches_torch(exported, batch, s_cap, lens):
    step, model, _ = exported
    inputs = step_inputs(batch, s_cap, lens, seed=batch)
    with torch.no_grad():
        expected = step(*inputs).numpy()
    feeds = {name: t.numpy() for name, t in zip(step_input_names(LAYERS), inputs)}
    (logits,) = run_on_cpu(model, feeds)
    assert logits.shape == (batch, BLOCK - 1, VOCAB)
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)
