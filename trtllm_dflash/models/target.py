"""The gpt-oss target as the draft-verify loop needs it.

The weights live in transformers' `GptOssForCausalLM` (the reference implementation; it also
dequantizes the MXFP4 experts on CPU). This adapter runs its own lean forward over those very
weights, gpt-fast style, because the loop needs three things transformers' generate path lacks:

* a static K/V arena with per-request lengths that rolls back for free (see `kv_cache.py`);
* ragged batches: every request has its own absolute positions;
* the residual stream after selected decoder layers (the DFlash features).

On a tiny model a step is bound by per-op overhead, not FLOPs, so the forward keeps the op count
low: q/k/v come from one GEMM (weights fused at load; every dense GEMM reads a frozen copy laid out
for it, `CastLinear`; those of the LM head, q/k/v and o_proj are float16 for fbgemm where that holds
them exactly, `exact_dtype`), RMSNorm is one layer_norm kernel on CPU (`lean_rms_norm`), RoPE rotates
q and k in one go, each step builds one additive mask per window kind for all layers,
attention is one fused kernel on CPU, and the MoE multiplies only the experts a block routes to
(`routed_experts`), reading them as float32 or, where the checkpoint's experts allow, from exact bf16
pairs (`target_cpu.bf16_pairs`), exact int8 rows (`target_cpu.int8_rows`: MXFP4 experts), AMX tiles of the bf16
values on a CPU with AMX (`target_cpu.amx_tiles`) or fbgemm's float16 ones (`half_copies`); all but the float16
ones through one call of the compiled CPU MoE kernel after the router where it builds (`plugins/target/cpu.py`),
the float16 ones through a GEMM per routed expert. Which is fastest depends on the machine, so the runtime times them
at start-up: `use_expert_storage`, `runtime/tuning.py`. Where the compiled CPU kernels build, a layer's
RoPE, K/V write and attention are one call too (masks from positions, none built), and so is each
residual add with the RMSNorm after it (`use_cpu_kernels`, `compiled_parts`); where every part is, the
decoder layers of a step are one call (`whole_step`: ~0.7x a lone token's forward on an AVX2 EPYC, round 25).
Where a forward hook watches a bypassed module (calibration), that module is called as it is. The building blocks
(attention, norms, the routed MoE, the hook check) are plain functions in `layers.py`, which the drafter shares;
this file is the adapter: the weights' copies made at load and the forward that strings the blocks together.

Feature convention: target layer id `i` means the OUTPUT of decoder layer `i` (0-based), i.e.
transformers' `hidden_states[i + 1]` -- the z-lab convention (dflash-algorithm.md §2.4) -- except for
the last layer, whose HF entry is after the final norm while this (like TensorRT-LLM) is before it.
The forward is tested token-identical to `GptOssForCausalLM.generate` on the same weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from ..plugins.draft_block import cpu as draft_cpu
from ..plugins.target import cpu as target_cpu
from .kv_cache import KVArena
from .layers import (ExpertMatrices, add_rms_norm, attention_bias, causal_mask, doubled_weight, fused_attention,
                     half_copies, hook_dicts, hooked, rms_norm, routed_experts, sink_attention, stored_bytes)
from .linear import CastLinear, cast, exact_dtype
from .rope import Rotary, rotate


class KernelLinear:
    """A frozen linear map through the compiled CPU kernel (`target_cpu.linear_cpu`): the weight stored [in, out] as
    AMX tiles where the CPU has AMX and bf16 holds it (`target_cpu.amx_tiles`: 0.3-0.4x the time of the FMA kernel
    at 1 to 16 rows of a 256 x 512 weight on a Xeon VM, round 22), else as exact bf16 pairs where bf16 holds it
    (`target_cpu.bf16_pairs`: a bf16 checkpoint's dense weights), else float32; float32 products and sums, so the
    float32 GEMM's result up to summation order."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        plain = weight.detach().t().contiguous()
        self.weight = target_cpu.amx_tiles(plain) or target_cpu.bf16_pairs(plain) or plain.float()
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return target_cpu.linear_cpu(x.contiguous(), self.weight, self.bias)


@dataclass(frozen=True)
class LayerParts:
    """What the lean forward reads of one decoder layer, looked up once at load: an nn.Module attribute costs ~1 us and
    a ModuleList index several, and their chains took 0.1-0.2 ms of a ~1 ms AR step on a Xeon VM (round 22). The
    modules themselves, so that a hook added later (calibration) is still seen (`hooked`)."""

    attention: nn.Module
    projections: tuple[nn.Module, nn.Module, nn.Module]  # q, k, v
    o_proj: nn.Module
    post_attention_norm: nn.Module
    mlp: nn.Module
    router: nn.Module
    experts: nn.Module
    sinks: torch.Tensor  # float32 [Hkv, G, 1], `fused_attention`'s layout


def fuse_qkv(attn: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """One [q; k; v] weight and bias (a copy: the adapter treats the target's weights as frozen)."""
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    return (torch.cat([p.weight.detach() for p in projections]), torch.cat([p.bias.detach() for p in projections]))


class GptOssTarget(nn.Module):
    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model.eval().requires_grad_(False)
        cfg = hf_model.config
        self.config = cfg
        self.rotary = Rotary(cfg).to(hf_model.lm_head.weight.device)  # built after the model was placed
        self.windows = [cfg.sliding_window if kind == "sliding_attention" else None for kind in cfg.layer_types]
        self.head_dim = cfg.head_dim
        self.scale = self.head_dim ** -0.5
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.groups = self.num_heads // self.num_kv_heads
        self.qkv, self.o_proj = [], []  # frozen copies laid out for the GEMM (`CastLinear`)
        self.norm_weights = [(doubled_weight(layer.input_layernorm), doubled_weight(layer.post_attention_layernorm))
                             for layer in hf_model.model.layers]  # `rms_norm`'s
        self.final_norm = doubled_weight(hf_model.model.norm)
        # the norm after each layer's residual add: the next layer's input norm, after the last the final one
        layers = hf_model.model.layers
        self.first_norm = (layers[0].input_layernorm, self.norm_weights[0][0])  # a tuple: not a registered submodule
        self.next_norms = [(layer.input_layernorm, weights[0]) for layer, weights in zip(layers[1:], self.norm_weights[1:])]
        self.next_norms.append((hf_model.model.norm, self.final_norm))
        # q/k/v and o_proj also through the compiled CPU kernel (`use_cpu_kernels`) where its output width fits it
        # (the LM head stays fbgemm's: its 1 to 8 rows ran 1.25-1.4x slower in the kernel, whose [in, out] tiles
        # stride 8 KB through a 4096-wide head)
        lean = self.device.type == "cpu" and self.dtype == torch.float32

        def kernel_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> KernelLinear | None:
            return KernelLinear(weight, bias) if lean and weight.shape[0] % target_cpu.LANES == 0 else None
        self.qkv_kernel, self.o_proj_kernel, self.layer_parts = [], [], []
        for layer in hf_model.model.layers:
            attn = layer.self_attn
            qkv_weight, qkv_bias = fuse_qkv(attn)
            self.qkv.append(CastLinear(qkv_weight, qkv_bias, exact_dtype(qkv_weight)))
            self.o_proj.append(CastLinear(attn.o_proj.weight, attn.o_proj.bias, exact_dtype(attn.o_proj.weight)))
            self.qkv_kernel.append(kernel_linear(qkv_weight, qkv_bias))
            self.o_proj_kernel.append(kernel_linear(attn.o_proj.weight, attn.o_proj.bias))
            sinks = attn.sinks.detach().float().view(self.num_kv_heads, self.groups, 1)
            self.layer_parts.append(LayerParts(attn, (attn.q_proj, attn.k_proj, attn.v_proj), attn.o_proj,
                                               layer.post_attention_layernorm, layer.mlp, layer.mlp.router,
                                               layer.mlp.experts, sinks))
        originals = [(layer.mlp.experts.gate_up_proj.detach(), layer.mlp.experts.down_proj.detach())
                     for layer in hf_model.model.layers]
        # where the MoE can read its experts from, by dtype name: the model's own, and bf16-pair / fbgemm float16 /
        # int8-row / AMX-tile copies where made
        self.expert_storages: dict[str, list[tuple[ExpertMatrices, ExpertMatrices]]] = {
            str(originals[0][0].dtype).removeprefix("torch."): originals}
        pairs = [(target_cpu.bf16_pairs(gate_up), target_cpu.bf16_pairs(down)) for gate_up, down in originals]
        if originals[0][0].dtype == torch.float32 and all(copy is not None for pair in pairs for copy in pair):
            self.expert_storages["bfloat16"] = pairs
        half = [(half_copies(gate_up), half_copies(down)) for gate_up, down in originals]
        if all(copy is not None for pair in half for copy in pair):
            self.expert_storages["float16"] = half
        rows = [(target_cpu.int8_rows(gate_up), target_cpu.int8_rows(down)) for gate_up, down in originals]
        if all(copy is not None for pair in rows for copy in pair):
            self.expert_storages["int8"] = rows
        if lean:
            tiles = [(target_cpu.amx_tiles(gate_up), target_cpu.amx_tiles(down)) for gate_up, down in originals]
            if all(copy is not None for pair in tiles for copy in pair):
                self.expert_storages["amx"] = tiles
        self.moe_call_sets: dict[str, list[target_cpu.MoeCall | None]] = {}
        self.whole_steps: dict[str, target_cpu.WholeTargetStep | None] = {}  # per expert storage, built on first use
        # the modules a hook on which sends a step down the per-call path (`hooked`), as their hook dicts: asked every
        # step, where a walk over the modules ran cold after the last step's kernels (round 28)
        self.watched_hooks = hook_dicts(hf_model.model.embed_tokens, *(
            module for parts in self.layer_parts for module in (*parts.projections, parts.o_proj, parts.experts,
                                                                parts.router)))
        self.embedding = hf_model.model.embed_tokens.weight.detach()  # the hidden states' dtype and device
        self.use_expert_storage(next(iter(self.expert_storages)))
        self.use_cpu_kernels = True  # False: attention, MoE and add + RMSNorms in torch even where compiled kernels serve
        self.use_whole_step = True  # False: the decoder layers part by part even where `whole_step` serves (an A/B)
        head = hf_model.lm_head
        self.head = CastLinear(head.weight, head.bias, exact_dtype(head.weight))
        # a greedy verify's argmaxes through the head's int8 copy, exactly (`accept.greedy_verify_block`)
        self.greedy_head = (draft_cpu.ExactGreedyHead(head.weight, head.bias)
                            if lean and draft_cpu.dot_serves(head.weight, torch.int8) else None)

    def use_expert_storage(self, name: str) -> None:
        """Read the experts from `expert_storages[name]` from now on: the same numbers from the bf16 pairs and the
        int8 rows, the same to float32 rounding from the float16 ones and the AMX tiles."""
        self.expert_weights = self.expert_storages[name]  # per layer (gate_up, down)
        self.expert_storage = name
        # per layer the compiled MoE's one call on these experts, where it takes them (a float32 CPU target); made once
        # per storage, since the start-up timing switches storages every round (`runtime/tuning.py`)
        if name not in self.moe_call_sets:
            lean = self.device.type == "cpu" and self.dtype == torch.float32
            self.moe_call_sets[name] = [target_cpu.moe_call(parts.mlp, *weights) if lean else None
                                        for parts, weights in zip(self.layer_parts, self.expert_weights)]
        self.moe_calls = self.moe_call_sets[name]

    def expert_bytes(self) -> int:
        """The bytes every layer's expert matrices take in the storage the MoE reads now (a step's floor counts
        the experts it touches at this size, `benchmarks/bench_step_costs.py`)."""
        originals = next(iter(self.expert_storages.values()))
        return sum(stored_bytes(copy, original.numel())
                   for copies, plain in zip(self.expert_weights, originals) for copy, original in zip(copies, plain))

    @property
    def prefill_storage(self) -> str:
        """The expert storage a prompt's prefill reads (`reading_experts`): the AMX tiles where this CPU has them, whose
        multiplies pay off on a prompt's many rows per expert (a 121-token prompt's prefill took 0.68x its time from the
        int8 rows on an AMX Xeon, round 27; decode steps, a few rows per expert, keep the storage timed for them);
        else the current one."""
        return "amx" if "amx" in self.expert_storages else self.expert_storage

    @contextmanager
    def reading_experts(self, name: str) -> Iterator[None]:
        """Read the experts from `expert_storages[name]` inside the block, from the current storage again after it."""
        kept = self.expert_storage
        self.use_expert_storage(name)
        try:
            yield
        finally:
            self.use_expert_storage(kept)

    def compiled_parts(self, storage: str | None = None) -> list[str]:
        """The parts of the lean path that run compiled CPU kernels ("attention", "moe", "add_rms_norm"); none
        unless `use_cpu_kernels`. "moe" where the kernel takes the experts' storage `storage` (default: the
        current one; `target_cpu.moe_serves`)."""
        if not self.use_cpu_kernels:
            return []
        gate_up, down = self.expert_storages[storage][0] if storage else self.expert_weights[0]
        probe = torch.empty(0, self.hidden_size, dtype=self.dtype, device=self.device)
        served = {"attention": target_cpu.attention_serves(probe, self.head_dim),
                  "moe": target_cpu.moe_serves(probe, gate_up, down), "add_rms_norm": draft_cpu.serves(probe)}
        return [part for part, serves in served.items() if serves]

    def whole_step(self) -> target_cpu.WholeTargetStep | None:
        """The decoder layers in one compiled call on the current expert storage, where every part of the lean path
        runs compiled (q/k/v and o_proj, attention, MoE, norms: a float32 CPU target, `use_cpu_kernels`) and its norms
        share one epsilon; else None. Built once per storage."""
        name = self.expert_storage
        if name not in self.whole_steps:
            self.whole_steps[name] = self.build_whole_step()
        return self.whole_steps[name]

    def build_whole_step(self) -> target_cpu.WholeTargetStep | None:
        module = target_cpu.target_kernels()
        norms = [self.first_norm[0], *(parts.post_attention_norm for parts in self.layer_parts),
                 *(norm for norm, _ in self.next_norms)]
        if (module is None or set(self.compiled_parts()) != {"attention", "moe", "add_rms_norm"}
                or None in (*self.qkv_kernel, *self.o_proj_kernel, *self.moe_calls)
                or len({norm.variance_epsilon for norm in norms}) != 1):
            return None

        def linear(kernel: KernelLinear) -> tuple:  # `TargetStep`'s (weight, bias, tiles)
            weight, tiles = target_cpu.linear_weight(kernel.weight)
            return weight, kernel.bias, tiles
        step = module.TargetStep(
            self.first_norm[1], [linear(k) for k in self.qkv_kernel], [linear(k) for k in self.o_proj_kernel],
            [parts.sinks for parts in self.layer_parts], [-1 if w is None else w for w in self.windows],
            [weights[1] for weights in self.norm_weights], [call.arguments() for call in self.moe_calls],
            [weights for _, weights in self.next_norms], norms[0].variance_epsilon, self.scale)
        return target_cpu.WholeTargetStep(step, self.embedding, self.rotary)

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.hf.lm_head.weight.device

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def new_cache(self, batch: int, capacity: int) -> KVArena:
        cfg = self.config
        return KVArena(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, capacity, self.head_dim,
                       self.dtype, self.device)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf.model.embed_tokens(tokens)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits from a hidden state that is already final-normed (the drafter's output is), through
        the head's `CastLinear` copy. Gradients reach `hidden` (training backpropagates through it): a
        differentiable call takes the head's own weight where the copy is fbgemm's, which has no autograd."""
        if self.head.half and torch.is_grad_enabled() and hidden.requires_grad:
            return cast(self.hf.lm_head(cast(hidden, self.dtype)), torch.float32)
        return cast(self.head(hidden), torch.float32)

    def attention(self, i: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                  cache: KVArena, kv_len: int, mask: torch.Tensor | None, compiled: bool) -> torch.Tensor:
        """Layer i's attention on normed h [b, t, H]: writes the tokens' K/V, attends over [0, kv_len) (`mask`:
        what each token sees); `compiled`: after the q/k/v GEMM, one call of the compiled kernel, which masks
        by positions (`mask` unused)."""
        b, t, _ = h.shape
        parts = self.layer_parts[i]
        if hooked(*parts.projections):
            qkv = torch.cat([projection(h) for projection in parts.projections], dim=-1)
        else:
            qkv = (self.qkv_kernel[i] if compiled and self.qkv_kernel[i] else self.qkv[i])(h)
        if compiled:
            out = target_cpu.sink_attention_cpu(qkv, cos, sin, cache.k[i], cache.v[i], positions, self.windows[i],
                                                parts.sinks, self.scale)
        else:
            out = self.torch_attention(i, qkv.view(b, t, -1, self.head_dim), cos, sin, positions, cache, kv_len, mask)
        if hooked(parts.o_proj):
            return parts.o_proj(out)
        return (self.o_proj_kernel[i] if compiled and self.o_proj_kernel[i] else self.o_proj[i])(out)

    def torch_attention(self, i: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                        cache: KVArena, kv_len: int, mask: torch.Tensor | None) -> torch.Tensor:
        """`attention` after the q/k/v GEMM in torch ops: qkv [b, t, Hq + 2 Hkv, D] -> [b, t, Hq * D]."""
        hq, hkv = self.num_heads, self.num_kv_heads
        cos, sin = cos[:, :, None], sin[:, :, None]  # broadcast over heads
        qk = rotate(qkv[:, :, : hq + hkv], cos, sin)  # q and k heads side by side: one rotation
        cache.write(i, positions, qk[:, :, hq:], qkv[:, :, hq + hkv:])
        keys, values = cache.read(i, kv_len)
        q = qk[:, :, :hq].transpose(1, 2)
        if qkv.device.type == "cpu":
            return fused_attention(q, keys, values, mask, self.layer_parts[i].sinks, self.scale)
        return sink_attention(q, keys, values, mask, self.layer_parts[i].attention.sinks, self.scale)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVArena,
                feature_layers: list[int], logit_index: torch.Tensor | None = None, head: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run tokens [b, t] at absolute positions [b, t], writing their K/V into the cache, in inference mode.

        Returns logits [b, t, V] (or [b, V] at `logit_index` [b]; with `head` False the final-normed hidden
        states instead, [b, t, H] or [b, H]) and the concatenated outputs of `feature_layers` [b, t, len * hidden]
        (None when no layer is asked for).
        """
        if not torch.is_inference_mode_enabled():  # the loop runs in it: entering it again every step ran cold
            with torch.inference_mode():
                return self.forward(tokens, positions, cache, feature_layers, logit_index, head)
        embedding = self.embedding
        compiled = embedding.device.type == "cpu" and self.use_cpu_kernels
        compiled_attention = compiled and target_cpu.attention_serves(embedding, self.head_dim)
        step = self.whole_step() if compiled_attention and self.use_whole_step else None
        if step is not None and not any(self.watched_hooks):
            h, features = step(tokens, cache, positions, feature_layers)
        else:
            x = self.embed(tokens)
            kv_len = int(positions.max()) + 1
            cos, sin = self.rotary(positions, x.dtype, kv_len)
            h, features = self.layers(x, cos, sin, positions, cache, feature_layers, kv_len, compiled, compiled_attention)
        if logit_index is not None:
            h = h[torch.arange(len(h), device=h.device), logit_index]
        return (self.lm_head(h) if head else h), features

    def layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, cache: KVArena,
               feature_layers: list[int], kv_len: int, compiled: bool, compiled_attention: bool
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`'s decoder layers part by part (each compiled where it serves, else in torch) on the embeddings
        x [b, t, H] -> (final-normed hidden states, the feature layers' outputs side by side or None)."""
        lean = x.device.type == "cpu"
        masks = {} if compiled_attention else {w: causal_mask(positions, kv_len, w) for w in set(self.windows)}
        if lean:
            masks = {w: attention_bias(mask, self.groups, x.dtype) for w, mask in masks.items()}
        captured = {}
        b, t, _ = x.shape
        fused_norms = compiled and draft_cpu.serves(x)  # asked once a step, not at each of its eight norms
        norm, doubled = self.first_norm
        h = draft_cpu.rms_norm_cpu(x, doubled, norm.variance_epsilon) if fused_norms else rms_norm(x, norm, doubled)
        for i, parts in enumerate(self.layer_parts):
            attention = self.attention(i, h, cos, sin, positions, cache, kv_len, masks.get(self.windows[i]),
                                       compiled_attention)
            x, h = add_rms_norm(x, attention, parts.post_attention_norm, self.norm_weights[i][1], fused_norms)
            if compiled and self.moe_calls[i] is not None and not hooked(parts.experts, parts.router):
                moe = self.moe_calls[i](h.view(b * t, -1)).view(b, t, -1)
            elif lean and not hooked(parts.experts):
                moe = routed_experts(h.view(b * t, -1), parts.mlp, *self.expert_weights[i],
                                     compiled=compiled).view(b, t, -1)
            else:
                moe = parts.mlp(h)[0]
            x, h = add_rms_norm(x, moe, *self.next_norms[i], fused_norms)  # each residual add with the norm after it
            if i in feature_layers:
                captured[i] = x
        features = torch.cat([captured[i] for i in feature_layers], dim=-1) if feature_layers else None
        return h, features
