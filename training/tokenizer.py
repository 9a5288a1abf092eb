"""Byte-level BPE tokenizer for Python source, with the FIM special tokens at ids 0-4.

Byte-level means any text round-trips exactly (no unknown token, no normalisation), which a completion engine
needs: the prompt is the user's file verbatim.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
FIM_PREFIX = "<|fim_prefix|>"
FIM_SUFFIX = "<|fim_suffix|>"
FIM_MIDDLE = "<|fim_middle|>"
FILE_SEP = "<|file_sep|>"
SPECIAL_TOKENS = [EOS, FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE, FILE_SEP]  # ids 0..4, in this order


def train_tokenizer(texts, vocab_size: int = 8192) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def special_ids(tok: Tokenizer) -> dict[str, int]:
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def tokenizer_config(model_max_length: int) -> dict:
    """tokenizer_config.json: names the FIM tokens so a prompt builder need not guess them."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS,
        "pad_token": EOS,
        "bos_token": None,
        "unk_token": None,
        "fim_prefix_token": FIM_PREFIX,
        "fim_suffix_token": FIM_SUFFIX,
        "fim_middle_token": FIM_MIDDLE,
        "file_sep_token": FILE_SEP,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "fim_format": {
            "psm": f"{FIM_PREFIX}{{prefix}}{FIM_SUFFIX}{{suffix}}{FIM_MIDDLE}{{middle}}{EOS}",
            "spm": f"{FIM_SUFFIX}{{suffix}}{FIM_PREFIX}{{prefix}}{FIM_MIDDLE}{{middle}}{EOS}",
        },
    }


def save_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(model_max_length), indent=2) + "\n")
