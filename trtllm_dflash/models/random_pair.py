"""Small random gpt-oss targets and DFlash drafters, for tests and benchmarks.

Random weights make acceptance meaningless (the embedded pair is trained for that); they are for
exercising loading, validation, losslessness and bookkeeping at any shape.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import GptOssConfig, GptOssForCausalLM

from .drafter import DFlashDrafter, save_drafter
from .drafter_config import DFlashConfig


def tiny_target_config(vocab_size: int = 258, hidden_size: int = 64, num_layers: int = 4, heads: int = 4,
                       kv_heads: int = 2, head_dim: int = 16, experts: int = 4, top_k: int = 2,
                       intermediate_size: int = 64, sliding_window: int = 8, eos_token_id: int = 256,
                       initializer_range: float = 0.02) -> GptOssConfig:
    return GptOssConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        num_local_experts=experts, num_experts_per_tok=top_k, intermediate_size=intermediate_size,
        sliding_window=sliding_window, layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                                    for i in range(num_layers)],
        max_position_embeddings=4096, initializer_range=initializer_range,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 128, "rope_theta": 150000.0},
        eos_token_id=eos_token_id, pad_token_id=eos_token_id, tie_word_embeddings=False,
        architectures=["GptOssForCausalLM"],
    )


def random_target(config: GptOssConfig, seed: int = 0) -> GptOssForCausalLM:
    torch.manual_seed(seed)
    return GptOssForCausalLM(config).eval()


def save_random_target(directory: str | Path, config: GptOssConfig, seed: int = 0) -> Path:
    """HF layout with plain (unquantized) fp32 experts, plus generation_config.json."""
    directory = Path(directory)
    random_target(config, seed).save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [config.eos_token_id]}))
    return directory


def drafter_config_for(target: GptOssConfig, num_layers: int = 1, block_size: int = 4,
                       target_layer_ids: list[int] | None = None, mask_token_id: int | None = None,
                       intermediate_size: int | None = None) -> DFlashConfig:
    rope = dict(target.rope_parameters)
    return DFlashConfig(
        hidden_size=target.hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=target.num_attention_heads, num_key_value_heads=target.num_key_value_heads,
        head_dim=target.head_dim, intermediate_size=intermediate_size or 2 * target.hidden_size,
        block_size=block_size, mask_token_id=target.vocab_size - 1 if mask_token_id is None else mask_token_id,
        target_layer_ids=target_layer_ids or [1, target.num_hidden_layers - 2],
        num_target_layers=target.num_hidden_layers, rms_norm_eps=1e-5, rope_theta=rope.pop("rope_theta"),
        rope_scaling=rope if rope.get("rope_type", "default") != "default" else None, attention_bias=True,
        max_position_embeddings=target.max_position_embeddings, vocab_size=target.vocab_size,
    )


def random_drafter(config: DFlashConfig, seed: int = 0, std: float = 0.05) -> DFlashDrafter:
    torch.manual_seed(seed)
    model = DFlashDrafter(config)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            continue
        torch.nn.init.normal_(param, std=std)
    return model.eval()


def save_random_drafter(directory: str | Path, config: DFlashConfig, seed: int = 0) -> Path:
    return save_drafter(random_drafter(config, seed), directory)


def save_byte_tokenizer(directory: str | Path, eos: str = "<|endoftext|>", mask: str = "<|mask|>") -> Path:
    """A byte-level tokenizer without merges: ids 0..255 are bytes, then EOS (256) and mask (257)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(byte_level_chars())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([eos, mask])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos, pad_token=eos)
    fast.save_pretrained(directory)
    return Path(directory)


def byte_level_chars() -> list[str]:
    """GPT-2's byte -> printable character map, in byte order (byte b has id b)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def main() -> None:
    """`python -m trtllm_dflash.models.random_pair DIR`: write DIR/target (with a byte tokenizer) and
    DIR/drafter, a random pair for trying the tools on any machine (acceptance is meaningless)."""
    import sys

    root = Path(sys.argv[1] if len(sys.argv) > 1 else "random_pair")
    config = tiny_target_config()
    save_random_target(root / "target", config)
    save_byte_tokenizer(root / "target")
    save_random_drafter(root / "drafter", drafter_config_for(config))
    print(f"wrote {root / 'target'} and {root / 'drafter'}")


if __name__ == "__main__":
    main()
