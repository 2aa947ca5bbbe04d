"""Train the demo model's byte-level BPE tokenizer on generated task text and save it as a checkpoint's
tokenizer files (`tokenizer.json`, `tokenizer_config.json`, `generation_config.json`) for `HFTokenizer`.

Digits are pre-tokenized one per piece, so no merge ever joins two digits: arithmetic sees digit tokens.
Special tokens take ids 0..4 in `SPECIAL_TOKENS` order; the 256 byte symbols follow; then the merges.
Training is deterministic for a given corpus (the trainer breaks count ties by the pair itself).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from kestrel.tokenizer import BYTE_CHAT_TEMPLATE, BYTE_SPECIAL_TOKENS

SPECIAL_TOKENS = BYTE_SPECIAL_TOKENS  # <|bos|> <|eos|> <|pad|> <|im_start|> <|im_end|>
CHAT_TEMPLATE = BYTE_CHAT_TEMPLATE  # <|im_start|>role\n...<|im_end|>\n per message


def train_bpe(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2):
    """A `tokenizers.Tokenizer` trained on `texts`; `vocab_size` counts special tokens and the 256 bytes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size must be at least {len(SPECIAL_TOKENS) + 256}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        show_progress=False,
        special_tokens=[AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos = SPECIAL_TOKENS[0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    return tok


def save_tokenizer(tok, directory: str) -> None:
    """Write the three files `kestrel.tokenizer.HFTokenizer` (and transformers) read."""
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in SPECIAL_TOKENS}
    entry = lambda s: {"content": s, "special": True, "normalized": False, "lstrip": False, "rstrip": False}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {str(ids[s]): entry(s) for s in SPECIAL_TOKENS},
    }
    _write_json(os.path.join(directory, "tokenizer_config.json"), config)
    # A reply ends at <|im_end|>; plain text at <|eos|>. Other keys of an existing file are kept.
    gen_file = os.path.join(directory, "generation_config.json")
    gen = {}
    if os.path.isfile(gen_file):
        with open(gen_file, encoding="utf-8") as f:
            gen = json.load(f)
    _write_json(gen_file, {**gen, "eos_token_id": [ids["<|im_end|>"], ids["<|eos|>"]]})


def _write_json(file: str, data: dict) -> None:
    with open(file, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


def build_tokenizer(out_dir: str, vocab_size: int = 8192, seed: int = 0, num_docs: int = 20000):
    """Generate `num_docs` train conversations for `seed`, train the BPE on them, save it in `out_dir` and
    return it loaded as an `HFTokenizer`."""
    from kestrel.tokenizer import HFTokenizer
    from kestrel.train.data import corpus_texts

    save_tokenizer(train_bpe(corpus_texts(num_docs, seed), vocab_size), out_dir)
    return HFTokenizer(out_dir)
