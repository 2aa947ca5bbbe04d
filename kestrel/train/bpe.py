"""Train the demo model's byte-level BPE tokenizer on generated task text and save it as a checkpoint's
tokenizer files (`tokenizer.json`, `tokenizer_config.json`, `generation_config.json`) for `HFTokenizer`.

Digits are pre-tokenized one per piece, so no merge ever joins two digits: arithmetic sees digit tokens.
Special tokens take ids 0..4 in `SPECIAL_TOKENS` order; the 256 byte symbols follow; then the merges.
Training is deterministic for a given corpus (the trainer breaks count ties by the pair itself).
"""

from __future__ import annotations

from collections.abc import Iterable

from kestrel.tokenizer import BYTE_CHAT_TEMPLATE, BYTE_SPECIAL_TOKENS, save_tokenizer_files

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
    """Write the three files `kestrel.tokenizer.HFTokenizer` (and transformers) read; a reply ends at
    <|im_end|>, plain text at <|eos|>."""
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|eos|>")]
    save_tokenizer_files(tok, directory, CHAT_TEMPLATE, eos)


def build_tokenizer(out_dir: str, vocab_size: int = 8192, seed: int = 0, num_docs: int = 20000):
    """Generate `num_docs` train conversations for `seed`, train the BPE on them, save it in `out_dir` and
    return it loaded as an `HFTokenizer`."""
    from kestrel.tokenizer import HFTokenizer
    from kestrel.train.data import corpus_texts

    save_tokenizer(train_bpe(corpus_texts(num_docs, seed), vocab_size), out_dir)
    return HFTokenizer(out_dir)
