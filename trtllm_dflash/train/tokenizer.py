"""Byte-level BPE tokenizer for the embedded default pair, trained on the corpus train split.

Why these choices:

* **Byte-level** (GPT-2 style byte alphabet, no normalizer, no prefix space): every byte sequence
  encodes, and ``decode(encode(text)) == text`` exactly, which code needs (indentation, tabs,
  trailing spaces, non-ASCII literals).
* **VOCAB_SIZE = 4096** (including the specials): embedding + untied LM head cost 2·V·H parameters
  and the LM head is the largest matmul of a 1-layer drafter, so at hidden 256 a 4k vocabulary keeps
  them at ~2M parameters (about a quarter of the tiny target) while still merging common code
  pieces (indent runs, keywords, ``self.``) to about 3-4 characters per token. A much smaller
  vocabulary would make sequences longer (more forward passes per character); a much larger one
  would make the embedded models mostly embedding tables. It also fits a uint16 token memmap.
* **Specials**: ``<|endoftext|>`` (id 0; EOS, document separator and pad) and ``<|mask|>`` (id 1;
  the DFlash mask token). They are added as special tokens so they are single ids that ordinary
  text can never produce by merging.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from trtllm_dflash.train import corpus

VOCAB_SIZE = 4096
EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = [EOS_TOKEN, MASK_TOKEN]
MIN_FREQUENCY = 2


def train_bpe(texts: Iterable[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train the raw ``tokenizers`` byte-level BPE; specials get ids 0 and 1."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=MIN_FREQUENCY,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """transformers view of the tokenizer: EOS = pad = ``<|endoftext|>``, mask = ``<|mask|>``."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        mask_token=MASK_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=131072,
    )


def save(tok: Tokenizer, out: Path) -> PreTrainedTokenizerFast:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` (AutoTokenizer-loadable offline).

    transformers 5 records its generic class ``TokenizersBackend``; the config names
    ``PreTrainedTokenizerFast`` instead, which 5.x resolves to the same class and 4.x (as pinned by
    TensorRT-LLM releases) also knows.
    """
    hf = wrap(tok)
    hf.save_pretrained(str(out))
    config_path = Path(out) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return hf


def main() -> None:
    """Train on the corpus train split and save (``python -m trtllm_dflash.train.tokenizer --out runs/tokenizer``)."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--out", type=Path, default=Path("runs/tokenizer"))
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = ap.parse_args()
    tok = train_bpe(corpus.iter_texts("train"), args.vocab_size)
    hf = save(tok, args.out)
    sample = next(corpus.iter_texts("heldout"))
    print(f"vocab {len(hf)}  eos {hf.eos_token_id}  mask {hf.mask_token_id}  "
          f"held-out chars/token {len(sample) / len(hf.encode(sample)):.2f}  -> {args.out}")


if __name__ == "__main__":
    main()
