"""Train, export and evaluate the embedded tiny gpt-oss target (nanoGPT style, one file).

    python -m trtllm_dflash.train.target --out runs/target --threads 1 --total-steps 6000 --max-minutes 330
    python -m trtllm_dflash.train.target export --ckpt runs/target/best.pt --dest runs/target/export
    python -m trtllm_dflash.train.target evaluate --model runs/target/export

``ckpt.pt`` is the latest state (for resuming), ``best.pt`` the weights with the lowest held-out
loss seen at an evaluation (the one to export if the small corpus starts to overfit).

The model is transformers' ``GptOssForCausalLM`` with the real gpt-oss structure (alternating
sliding/full attention with sinks, top-k MoE with clamped SwiGLU and biases, YaRN RoPE with the
released parameters, untied LM head) at laptop size. It has to write plausible code (a babbling
target makes DFlash acceptance meaningless) and must stay clearly more expensive per token than a
1-layer hidden-256 drafter, hence 4 layers.

Training re-runs are resumable: the same command picks up ``<out>/ckpt.pt`` (model, optimizer,
step, RNG). The batch of step ``s`` is drawn from a generator seeded by ``(SEED, s)``, so the data
position is the step itself and a resumed run sees exactly the batches an uninterrupted one would.
The cosine schedule is defined over ``--total-steps``, so one schedule can span many invocations
(each bounded by ``--max-minutes``). ``--init-from`` starts a new run from another run's weights
(a fresh optimizer and schedule: a warm restart), e.g. to continue the shipped target on corpus v2:

    python -m trtllm_dflash.train.target --out runs/target2 --init-from runs/target/best.pt \
        --corpus-version 2 --lr 1e-3 --total-steps 4500 --max-minutes 135
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoTokenizer, GptOssConfig, GptOssForCausalLM

from trtllm_dflash.checkpoints.gpt_oss import load_hf_gpt_oss
from trtllm_dflash.quant.codecs import mxfp4_decode, mxfp4_encode
from trtllm_dflash.train import corpus

# ---------------------------------------------------------------------------------------------
# Hyper-parameters (the defaults of the shipped target; model ones are frozen into the checkpoint)

# model: ~9.2M parameters, of which ~2.1M embedding + LM head
N_LAYER = 4
HIDDEN = 256
N_HEAD = 4
N_KV_HEAD = 2
HEAD_DIM = 64
N_EXPERT = 8
TOP_K = 2
INTERMEDIATE = 256
SLIDING_WINDOW = 64
# RoPE exactly as released gpt-oss (YaRN factor 32 over 4096 original positions, theta 150000)
ROPE_PARAMETERS = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                   "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}
MAX_POSITION = 131072
ROUTER_AUX_LOSS_COEF = 0.01  # load balancing keeps all 8 experts in use when training from scratch

# data: 4096 tokens per step: 16 x 256 (~1.4 s on one core with bf16 autocast), then for the last
# LONG_FRAC of the schedule 8 x 512 (25% slower per token), so the full-attention layers have seen
# distances up to 511 and a prompt plus a few hundred generated tokens stays in-distribution.
SEQ_LEN = 256
LONG_SEQ_LEN = 512
LONG_FRAC = 0.2
TOKENS_PER_STEP = 4096
SEED = 1337

# optimizer: AdamW, linear warm-up then cosine to MIN_LR_FRAC * LR over --total-steps
LR = 2e-3
MIN_LR_FRAC = 0.1
WARMUP_STEPS = 200
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)
GRAD_CLIP = 1.0
# bf16 autocast measured 3100 vs 2400 tokens/s (fp32) on one core of this machine
AUTOCAST_BF16 = True

# bookkeeping
EVAL_EVERY = 250
SAVE_MINUTES = 5.0
LOG_EVERY = 10
EVAL_BATCH = 32

# export: only the experts are MXFP4, as in the released checkpoint
MODULES_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
# config.json keys: those of the released gpt-oss config.json (RoPE as rope_theta + rope_scaling,
# which TRT-LLM reads and transformers 5 converts), plus swiglu_alpha, which transformers also reads
CONFIG_KEYS = ["architectures", "attention_bias", "attention_dropout", "eos_token_id", "head_dim", "hidden_act",
               "hidden_size", "initializer_range", "intermediate_size", "layer_types", "max_position_embeddings",
               "model_type", "num_attention_heads", "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads",
               "num_local_experts", "output_router_logits", "pad_token_id", "rms_norm_eps", "router_aux_loss_coef",
               "sliding_window", "swiglu_alpha", "swiglu_limit", "tie_word_embeddings", "transformers_version",
               "vocab_size"]

# evaluate
EVAL_PROMPTS = 24
EVAL_NEW_TOKENS = 64


# ---------------------------------------------------------------------------------------------
# model


def model_config(vocab_size: int, eos_id: int, **overrides) -> GptOssConfig:
    """The target's ``GptOssConfig``; ``overrides`` (tests) replace any size hyper-parameter."""
    hp = dict(num_hidden_layers=N_LAYER, hidden_size=HIDDEN, num_attention_heads=N_HEAD,
              num_key_value_heads=N_KV_HEAD, head_dim=HEAD_DIM, num_local_experts=N_EXPERT,
              num_experts_per_tok=TOP_K, intermediate_size=INTERMEDIATE, sliding_window=SLIDING_WINDOW)
    hp.update(overrides)
    n = hp["num_hidden_layers"]
    return GptOssConfig(
        vocab_size=vocab_size, **hp,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
        max_position_embeddings=MAX_POSITION, rope_parameters=dict(ROPE_PARAMETERS),
        router_aux_loss_coef=ROUTER_AUX_LOSS_COEF, tie_word_embeddings=False, attention_bias=True,
        eos_token_id=eos_id, pad_token_id=eos_id, architectures=["GptOssForCausalLM"],
    )


def build_model(config: GptOssConfig, seed: int = SEED) -> GptOssForCausalLM:
    """Fresh fp32 model; eager attention (sinks rule out SDPA), grouped-mm experts (fastest here)."""
    config._attn_implementation = "eager"
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(seed)
    return GptOssForCausalLM(config)


# ---------------------------------------------------------------------------------------------
# data


def tokenize_split(tokenizer, split: str, path: Path, corpus_version: int = 1) -> np.memmap:
    """Tokenize every file of ``split`` once into a uint16 memmap, each file followed by EOS."""
    if not path.exists():
        ids: list[int] = []
        for text in corpus.iter_texts(split, version=corpus_version):
            ids.extend(tokenizer.encode(text))
            ids.append(tokenizer.eos_token_id)
        tmp = path.with_suffix(".tmp")
        np.asarray(ids, dtype=np.uint16).tofile(tmp)
        os.replace(tmp, path)
    return np.memmap(path, dtype=np.uint16, mode="r")


def seq_len_at(step: int, total_steps: int, seq_len: int = SEQ_LEN, long_seq_len: int = LONG_SEQ_LEN) -> int:
    """Training sequence length of ``step``: ``long_seq_len`` for the last LONG_FRAC of the schedule."""
    return long_seq_len if step >= (1 - LONG_FRAC) * total_steps else seq_len


def get_batch(data: np.ndarray, step: int, batch: int, seq_len: int, seed: int = SEED) -> torch.Tensor:
    """``[batch, seq_len + 1]`` random windows; a pure function of ``step`` (resume-exact)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=g).tolist()
    return torch.from_numpy(np.stack([data[s : s + seq_len + 1].astype(np.int64) for s in starts]))


def heldout_batches(data: np.ndarray, seq_len: int, batch: int = EVAL_BATCH):
    """All non-overlapping held-out windows, in order (a fixed evaluation set)."""
    n = (len(data) - 1) // seq_len
    for i in range(0, n, batch):
        rows = [data[j * seq_len : j * seq_len + seq_len + 1].astype(np.int64) for j in range(i, min(n, i + batch))]
        yield torch.from_numpy(np.stack(rows))


# ---------------------------------------------------------------------------------------------
# training


def lr_at(step: int, total_steps: int, lr: float = LR) -> float:
    """Linear warm-up over WARMUP_STEPS, then cosine from ``lr`` to MIN_LR_FRAC * lr at ``total_steps``."""
    if step < WARMUP_STEPS:
        return lr * (step + 1) / WARMUP_STEPS
    t = min(1.0, (step - WARMUP_STEPS) / max(1, total_steps - WARMUP_STEPS))
    return lr * (MIN_LR_FRAC + (1 - MIN_LR_FRAC) * 0.5 * (1 + math.cos(math.pi * t)))


def make_optimizer(model: torch.nn.Module, lr: float = LR) -> torch.optim.AdamW:
    """AdamW; matrices (incl. expert tensors and embeddings) decay, vectors (norms, biases, sinks) don't."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=BETAS, fused=True)


def lm_loss(model: GptOssForCausalLM, batch: torch.Tensor, aux: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(next-token cross-entropy, total loss incl. router load-balancing term when ``aux``)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=AUTOCAST_BF16):
        out = model(input_ids=batch[:, :-1], output_router_logits=aux, use_cache=False)
    ce = F.cross_entropy(out.logits.float().flatten(0, 1), batch[:, 1:].flatten())
    total = ce + model.config.router_aux_loss_coef * out.aux_loss if aux else ce
    return ce, total


@torch.no_grad()
def heldout_loss(model: GptOssForCausalLM, data: np.ndarray, seq_len: int = SEQ_LEN) -> float:
    """Mean next-token cross-entropy (nats) over the fixed held-out windows."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for batch in heldout_batches(data, seq_len):
        ce, _ = lm_loss(model, batch, aux=False)
        total += ce.item() * batch.shape[0]
        count += batch.shape[0]
    model.train(was_training)
    return total / count


def save_checkpoint(path: Path, model, optimizer, step: int, meta: dict) -> None:
    """Atomic write of everything needed to resume (model, optimizer, step, RNG, metadata)."""
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
             "rng": torch.get_rng_state(), "config": model.config.to_dict(), "meta": meta}
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_model_from_checkpoint(path: Path) -> tuple[GptOssForCausalLM, dict]:
    """Model (fp32, train mode off) and the raw checkpoint dict."""
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    model = build_model(GptOssConfig.from_dict(ckpt["config"]))
    model.load_state_dict(ckpt["model"])
    return model.eval(), ckpt


class Progress:
    """rich progress bar on a TTY, plain log lines otherwise (nohup'ed background runs)."""

    def __init__(self, total: int, start: int):
        self.tty = sys.stdout.isatty()
        if self.tty:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress
            self.bar = RichProgress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                    TextColumn("{task.fields[info]}"), TimeRemainingColumn())
            self.task = self.bar.add_task("train", total=total, completed=start, info="")
            self.bar.start()

    def update(self, step: int, info: str) -> None:
        if self.tty:
            self.bar.update(self.task, completed=step, info=info)
        else:
            print(f"{time.strftime('%H:%M:%S')} step {step} {info}", flush=True)

    def log(self, msg: str) -> None:
        if self.tty:
            self.bar.console.print(msg)
        else:
            print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)

    def close(self) -> None:
        if self.tty:
            self.bar.stop()


def prepare_run(out: Path, tokenizer_dir: Path, corpus_version: int = 1):
    """Copy the tokenizer into the run (self-contained) and pre-tokenize both splits once."""
    tok_dir = out / "tokenizer"
    if not tok_dir.exists():
        shutil.copytree(tokenizer_dir, tok_dir)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    recorded = out / "corpus_split.json"
    if recorded.exists():  # train.bin / heldout.bin of a started run hold its own corpus
        started = json.loads(recorded.read_text()).get("corpus_version", 1)
        if started != corpus_version:
            raise SystemExit(f"error: {recorded}: the run was started on corpus v{started}, not v{corpus_version}")
    record = corpus.split_record(version=corpus_version)
    recorded.write_text(json.dumps(record, indent=1) + "\n")
    train = tokenize_split(tokenizer, "train", out / "train.bin", corpus_version)
    held = tokenize_split(tokenizer, "heldout", out / "heldout.bin", corpus_version)
    return tokenizer, train, held


def train(out: Path, tokenizer_dir: Path, total_steps: int, max_minutes: float, seq_len: int = SEQ_LEN,
          long_seq_len: int = LONG_SEQ_LEN, lr: float = LR, eval_every: int = EVAL_EVERY,
          save_minutes: float = SAVE_MINUTES, log_every: int = LOG_EVERY, config_overrides: dict | None = None,
          corpus_version: int = 1, init_from: Path | None = None) -> dict:
    """Run (or resume) training until ``total_steps`` or ``max_minutes``; returns the final metadata.

    A new run starts from ``init_from``'s weights (a checkpoint of another run) when given; a run
    that has its own ``ckpt.pt`` always resumes from that.
    """
    out.mkdir(parents=True, exist_ok=True)
    tokenizer, train_data, held_data = prepare_run(out, tokenizer_dir, corpus_version)
    ckpt_path = out / "ckpt.pt"
    if ckpt_path.exists():
        model, ckpt = load_model_from_checkpoint(ckpt_path)
        optimizer = make_optimizer(model, lr)
        optimizer.load_state_dict(ckpt["optimizer"])
        torch.set_rng_state(ckpt["rng"])
        step, meta = ckpt["step"], ckpt["meta"]
        print(f"resumed from {ckpt_path} at step {step}", flush=True)
    elif init_from is not None:
        model, _ = load_model_from_checkpoint(init_from)
        optimizer = make_optimizer(model, lr)
        step, meta = 0, {"tokens": 0, "train_seconds": 0.0, "best_heldout": None, "init_from": str(init_from)}
        print(f"new run from the weights of {init_from}", flush=True)
    else:
        model = build_model(model_config(len(tokenizer), tokenizer.eos_token_id, **(config_overrides or {})))
        optimizer = make_optimizer(model, lr)
        step, meta = 0, {"tokens": 0, "train_seconds": 0.0, "best_heldout": None}
        print(f"new model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters", flush=True)
    model.train()

    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signum

    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    metrics = (out / "metrics.jsonl").open("a")

    def evaluate_and_log(train_loss: float) -> None:
        loss = heldout_loss(model, held_data, seq_len)
        rec = {"step": step, "tokens": meta["tokens"], "train_seconds": round(meta["train_seconds"], 1),
               "train_loss": train_loss, "heldout_loss": loss, "lr": lr_at(step, total_steps, lr), "time": time.time()}
        metrics.write(json.dumps(rec) + "\n")
        metrics.flush()
        if meta["best_heldout"] is None or loss < meta["best_heldout"]:
            meta["best_heldout"] = loss
            torch.save({"model": model.state_dict(), "config": model.config.to_dict(), "step": step,
                        "heldout_loss": loss}, out / "best.pt")
        progress.log(f"eval step {step}: held-out loss {loss:.4f} (best {meta['best_heldout']:.4f})")

    progress = Progress(total_steps, step)
    t_start = t_save = time.time()
    t_log, tokens_log, loss_ema = time.time(), 0, None
    try:
        while step < total_steps and stop["signal"] is None and time.time() - t_start < max_minutes * 60:
            t0 = time.time()
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, total_steps, lr)
            t = seq_len_at(step, total_steps, seq_len, long_seq_len)
            ce, loss = lm_loss(model, get_batch(train_data, step, TOKENS_PER_STEP // t, t), aux=True)
            if not torch.isfinite(loss):  # raise before the update, so the saved weights stay finite
                raise FloatingPointError(f"non-finite loss at step {step}")
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            meta["tokens"] += TOKENS_PER_STEP
            meta["train_seconds"] += time.time() - t0
            tokens_log += TOKENS_PER_STEP
            loss_ema = ce.item() if loss_ema is None else 0.9 * loss_ema + 0.1 * ce.item()
            if step % log_every == 0 or step == total_steps:
                rate = tokens_log / (time.time() - t_log)
                eta = (total_steps - step) * TOKENS_PER_STEP / rate
                progress.update(step, f"loss {loss_ema:.3f} lr {lr_at(step, total_steps, lr):.2e} "
                                      f"{rate:.0f} tok/s eta {eta / 60:.0f} min")
                t_log, tokens_log = time.time(), 0
            if step % eval_every == 0 or step == total_steps:
                evaluate_and_log(loss_ema)
                t_log = time.time()  # tokens/s measures training only
            if time.time() - t_save > save_minutes * 60:
                save_checkpoint(ckpt_path, model, optimizer, step, meta)
                t_save = time.time()
    finally:
        save_checkpoint(ckpt_path, model, optimizer, step, meta)
        progress.close()
        metrics.close()
        for s, h in old_handlers.items():
            signal.signal(s, h)
    why = f"signal {stop['signal']}" if stop["signal"] else ("done" if step >= total_steps else "time budget")
    print(f"stopped at step {step}/{total_steps} ({why}); checkpoint {ckpt_path}", flush=True)
    return {"step": step, **meta}


# ---------------------------------------------------------------------------------------------
# export (gpt-oss HF layout, MXFP4 experts)


def expert_checkpoint_tensors(gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' in-memory experts (``x @ W``: ``[E, H, 2I]``, ``[E, I, H]``) -> released MXFP4
    tensors, stored ``[E, out, in]`` with 32-blocks along ``in``; gate/up rows stay interleaved."""
    gu_blocks, gu_scales = mxfp4_encode(gate_up_proj.detach().float().transpose(1, 2).contiguous())
    d_blocks, d_scales = mxfp4_encode(down_proj.detach().float().transpose(1, 2).contiguous())
    return {"gate_up_proj_blocks": gu_blocks, "gate_up_proj_scales": gu_scales,
            "down_proj_blocks": d_blocks, "down_proj_scales": d_scales}


@torch.no_grad()
def apply_mxfp4_roundtrip_(model: GptOssForCausalLM) -> GptOssForCausalLM:
    """Replace every expert weight by decode(encode(weight)), i.e. what the exported file holds."""
    for layer in model.model.layers:
        ex = layer.mlp.experts
        q = expert_checkpoint_tensors(ex.gate_up_proj, ex.down_proj)
        ex.gate_up_proj.copy_(mxfp4_decode(q["gate_up_proj_blocks"], q["gate_up_proj_scales"]).transpose(1, 2))
        ex.down_proj.copy_(mxfp4_decode(q["down_proj_blocks"], q["down_proj_scales"]).transpose(1, 2))
    return model


def export(model: GptOssForCausalLM, tokenizer_dir: Path, dest: Path) -> Path:
    """Write ``dest`` exactly like the released gpt-oss: HF config with an mxfp4 quantization_config,
    ``model.safetensors`` with MXFP4 expert blocks/scales (uint8) and everything else bf16,
    ``generation_config.json`` and the tokenizer files."""
    dest.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            continue
        tensors[name] = t.detach().to(torch.bfloat16).contiguous()
    for i, layer in enumerate(model.model.layers):
        q = expert_checkpoint_tensors(layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj)
        for k, v in q.items():
            tensors[f"model.layers.{i}.mlp.experts.{k}"] = v.contiguous()
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(dest / "model.safetensors", 0o644)  # save_file creates 0600; shipped package data must be world-readable

    full = model.config.to_dict()
    cfg = {k: full[k] for k in CONFIG_KEYS}
    rope = dict(full["rope_parameters"])
    cfg.update(dtype="bfloat16", use_cache=True, rope_theta=rope.pop("rope_theta"), rope_scaling=rope,
               experts_per_token=full["num_experts_per_tok"],
               initial_context_length=rope["original_max_position_embeddings"],
               quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": MODULES_NOT_CONVERTED})
    (dest / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    eos = model.config.eos_token_id
    (dest / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [eos], "pad_token_id": model.config.pad_token_id, "do_sample": False}, indent=2) + "\n")
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, dest / f.name)
    return dest


# ---------------------------------------------------------------------------------------------
# evaluate


def repetition(ids: list[int], text: str) -> dict[str, float]:
    """Degeneracy of one continuation.

    ``rep4``: fraction of the continuation's token 4-grams that already occurred earlier in it
    (1 - distinct/total; 0 for fresh text, ->1 for a loop). ``line_rep``: fraction of its non-blank
    lines (stripped) equal to an earlier non-blank line of it. Real code scores well above 0 on
    both (``self.x = x`` blocks, ``return``), so compare with the same metric on the true text.
    """
    grams = [tuple(ids[i : i + 4]) for i in range(len(ids) - 3)]
    rep4 = 1 - len(set(grams)) / len(grams) if grams else 0.0
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    seen, dup = set(), 0
    for line in lines:
        dup += line in seen
        seen.add(line)
    return {"rep4": rep4, "line_rep": dup / len(lines) if lines else 0.0}


@torch.no_grad()
def evaluate(model: GptOssForCausalLM, tokenizer, n_prompts: int = EVAL_PROMPTS,
             new_tokens: int = EVAL_NEW_TOKENS, show: int = 2) -> dict:
    """Held-out loss (fixed windows of SEQ_LEN and of LONG_SEQ_LEN) + repetition of greedy
    continuations of held-out prompts, next to the same metric on each prompt's true continuation."""
    held = np.asarray([t for text in corpus.iter_texts("heldout")
                       for t in [*tokenizer.encode(text), tokenizer.eos_token_id]], dtype=np.int64)
    losses = {f"heldout_loss_{t}": heldout_loss(model, held, t) for t in (SEQ_LEN, LONG_SEQ_LEN)}
    gen, ref, samples = [], [], []
    root = corpus.stdlib_root()
    for p in corpus.heldout_prompts()[:n_prompts]:
        prompt_ids = tokenizer.encode(p.text)
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        ids = out[0, len(prompt_ids):].tolist()
        text = tokenizer.decode(ids)
        gen.append(repetition(ids, text))
        lines = corpus.read_source(root / p.path).splitlines(keepends=True)
        true_ids = tokenizer.encode("".join(lines[p.line - 1:])[len(p.text):])[:new_tokens]
        ref.append(repetition(true_ids, tokenizer.decode(true_ids)))
        if len(samples) < show:
            samples.append({"prompt": p.text, "continuation": text})

    def mean(rows, k):
        return sum(r[k] for r in rows) / len(rows)

    return {**losses, "prompts": len(gen), "new_tokens": new_tokens,
            "rep4": mean(gen, "rep4"), "line_rep": mean(gen, "line_rep"),
            "reference_rep4": mean(ref, "rep4"), "reference_line_rep": mean(ref, "line_rep"),
            "samples": samples}


# ---------------------------------------------------------------------------------------------
# entry points


def main(argv: list[str] | None = None) -> None:
    """Train (or resume) the target; see the module docstring."""
    ap = argparse.ArgumentParser(prog="python -m trtllm_dflash.train.target", description=main.__doc__)
    ap.add_argument("--out", type=Path, required=True, help="run directory (checkpoint, metrics, data)")
    ap.add_argument("--tokenizer", type=Path, default=Path("runs/tokenizer"))
    ap.add_argument("--total-steps", type=int, default=6000, help="length of the whole lr schedule")
    ap.add_argument("--max-minutes", type=float, default=60.0, help="wall-clock budget of this invocation")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (1 on a shared machine)")
    ap.add_argument("--lr", type=float, default=LR)
    ap.add_argument("--eval-every", type=int, default=EVAL_EVERY)
    ap.add_argument("--save-minutes", type=float, default=SAVE_MINUTES)
    ap.add_argument("--corpus-version", type=int, choices=sorted(corpus.SKIP_DIRS_OF_VERSION), default=1,
                    help="training corpus (see trtllm_dflash.train.corpus); fixed when the run starts")
    ap.add_argument("--init-from", type=Path, help="start a new run from this checkpoint's weights (warm restart)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    train(args.out, args.tokenizer, args.total_steps, args.max_minutes, lr=args.lr,
          eval_every=args.eval_every, save_minutes=args.save_minutes, corpus_version=args.corpus_version,
          init_from=args.init_from)


def export_main(argv: list[str] | None = None) -> None:
    """Export a training checkpoint to the gpt-oss HF layout (MXFP4 experts) and report the
    held-out loss of the in-memory fp32 model next to the loss of the export as stored."""
    ap = argparse.ArgumentParser(prog="python -m trtllm_dflash.train.target export", description=export_main.__doc__)
    ap.add_argument("--ckpt", type=Path, required=True, help="ckpt.pt (latest) or best.pt of a run")
    ap.add_argument("--dest", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, ckpt = load_model_from_checkpoint(args.ckpt)
    run = args.ckpt.parent
    export(model, run / "tokenizer", args.dest)
    held = np.memmap(run / "heldout.bin", dtype=np.uint16, mode="r")
    before = heldout_loss(model, held)
    after = heldout_loss(load_hf_gpt_oss(args.dest), held)
    print(json.dumps({"step": ckpt["step"], "heldout_loss_fp32": before, "heldout_loss_exported_mxfp4": after,
                      "dest": str(args.dest)}))


def evaluate_main(argv: list[str] | None = None) -> None:
    """Held-out loss and greedy-continuation repetition of an exported target (JSON on stdout)."""
    ap = argparse.ArgumentParser(prog="python -m trtllm_dflash.train.target evaluate",
                                 description=evaluate_main.__doc__)
    ap.add_argument("--model", type=Path, required=True, help="exported HF directory")
    ap.add_argument("--prompts", type=int, default=EVAL_PROMPTS)
    ap.add_argument("--new-tokens", type=int, default=EVAL_NEW_TOKENS)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = evaluate(load_hf_gpt_oss(args.model), AutoTokenizer.from_pretrained(str(args.model)),
                      n_prompts=args.prompts, new_tokens=args.new_tokens)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    commands = {"export": export_main, "evaluate": evaluate_main}
    if len(sys.argv) > 1 and sys.argv[1] in commands:
        commands[sys.argv[1]](sys.argv[2:])
    else:
        main()
