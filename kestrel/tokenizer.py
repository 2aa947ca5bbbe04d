"""Tokenizers: the `Tokenizer` interface, a checkpoint's HF tokenizer, a built-in byte tokenizer for tests.
Streaming generated ids as text is `kestrel.detokenize`'s; rendering chats, `kestrel.chat_template`'s."""

from __future__ import annotations

import functools
import json
import os
import re
from abc import ABC, abstractmethod

from kestrel.chat_template import (
    check_template_kwargs,
    compile_template,
    continue_final,
    normalize_message,
    pick_template,
    render_template,
    template_tools,
)
from kestrel.utils.errors import CheckpointError, ConfigError

BYTE_SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>")  # ids 256..260
BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class Tokenizer(ABC):
    """What the rest of Kestrel needs from a tokenizer."""

    vocab_size: int  # including special tokens
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special-token strings in `text` become their ids; `add_special_tokens` adds e.g. a leading BOS."""

    @abstractmethod
    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Ids outside the vocabulary are skipped; invalid UTF-8 becomes U+FFFD."""

    @abstractmethod
    def id_to_token(self, i: int) -> str | None:
        """The vocabulary entry for id `i` (byte-level tokens are printable stand-ins), None if unknown."""

    @abstractmethod
    def _render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        tools: list | None = None,
        template_kwargs: dict | None = None,
    ) -> str: ...

    def special_token_ids(self) -> list[int]:
        """Ids of control tokens (BOS, EOS, chat markers), which never stand for text (a grammar allows none)."""
        return sorted(
            {*self.eos_token_ids, *(i for i in (self.bos_token_id, self.pad_token_id) if i is not None)}
        )

    _custom_template = None  # set_chat_template's, compiled

    def set_chat_template(self, source: str, origin: str = "chat_template") -> None:
        """Render chats with `source` (a Jinja chat template, as Hugging Face's; `serve --chat-template`) instead
        of the tokenizer's own; `origin` names it in errors."""
        self._custom_template = compile_template(source, origin)

    def _special_texts(self) -> dict:
        """The `bos_token` and `eos_token` a Jinja chat template reads."""
        return {"bos_token": "", "eos_token": ""}

    def _render(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        tools: list | None = None,
        template_kwargs: dict | None = None,
    ) -> str:
        if self._custom_template is None:
            return self._render_chat(messages, add_generation_prompt, tools, template_kwargs)
        return render_template(
            self._custom_template,
            messages,
            add_generation_prompt,
            self._special_texts(),
            tools,
            template_kwargs,
        )

    def token_bytes(self, i: int) -> bytes:
        """The bytes id `i` stands for: byte-level entries mapped back to raw bytes (a token may hold part of
        a UTF-8 character), other entries (special tokens, non-byte-level vocabularies) as their UTF-8 text."""
        token = self.id_to_token(i)
        if token is None:
            return b""
        inverse = _byte_level_inverse()
        if all(c in inverse for c in token):
            return bytes(inverse[c] for c in token)
        return self.decode([i], skip_special_tokens=False).encode("utf-8")

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool | None = None,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> str:
        """Render OpenAI-style messages; list content has its text parts joined with newlines.
        `add_generation_prompt`: the assistant's turn opened after them (None: unless continuing).
        `continue_final_message` (vLLM's): the text ends with the last message's content, left open (no end of
        turn after it), for the model to go on with it: a reply's start given by the client. `tools`: OpenAI's
        tool definitions, for templates that show them (a Jinja template's `tools`, as Hugging Face's).
        `chat_template_kwargs` (vLLM's): more variables for a Jinja template, such as `enable_thinking`; the names
        the template is given here (`messages`, `tools`, ...) are refused."""
        messages = [normalize_message(m) for m in messages]
        tools = template_tools(tools)
        kwargs = chat_template_kwargs
        check_template_kwargs(kwargs)
        if not continue_final_message:
            return self._render(messages, add_generation_prompt is not False, tools, kwargs)
        if add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return continue_final(lambda m: self._render(m, False, tools, kwargs), messages)


def _byte_level_alphabet() -> list[str]:
    """The printable character the ByteLevel pre-tokenizer uses for each byte value (index = byte).

    Printable Latin-1 bytes stand for themselves; the others get 256, 257, ... in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    alphabet, shifted = [], 256
    for b in range(256):
        if b in printable:
            alphabet.append(chr(b))
        else:
            alphabet.append(chr(shifted))
            shifted += 1
    return alphabet


@functools.cache
def _byte_level_inverse() -> dict[str, int]:
    return {c: b for b, c in enumerate(_byte_level_alphabet())}


class ByteTokenizer(Tokenizer):
    """Ids 0..255 are raw UTF-8 bytes, then five special tokens. For tests and tiny models."""

    def __init__(self):
        self.vocab_size = 256 + len(BYTE_SPECIAL_TOKENS)
        self.bos_token_id, self.pad_token_id = 256, 258
        self.eos_token_ids = (257, 260)
        self._special_ids = {s: 256 + i for i, s in enumerate(BYTE_SPECIAL_TOKENS)}
        self._special_pattern = re.compile("(" + "|".join(map(re.escape, BYTE_SPECIAL_TOKENS)) + ")")
        self._alphabet = _byte_level_alphabet()

    def _special_texts(self) -> dict:
        return {"bos_token": BYTE_SPECIAL_TOKENS[0], "eos_token": BYTE_SPECIAL_TOKENS[1]}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [self.bos_token_id] if add_special_tokens else []
        for i, piece in enumerate(self._special_pattern.split(text)):
            if i % 2:  # odd pieces are the captured special tokens
                ids.append(self._special_ids[piece])
            else:
                ids.extend(_utf8(piece))
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out, pending = [], bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                pending.append(i)
            elif 256 <= i < self.vocab_size and not skip_special_tokens:
                out.append(pending.decode("utf-8", errors="replace") + BYTE_SPECIAL_TOKENS[i - 256])
                pending.clear()
        return "".join(out) + pending.decode("utf-8", errors="replace")

    def special_token_ids(self) -> list[int]:
        return list(range(256, self.vocab_size))

    def id_to_token(self, i: int) -> str | None:
        if 0 <= i < 256:
            return self._alphabet[i]
        return BYTE_SPECIAL_TOKENS[i - 256] if 256 <= i < self.vocab_size else None

    def _render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        tools: list | None = None,
        template_kwargs: dict | None = None,
    ) -> str:
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def _utf8(text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text is not valid Unicode (lone surrogate at position {e.start})") from None


class HFTokenizer(Tokenizer):
    """A checkpoint folder's tokenizer.json, tokenizer_config.json and (optional) generation_config.json."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer as RustTokenizer

        if os.path.exists(path) and not os.path.isdir(path):
            raise CheckpointError(
                f"the tokenizer path {path} is a file; give the folder that holds tokenizer.json"
            )
        if not os.path.isdir(path):
            raise CheckpointError(f"tokenizer folder not found: {path}")
        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise CheckpointError(f"tokenizer.json not found in {path}")
        try:
            self._tok = RustTokenizer.from_file(file)
        except Exception as e:
            raise CheckpointError(f"cannot load {file}: {str(e).splitlines()[0]}") from None
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        self._check_added_tokens(config.get("added_tokens_decoder", {}), path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token, self.bos_token_id = self._special(config, "bos_token", path)
        self.eos_token, eos_id = self._special(config, "eos_token", path)
        _, self.pad_token_id = self._special(config, "pad_token", path)
        extra_eos = _read_json(os.path.join(path, "generation_config.json")).get("eos_token_id", [])
        extra_eos = [extra_eos] if isinstance(extra_eos, int) else extra_eos
        # ids the sampler indexes the logits with (min_tokens bans them): one past the vocabulary failed a request
        # mid-step (an IndexError; on CUDA a device assert), a string or a bool made no EOS
        if not isinstance(extra_eos, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.vocab_size for i in extra_eos
        ):
            raise CheckpointError(
                f"eos_token_id {extra_eos!r} in {path}/generation_config.json: expected token ids in "
                f"[0, {self.vocab_size}), the tokenizer's"
            )
        self.eos_token_ids = tuple(dict.fromkeys(([] if eos_id is None else [eos_id]) + list(extra_eos)))
        self._path = path
        self._template = compile_template(pick_template(config, path), path)
        # how a vocabulary entry spells its bytes: byte-level (GPT-2's printable stand-ins) or SentencePiece's
        # (U+2581 for a space, <0xHH> byte-fallback pieces); None: no decoder says (the byte-level guess)
        decoder = json.dumps(json.loads(self._tok.to_str()).get("decoder"))
        self._spelling = (
            "byte_level"
            if "ByteLevel" in decoder
            else "pieces"
            if "Metaspace" in decoder or ("ByteFallback" in decoder)
            else None
        )

    def _special(self, config: dict, key: str, path: str) -> tuple[str | None, int | None]:
        token = config.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        if token is None:
            return None, None
        if not isinstance(token, str):
            raise CheckpointError(
                f"{key} {token!r} in {path}/tokenizer_config.json: expected a token (a string)"
            )
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise CheckpointError(f"{key} {token!r} in {path}/tokenizer_config.json is not in the vocabulary")
        return token, token_id

    def _check_added_tokens(self, added: dict, path: str) -> None:
        """Add tokens that only tokenizer_config.json declares; every declared id must match."""
        from tokenizers import AddedToken

        ok = isinstance(added, dict) and all(
            k.isdigit() and isinstance(e, dict) and isinstance(e.get("content"), str)
            for k, e in added.items()
        )
        if not ok:
            raise CheckpointError(
                f"added_tokens_decoder in {path}/tokenizer_config.json: expected an object of token ids to "
                '{"content": "..."} entries'
            )
        for declared, entry in sorted(added.items(), key=lambda kv: int(kv[0])):
            content = entry["content"]
            if self._tok.token_to_id(content) is None:
                token = AddedToken(content, special=entry.get("special", False), normalized=False)
                (self._tok.add_special_tokens if token.special else self._tok.add_tokens)([token])
            if self._tok.token_to_id(content) != int(declared):
                raise CheckpointError(f"{path}: token {content!r} is not id {declared} in tokenizer.json")

    # Through the batch forms, one item each: tokenizers releases the GIL in those alone, so that a server's
    # worker thread encoding a 20 MB prompt (14 s) leaves its event loop and engine thread running (`encode` held
    # them the whole time); about 1 us more a call on short text.
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        try:
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except TypeError:
            _utf8(text)  # raises a clear ValueError for lone surrogates
            raise

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode_batch([[int(i) for i in ids]], skip_special_tokens=skip_special_tokens)[0]

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def token_bytes(self, i: int) -> bytes:
        if self._spelling != "pieces" or i in self._added_ids:
            return super().token_bytes(i)
        token = self.id_to_token(i)
        if token is None:
            return b""
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            try:
                return bytes([int(token[3:5], 16)])
            except ValueError:
                pass
        return token.replace("\u2581", " ").encode("utf-8")

    @functools.cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self._tok.get_added_tokens_decoder())

    def special_token_ids(self) -> list[int]:
        added = self._tok.get_added_tokens_decoder()
        return sorted({*super().special_token_ids(), *(i for i, t in added.items() if t.special)})

    def _special_texts(self) -> dict:
        return {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}

    def _render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        tools: list | None = None,
        template_kwargs: dict | None = None,
    ) -> str:
        if self._template is None:
            raise CheckpointError(
                f"the tokenizer in {self._path} has no chat template (serve --chat-template gives one)"
            )
        return render_template(
            self._template, messages, add_generation_prompt, self._special_texts(), tools, template_kwargs
        )


def _read_json(file: str) -> dict:
    """A JSON object from `file`, {} when the file does not exist."""
    if not os.path.isfile(file):
        return {}
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"malformed JSON in {file}: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"malformed JSON in {file}: expected an object")
    return data


def save_byte_tokenizer(directory: str) -> None:
    """Write tokenizer files that `HFTokenizer` and transformers load as an exact twin of `ByteTokenizer`."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as RustTokenizer

    # No merges, so every byte stays its own token; the vocabulary maps each byte's stand-in to the byte.
    vocab = {char: b for b, char in enumerate(_byte_level_alphabet())}
    tok = RustTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in BYTE_SPECIAL_TOKENS])
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A $B", special_tokens=[("<|bos|>", 256)]
    )
    save_tokenizer_files(tok, directory, BYTE_CHAT_TEMPLATE, list(ByteTokenizer().eos_token_ids))


def save_tokenizer_files(tok, directory: str, chat_template: str, eos_token_ids: list[int]) -> None:
    """Write a `tokenizers` tokenizer whose special tokens are BYTE_SPECIAL_TOKENS as the files `HFTokenizer` and
    transformers read: tokenizer.json, tokenizer_config.json (with `chat_template`), and generation_config.json,
    whose `eos_token_id` becomes `eos_token_ids` (<|im_end|> ends a turn too; other keys of the file are kept)."""
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
        "added_tokens_decoder": {str(tok.token_to_id(s)): _added_entry(s) for s in BYTE_SPECIAL_TOKENS},
    }
    _write_json(os.path.join(directory, "tokenizer_config.json"), config)
    gen_file = os.path.join(directory, "generation_config.json")
    _write_json(gen_file, {**_read_json(gen_file), "eos_token_id": eos_token_ids})


def _added_entry(content: str) -> dict:
    return {"content": content, "special": True, "normalized": False, "lstrip": False, "rstrip": False}


def _write_json(file: str, data: dict) -> None:
    with open(file, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)


def load_tokenizer(path: str | None) -> Tokenizer:
    """None or "byte" gives the built-in `ByteTokenizer`; anything else is a checkpoint folder."""
    if path is None or path == "byte":
        return ByteTokenizer()
    return HFTokenizer(path)


def checkpoint_tokenizer_dir(model: str):
    """The folder of a --model argument's own tokenizer.json (a checkpoint, `kestrel-demo` included), or None
    (a preset: random weights, no tokenizer of its own)."""
    from pathlib import Path

    from kestrel.presets import resolve_model

    path = Path(resolve_model(model))
    return path if (path / "tokenizer.json").is_file() else None


def tokenizer_for(model: str, tokenizer: str | None = None) -> Tokenizer:
    """The tokenizer of a --model argument: `tokenizer` when given, else the checkpoint folder's tokenizer.json,
    else (presets with random weights) the byte tokenizer."""
    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    own = checkpoint_tokenizer_dir(model)
    if own is not None:
        return load_tokenizer(str(own))
    _check_byte_tokenizer_fits(model)
    return ByteTokenizer()


def _check_byte_tokenizer_fits(model: str) -> None:
    """A checkpoint folder without tokenizer.json whose vocabulary is larger than the byte tokenizer's: a
    ConfigError (its ids would decode as garbage, silently)."""
    import json
    from pathlib import Path

    from kestrel.presets import resolve_model
    from kestrel.utils.errors import ConfigError

    config = Path(resolve_model(model)) / "config.json"
    try:
        hf = json.loads(config.read_text())
        vocab = hf.get("text_config", hf).get("vocab_size")  # (kimi_k3's layout nests the text model's)
    except (OSError, ValueError, AttributeError):
        return  # not a checkpoint folder (a preset), or one the loader reports on
    byte_vocab = ByteTokenizer().vocab_size
    if isinstance(vocab, int) and vocab > byte_vocab:
        raise ConfigError(
            f"{config.parent} has no tokenizer.json, and its vocabulary ({vocab} ids) is not the byte tokenizer's "
            f"({byte_vocab}): put the checkpoint's tokenizer.json there, or pass --tokenizer"
        )


def check_tokenizer_fits(tokenizer: Tokenizer, vocab_size: int) -> None:
    """A ConfigError where the tokenizer has ids past the model's vocabulary (its prompts would fail at the first
    request: most likely another model's tokenizer)."""
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} tokens, the model's vocabulary only {vocab_size}: "
            "a tokenizer of another model? (--tokenizer)"
        )
