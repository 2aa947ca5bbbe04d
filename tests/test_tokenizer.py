"""Tokenizer tests: byte tokenizer, its HF twin, chat templates."""

import json
import os
import re

import pytest

from kestrel.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    load_tokenizer,
    save_byte_tokenizer,
)
from kestrel.utils.errors import ChatTemplateError, CheckpointError

TEXTS = [
    "",
    "hello world",
    "  leading and trailing  ",
    "tabs\tnewlines\n\r\nnull\x00del\x7f",
    "héllo wörld, ça va? ß",
    "中文字符和日本語のテキスト",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "<|im_start|>user\nhi<|im_end|>\n",
    "not special: <|bos| <|unknown|> <|eos|x",
    "<|bos|><|eos|><|pad|><|im_start|><|im_end|>",
]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi 😀"},
    {"role": "assistant", "content": "Hello!"},
]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("byte_tok"))
    save_byte_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def hf_tok(hf_dir):
    return HFTokenizer(hf_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    if "<|" not in text:
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids) == text


def test_byte_special_tokens():
    tok = ByteTokenizer()
    assert tok.vocab_size == 261
    assert (tok.bos_token_id, tok.pad_token_id, tok.eos_token_ids) == (256, 258, (257, 260))
    assert tok.encode("a<|eos|>b") == [97, 257, 98]
    assert tok.encode("a", add_special_tokens=True) == [256, 97]
    assert tok.decode([256, 104, 105, 257, 260]) == "hi"
    assert tok.decode([104, 260], skip_special_tokens=False) == "h<|im_end|>"
    assert tok.decode([104, 999, 105]) == "hi"  # ids past the vocabulary (padded embeddings) are skipped
    assert tok.decode([0xF0, 0x9F]) == "\ufffd"
    assert [tok.id_to_token(i) for i in (97, 32, 259, 261)] == ["a", "Ġ", "<|im_start|>", None]


def test_load_tokenizer(hf_dir):
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    assert isinstance(load_tokenizer(hf_dir), HFTokenizer)


def test_hf_twin_matches_byte_tokenizer(hf_tok):
    byte = ByteTokenizer()
    assert hf_tok.vocab_size == byte.vocab_size
    assert (hf_tok.bos_token_id, hf_tok.pad_token_id) == (byte.bos_token_id, byte.pad_token_id)
    assert hf_tok.eos_token_ids == byte.eos_token_ids
    for text in TEXTS:
        for add in (False, True):
            assert hf_tok.encode(text, add_special_tokens=add) == byte.encode(text, add_special_tokens=add)
        ids = byte.encode(text)
        for skip in (False, True):
            assert hf_tok.decode(ids, skip_special_tokens=skip) == byte.decode(ids, skip_special_tokens=skip)
    for broken in (b"\xe2\x82", b"\xf0\x80", b"\xff\xfe a \xc0\xaf", b"\xed\xa0\x80", b"\xe2<|eos|>"):
        ids = byte.encode(broken.decode("latin-1")) if b"<|" in broken else list(broken)
        assert hf_tok.decode(ids, skip_special_tokens=False) == byte.decode(ids, skip_special_tokens=False)
    assert [hf_tok.id_to_token(i) for i in range(262)] == [byte.id_to_token(i) for i in range(262)]


def test_chat_template(hf_tok):
    byte = ByteTokenizer()
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 😀<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
    )
    assert byte.apply_chat_template(CONVERSATION, add_generation_prompt=False) == expected
    assert byte.apply_chat_template(CONVERSATION) == expected + "<|im_start|>assistant\n"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert byte.apply_chat_template(parts) == "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"
    for messages in (CONVERSATION, parts):
        for gen in (False, True):
            assert hf_tok.apply_chat_template(messages, gen) == byte.apply_chat_template(messages, gen)
    ids = byte.encode(byte.apply_chat_template(CONVERSATION))
    assert ids[0] == 259 and ids.count(260) == 3


@pytest.mark.parametrize("tok", [ByteTokenizer(), "hf"])
def test_continue_final_message_leaves_the_last_message_open(tok, hf_tok):
    """vLLM's continue_final_message: the text ends with the last message's content, no end of turn after it, for
    the model to go on with (a reply's start given by the client); empty content leaves the turn just opened."""
    tok = hf_tok if tok == "hf" else tok
    start = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 😀<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(CONVERSATION, False, continue_final_message=True) == start + "Hello!"
    empty = [*CONVERSATION[:-1], {"role": "assistant", "content": None}]
    assert tok.apply_chat_template(empty, False, continue_final_message=True) == start
    # without it the empty turn is closed and another opened
    assert tok.apply_chat_template(empty, True) == start + "<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="cannot both be true"):
        tok.apply_chat_template(CONVERSATION, True, continue_final_message=True)
    # add_generation_prompt unset: open unless continuing (as vLLM's server takes it)
    assert tok.apply_chat_template(CONVERSATION, continue_final_message=True) == start + "Hello!"


def test_continue_final_message_needs_a_template_that_keeps_the_content(tmp_path, hf_dir):
    """A template that changes the final message's content (here to upper case) cannot be continued: a clear
    error, not a prompt cut in the wrong place."""
    for name in ("tokenizer.json", "generation_config.json"):
        (tmp_path / name).write_bytes(open(os.path.join(hf_dir, name), "rb").read())
    templates = {
        "upper": "{{ m['content'] | upper }}",
        # what the review found passing the first check: a reasoning template that keeps what follows the thought
        "think": "{% if '</think>' in m['content'] %}{{ m['content'].split('</think>')[-1] }}"
        "{% else %}{{ m['content'] }}{% endif %}",
        "trim": "{{ m['content'] | trim }}",
    }
    final = {"upper": "Hello!", "think": "<think>ok</think>The answer", "trim": "  Sure, \n"}
    for name, body in templates.items():
        template = "{% for m in messages %}" + body + "<|im_end|>{% endfor %}"
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
        tok = HFTokenizer(str(tmp_path))
        messages = [*CONVERSATION[:-1], {"role": "assistant", "content": final[name]}]
        with pytest.raises(ChatTemplateError, match="cannot be continued"):
            tok.apply_chat_template(messages, False, continue_final_message=True)
        if name != "upper":  # a content these templates keep as it is
            plain = [*CONVERSATION[:-1], {"role": "assistant", "content": "go"}]
            assert tok.apply_chat_template(plain, False, continue_final_message=True).endswith("go")


@pytest.mark.parametrize("tok", [ByteTokenizer(), "hf"])
def test_chat_template_rejects_bad_messages(tok, hf_tok):
    tok = hf_tok if tok == "hf" else tok
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match="image_url"):
        tok.apply_chat_template(image)
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"content": "no role"}])
    with pytest.raises(ValueError, match="int"):
        tok.apply_chat_template([{"role": "user", "content": 3}])
    with pytest.raises(ValueError, match="string 'text'"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "text"}]}])
    with pytest.raises(ValueError, match="lone surrogate"):
        tok.encode("bad \ud800 text")


def test_hf_template_features(tmp_path, hf_dir):
    for name in ("tokenizer.json", "generation_config.json"):
        (tmp_path / name).write_bytes(open(os.path.join(hf_dir, name), "rb").read())
    template = (
        "{% for m in messages %}\n"
        "  {% if m['role'] == 'tool' %}\n"
        "{{ raise_exception('no tools here') }}\n"
        "  {% endif %}\n"
        "{{ bos_token }}{{ m['content'] | tojson }}{{ eos_token }}\n"
        "{% endfor %}"
    )
    config = {
        "bos_token": {"content": "<|bos|>"},
        "eos_token": "<|im_end|>",
        "chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": template}],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = HFTokenizer(str(tmp_path))
    assert tok.eos_token_ids == (260, 257)
    assert tok.apply_chat_template([{"role": "user", "content": "<é>"}]) == '<|bos|>"<é>"<|im_end|>\n'
    with pytest.raises(ValueError, match="no tools here"):
        tok.apply_chat_template([{"role": "tool", "content": ""}])


def test_transformers_agrees(hf_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(hf_dir)
    byte = ByteTokenizer()
    for text in TEXTS:
        assert hf.encode(text, add_special_tokens=False) == byte.encode(text)
        assert hf.decode(byte.encode(text), skip_special_tokens=True) == byte.decode(byte.encode(text))
    assert hf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True) == (
        byte.apply_chat_template(CONVERSATION)
    )


def test_checkpoint_errors(tmp_path, hf_dir):
    with pytest.raises(CheckpointError, match="not found"):
        load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(CheckpointError, match="tokenizer.json not found"):
        HFTokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        HFTokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_bytes(open(os.path.join(hf_dir, "tokenizer.json"), "rb").read())
    for bad in ("{oops", "[1, 2]"):
        (tmp_path / "tokenizer_config.json").write_text(bad)
        with pytest.raises(CheckpointError, match="tokenizer_config.json"):
            HFTokenizer(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(CheckpointError, match="not in the vocabulary"):
        HFTokenizer(str(tmp_path))
    mismatch = {"added_tokens_decoder": {"300": {"content": "<|eos|>", "special": True}}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(mismatch))
    with pytest.raises(CheckpointError, match="not id 300"):
        HFTokenizer(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no chat template"):
        HFTokenizer(str(tmp_path)).apply_chat_template(CONVERSATION)


@pytest.mark.parametrize(
    "field,value,words",
    [
        ("eos_token", 5, "eos_token 5 in"),  # each a TypeError or AttributeError traceback before
        ("bos_token", {"content": 1}, "bos_token 1 in"),
        ("added_tokens_decoder", "x", "added_tokens_decoder in"),
        ("added_tokens_decoder", {"x": {"content": "<|eos|>"}}, "added_tokens_decoder in"),
        ("added_tokens_decoder", {"257": "<|eos|>"}, "added_tokens_decoder in"),
        ("chat_template", 5, "chat_template: expected a string, got int"),
        ("chat_template", [1], "chat_template: expected a string or a list"),
        ("chat_template", [{"name": "default", "template": 2}], "chat_template: expected a string, got int"),
    ],
)
def test_tokenizer_config_fields_of_the_wrong_type_are_named(tmp_path, hf_dir, field, value, words):
    (tmp_path / "tokenizer.json").write_bytes(open(os.path.join(hf_dir, "tokenizer.json"), "rb").read())
    config = json.loads(open(os.path.join(hf_dir, "tokenizer_config.json")).read())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(CheckpointError, match=re.escape(words)):
        HFTokenizer(str(tmp_path))


def test_config_only_tokens_and_int_eos(tmp_path, hf_dir):
    (tmp_path / "tokenizer.json").write_bytes(open(os.path.join(hf_dir, "tokenizer.json"), "rb").read())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 260}))
    added = {"261": {"content": "<|tool|>", "special": True}, "262": {"content": "<think>", "special": False}}
    config = {"eos_token": "<|eos|>", "added_tokens_decoder": added}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = HFTokenizer(str(tmp_path))
    assert tok.vocab_size == 263 and tok.eos_token_ids == (257, 260)
    assert tok.bos_token_id is None and tok.pad_token_id is None
    assert tok.encode("a<|tool|><think>") == [97, 261, 262]
    assert tok.decode([97, 261, 262]) == "a<think>"


@pytest.mark.parametrize("eos", [10**9, -1, "a", [True], [257, "x"], {"id": 257}])
def test_eos_ids_of_generation_config_that_are_not_token_ids_are_refused(tmp_path, hf_dir, eos):
    """An id past the vocabulary loaded, and a request with min_tokens then failed mid-step (the sampler bans the
    EOS ids by indexing the logits with them); a string or a bool was an EOS no token matched."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes(open(os.path.join(hf_dir, name), "rb").read())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    with pytest.raises(
        CheckpointError, match=r"eos_token_id .*/generation_config.json: expected token ids in \[0, 261\)"
    ):
        HFTokenizer(str(tmp_path))


def test_a_checkpoint_without_its_tokenizer_is_refused(tmp_path):
    """A checkpoint folder without tokenizer.json whose vocabulary is larger than the byte tokenizer's would
    decode its ids as garbage: a ConfigError naming the folder. One whose vocabulary fits takes the byte one."""
    import json

    from kestrel.tokenizer import ByteTokenizer, tokenizer_for
    from kestrel.utils.errors import ConfigError

    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "kimi_k3", "text_config": {"vocab_size": 5120}})
    )
    with pytest.raises(ConfigError, match="has no tokenizer.json, and its vocabulary \\(5120 ids\\)"):
        tokenizer_for(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 261}))
    assert isinstance(tokenizer_for(str(tmp_path)), ByteTokenizer)


def test_hf_tokenizer_lets_other_threads_run_while_it_works():
    """A server tokenizes a long prompt in a worker thread: tokenizers' plain `encode` / `decode` hold the GIL
    throughout (a 20 MB prompt froze the event loop, /health and every stream for 14 s), its batch forms release
    it. A second thread counts its wake-ups while the shipped tokenizer encodes, then decodes, 2 MB: none at all
    while the GIL is held."""
    import threading

    from kestrel.presets import shipped_model_dir

    tok = HFTokenizer(str(shipped_model_dir()))
    text = "word " * 400_000
    ids = tok.encode(text)

    def wakeups_during(work) -> int:
        ticks, done = [0], threading.Event()

        def count():
            while not done.is_set():
                ticks[0] += 1
                done.wait(0.0005)

        worker = threading.Thread(target=count)
        worker.start()
        try:
            work()
            return ticks[0]
        finally:
            done.set()
            worker.join()

    assert wakeups_during(lambda: tok.encode(text)) >= 10
    assert wakeups_during(lambda: tok.decode(ids)) >= 10


@pytest.mark.parametrize("tok", [ByteTokenizer(), "hf"])
def test_a_chat_template_given_at_start_replaces_the_tokenizers_own(tok, hf_tok, tmp_path):
    """vLLM's --chat-template: a Jinja template (inline, or a file) used instead of the tokenizer's own, with its
    bos/eos texts; a value that is neither a file nor a template, and a template that cannot render, are clear
    errors at start."""
    from kestrel.chat_template import read_chat_template, use_chat_template
    from kestrel.utils.errors import ConfigError

    tok = hf_tok if tok == "hf" else ByteTokenizer()  # a fresh byte tokenizer: the template is set on it
    template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    template += "{% if add_generation_prompt %}[assistant] {% endif %}"
    file = tmp_path / "t.jinja"
    file.write_text(template)
    assert read_chat_template(str(file)) == read_chat_template(template) == template
    own = tok.apply_chat_template(CONVERSATION)
    use_chat_template(tok, str(file))
    try:
        got = tok.apply_chat_template(CONVERSATION[:2])
        assert got == "<|bos|>[system] Be brief.\n[user] Hi 😀\n[assistant] " != own
        go_on = [*CONVERSATION[:2], {"role": "assistant", "content": "Sure"}]
        assert tok.apply_chat_template(go_on, False, continue_final_message=True).endswith("[assistant] Sure")
    finally:
        tok._custom_template = None  # the module's hf tokenizer is shared
    with pytest.raises(ConfigError, match="not a readable file"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ConfigError, match="does not render"):
        use_chat_template(ByteTokenizer(), "{{ raise_exception('no') }}")
    with pytest.raises(CheckpointError, match="does not compile"):
        use_chat_template(ByteTokenizer(), "{% for %}")


def test_token_bytes_of_a_sentencepiece_vocabulary(tmp_path):
    """A Llama-style vocabulary (Metaspace, byte fallback): U+2581 is a space, <0xHH> pieces are their byte, and
    a non-ASCII piece its UTF-8 (the byte-level reading had given b"\\xe9" for "é"); the special ids are known."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from kestrel.tokenizer import HFTokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{i:02X}>": 3 + i for i in range(256)}}
    for piece in ["\u2581", "\u2581hello", "hello", "é"]:
        vocab[piece] = len(vocab)
    tok = RustTokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    hf = HFTokenizer(str(tmp_path))
    got = {
        piece: hf.token_bytes(vocab[piece]) for piece in ["\u2581hello", "\u2581", "<0x0A>", "<0xC3>", "é"]
    }
    assert got == {
        "\u2581hello": b" hello",
        "\u2581": b" ",
        "<0x0A>": b"\n",
        "<0xC3>": b"\xc3",
        "é": b"\xc3\xa9",
    }
    assert {1, 2} <= set(hf.special_token_ids())


def test_a_template_filter_given_what_it_cannot_take_is_a_template_error():
    """`tojson` of an undefined field raises TypeError inside Jinja: a ChatTemplateError (a 400), not a 500."""
    tok = ByteTokenizer()
    tok.set_chat_template("{{ tools[0].function.description | tojson }}")
    with pytest.raises(ChatTemplateError, match="chat template error"):
        tok.apply_chat_template(
            [{"role": "user", "content": "x"}], tools=[{"type": "function", "function": {}}]
        )


def test_chat_template_kwargs_reach_the_template(hf_tok):
    """vLLM's chat_template_kwargs: more variables for the template (`enable_thinking`, as Qwen 3's reads), on
    the tokenizer's own template and on one given at start; those the renderer sets itself are refused."""
    template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if enable_thinking %}<think>{% endif %}"
    )
    for tok in (ByteTokenizer(), hf_tok):
        tok.set_chat_template(template)
        try:
            chat = [{"role": "user", "content": "Hi"}]
            assert tok.apply_chat_template(chat) == "Hi"
            assert (
                tok.apply_chat_template(chat, chat_template_kwargs={"enable_thinking": True}) == "Hi<think>"
            )
            go_on = [*chat, {"role": "assistant", "content": "So"}]
            kw = {"continue_final_message": True, "chat_template_kwargs": {"enable_thinking": False}}
            assert tok.apply_chat_template(go_on, False, **kw) == "HiSo"
            # a name of Jinja's render() itself is a variable like any other
            assert (
                tok.apply_chat_template(chat, chat_template_kwargs={"self": 1, "enable_thinking": 1})
                == "Hi<think>"
            )
            for key in ("messages", "add_generation_prompt", "bos_token"):
                with pytest.raises(ValueError, match=f"chat_template_kwargs.{key} cannot be given"):
                    tok.apply_chat_template(chat, chat_template_kwargs={key: 1})
        finally:
            tok._custom_template = None
