"""Training data: task generators, verifiers, held-out split, chat rendering, packing and the BPE tokenizer."""

import dataclasses
import json
import multiprocessing
import multiprocessing.pool
import os
import random
import re
import threading
import time

import pytest
import torch

from kestrel.tokenizer import ByteTokenizer, HFTokenizer
from kestrel.train.bpe import SPECIAL_TOKENS, build_tokenizer, save_tokenizer, train_bpe
from kestrel.train.chat_format import assistant_text, end_of_turn_id, prompt_ids, render
from kestrel.train.data import (
    DEFAULT_WEIGHTS,
    Mixture,
    MixtureConfig,
    PackedBatches,
    Prefetch,
    corpus_texts,
    heldout_examples,
    split_seed,
    write_corpus,
)
from kestrel.train.family import HELDOUT_SEED_OFFSET, Example
from kestrel.train.tasks import FAMILIES, extract_answer, make_family, verify
from kestrel.utils.errors import ConfigError

ARITHMETIC = ["chain_sum", "basic_arithmetic", "gsm_symbolic", "countdown"]
SMALL_RETRIEVAL = dict(context_tokens=256)


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("bpe"))
    build_tokenizer(directory, vocab_size=1024, seed=0, num_docs=300)
    return directory


@pytest.fixture(scope="module")
def bpe(bpe_dir):
    return HFTokenizer(bpe_dir)


def _generate(name, seed, index, level=None):
    return make_family(name, level).generate(seed, index, **(SMALL_RETRIEVAL if name == "retrieval" else {}))


def _wrong(ex: Example) -> str:
    if ex.family == "countdown":
        return ex.answer + " + 1"  # uses a number that is not given
    return f"{float(ex.answer) + 1:g}"


# ---- generators and verifiers -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_generators_are_deterministic(name):
    first = [_generate(name, 3, i) for i in range(6)]
    assert first == [_generate(name, 3, i) for i in range(6)]  # fresh family objects, same examples
    assert len({e.prompt for e in first}) > 1  # another index gives another problem
    other_seed = [_generate(name, 4, i) for i in range(6)]
    assert [e.prompt for e in first] != [e.prompt for e in other_seed]
    assert all(e.family == name and e.meta["family"] == name and e.meta["answer"] == e.answer for e in first)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_reference_answers_pass_their_verifier(name):
    fam = make_family(name)
    for i in range(50):
        ex = fam.generate(0, i, **(SMALL_RETRIEVAL if name == "retrieval" else {}))
        completion = f"{ex.reasoning}\nAnswer: {ex.answer}"
        assert verify(ex, completion), (ex.prompt, completion)
        assert verify(json.loads(json.dumps(ex.meta)), completion)  # meta alone suffices, after a JSON trip
        assert not verify(ex, f"{ex.reasoning}\nAnswer: {_wrong(ex)}"), ex
        assert not verify(ex, ex.reasoning)  # no answer line


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_level_generates_and_verifies(name):
    for level in FAMILIES[name].LEVELS:
        for i in range(5):
            ex = _generate(name, 1, i, level)
            assert ex.meta["level"] == level
            assert verify(ex, f"{ex.reasoning}\nAnswer: {ex.answer}")


def test_unknown_family_and_level():
    with pytest.raises(ValueError, match="unknown task family"):
        make_family("sudoku")
    with pytest.raises(ValueError, match="unknown level"):
        make_family("chain_sum", "medium")


def test_answer_extraction():
    assert extract_answer("steps\nAnswer: 12\nmore\nAnswer:  -7  \n") == "-7"
    assert extract_answer("The Answer: 3") is None  # must start a line
    assert extract_answer("no answer") is None
    ex = _generate("chain_sum", 0, 0)
    assert verify(ex, f"Answer: {_wrong(ex)}\n{ex.reasoning}\nAnswer: {ex.answer}")  # the last one counts
    assert not verify(ex, "Answer:")


def test_chain_sum_steps_are_running_sums():
    for i in range(20):
        ex = _generate("chain_sum", 0, i)
        lines = ex.reasoning.splitlines()
        terms = ex.meta["expression"].split()
        assert len(lines) == len(terms) // 2
        for line, prev in zip(lines[1:], lines):
            assert line.split(" ")[0] == prev.split(" = ")[1]
        assert lines[-1].split(" = ")[1] == ex.answer


def test_basic_arithmetic_uses_operator_precedence():
    seen_precedence = False
    for i in range(100):
        ex = _generate("basic_arithmetic", 0, i, "medium")
        assert int(ex.answer) == eval(ex.meta["expression"])
        terms = ex.meta["expression"].split()
        seen_precedence |= "*" in terms[3:] and terms[1] != "*"
        assert ex.reasoning.splitlines()[-1].endswith(f"= {ex.answer}")
    assert seen_precedence


def test_gsm_symbolic_numbers_are_clean():
    for i in range(100):
        ex = _generate("gsm_symbolic", 0, i)
        assert not re.search(r"\d\.\d{4,}", ex.prompt + ex.reasoning), ex
        assert str(int(ex.answer)) == ex.answer and "####" not in ex.reasoning


def test_countdown_steps_reach_the_target():
    for i in range(20):
        ex = _generate("countdown", 0, i)
        assert ex.reasoning.splitlines()[-1].endswith(f"= {ex.meta['target']}")
        assert "Final answer format" not in ex.prompt


@pytest.mark.parametrize("level", ["easy", "medium", "hard"])
def test_countdown_problems_are_reasoning_gyms(level):
    """The integer search (`tasks._fast_countdown`) gives reasoning-gym's own item for every seed: the same
    numbers, target, printed expression and prompt, divisions and their fallbacks included."""
    from kestrel.train.tasks import Countdown, _countdown_entry, _reasoning_gym

    settings, divisions = Countdown.LEVELS[level], 0
    for seed in range(0, 60 * 7919, 7919):
        want = _reasoning_gym().create_dataset("countdown", size=1, seed=seed, **settings)[0]
        assert _countdown_entry(seed, **settings) == want, seed
        divisions += "/" in want["answer"]
    assert divisions >= 3  # the seeds reach the divisor search (6-15 of 60 a level)


# ---- retrieval ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("context_tokens", [512, 2048, 8192, 32768])
def test_retrieval_length_and_key_fact(bpe, context_tokens):
    fam = make_family("retrieval", tokenizer=bpe)
    for i in range(3 if context_tokens < 8192 else 1):
        ex = fam.generate(0, i, context_tokens=context_tokens)
        n = len(bpe.encode(ex.prompt))
        assert abs(n - context_tokens) <= 0.05 * context_tokens, (n, context_tokens)
        name = ex.meta["name"]
        assert ex.prompt.count(f"The code of {name} is ") == 1
        assert f"The code of {name} is {ex.answer}." in ex.prompt
        assert ex.prompt.endswith(f"Question: What is the code of {name}?")
        assert 2 <= ex.prompt.count("The code of ") <= 4  # the key fact and 1-3 distractors
        assert len(ex.answer) == 5 and ex.answer.isdigit()


def test_retrieval_without_tokenizer_counts_characters():
    fam = make_family("retrieval")
    ex = fam.generate(0, 0, context_tokens=2048)
    assert abs(len(ex.prompt) / fam.CHARS_PER_TOKEN - 2048) < 0.05 * 2048


def test_retrieval_hard_distractors_share_a_name_part():
    for i in range(10):
        ex = _generate("retrieval", 0, i, "hard")
        first, last = ex.meta["name"].split()
        facts = [s for s in ex.prompt.replace("\n", " ").split(". ") if "The code of " in s]
        others = [f.split("The code of ")[1].split(" is ")[0] for f in facts if ex.meta["name"] not in f]
        assert len(others) == 3
        assert all((o.split()[0] == first) != (o.split()[1] == last) for o in others)


def _codes(ex: Example) -> tuple[str, list[str]]:
    """The asked code and the distractors' codes of a retrieval prompt."""
    codes = re.findall(r"The code of [^.]*? is (\d+)\.", ex.prompt)
    return ex.answer, [c for c in codes if c != ex.answer]


def test_retrieval_shared_prefix_distractors():
    """shared_prefix=1: every problem has a distractor whose code starts with exactly the asked code's first 1-4
    digits; 0 (the default) changes nothing, so held-out sets stay as they were."""
    shared = make_family("retrieval", shared_prefix=1.0)
    plain, default = make_family("retrieval", shared_prefix=0.0), make_family("retrieval")
    lengths = set()
    for i in range(40):
        ex = shared.generate(0, i, **SMALL_RETRIEVAL)
        answer, others = _codes(ex)
        assert len(set(others)) == len(others) and all(len(o) == 5 for o in others)
        prefix = max(len(os.path.commonprefix([answer, o])) for o in others)
        assert 1 <= prefix <= 4, (answer, others)
        lengths.add(prefix)
        assert verify(ex, f"Answer: {answer}")
        a, b = plain.generate(0, i, **SMALL_RETRIEVAL), default.generate(0, i, **SMALL_RETRIEVAL)
        assert a.prompt == b.prompt and a.answer == b.answer
    assert lengths == {1, 2, 3, 4}
    with pytest.raises(ValueError, match="shared_prefix"):
        make_family("retrieval", shared_prefix=1.5)


def test_retrieval_shared_all_distractors():
    """shared_all: a shared-prefix problem gives every distractor a code starting with 1-4 of the asked code's
    digits (so the digit after the asked code's first is ambiguous by the previous digit alone); without it,
    the stream is the one shared_prefix alone draws."""
    every = make_family("retrieval", shared_prefix=1.0, shared_all=True, distractors=(3, 6))
    one = make_family("retrieval", shared_prefix=1.0, distractors=(3, 6))
    for i in range(30):
        ex = every.generate(0, i, **SMALL_RETRIEVAL)
        answer, others = _codes(ex)
        assert 3 <= len(others) <= 6 and len(set(others + [answer])) == len(others) + 1
        assert all(1 <= len(os.path.commonprefix([answer, o])) <= 4 for o in others), (answer, others)
        assert verify(ex, f"Answer: {answer}")
    singles = [_codes(one.generate(0, i, **SMALL_RETRIEVAL)) for i in range(30)]
    assert any(sum(o[0] == a[0] for o in others) < len(others) for a, others in singles)


def test_retrieval_shared_all_with_many_distractors_does_not_hang():
    """Only 9 codes share the asked code's first 4 digits: with 32 distractors, the tenth to draw 4 looked for a
    free code forever (`kestrel train --retrieval-distractors 32,32 --retrieval-shared-prefix 1
    --retrieval-shared-all` never made its first batch). It shares 3 digits instead."""
    from kestrel.train.retrieval import _code_sharing_prefix

    codes = [12345] + [12340, 12341, 12342, 12343, 12344, 12346, 12347, 12348, 12349]  # every 4-digit sharer
    code = _code_sharing_prefix(random.Random(0), codes, 4)
    assert len(os.path.commonprefix(["12345", str(code)])) == 3 and code not in codes
    many = make_family("retrieval", shared_prefix=1.0, shared_all=True, distractors=(32, 32))
    for i in range(40):
        answer, others = _codes(many.generate(0, i, **SMALL_RETRIEVAL))
        assert len(others) == 32 and len(set(others + [answer])) == 33
        assert all(1 <= len(os.path.commonprefix([answer, o])) <= 4 for o in others), (answer, others)


def test_retrieval_distractor_count_override():
    """distractors=(lo, hi) sets how many other people's facts a problem has, drawn over the whole range; the
    default is the level's; a range outside 1..MAX_DISTRACTORS is refused."""
    many = make_family("retrieval", distractors=(4, 8))
    counts = set()
    for i in range(40):
        ex = many.generate(0, i, **SMALL_RETRIEVAL)
        answer, others = _codes(ex)
        assert 4 <= len(others) <= 8 and len(set(others)) == len(others)
        assert ex.prompt.count("The code of ") == len(others) + 1  # the facts
        assert verify(ex, f"Answer: {answer}")
        counts.add(len(others))
    assert counts == {4, 5, 6, 7, 8}
    assert all(1 <= len(_codes(_generate("retrieval", 0, i))[1]) <= 3 for i in range(20))
    for bad in [(0, 2), (3, 2), (1, 33)]:
        with pytest.raises(ValueError, match="distractors"):
            make_family("retrieval", distractors=bad)


def test_retrieval_filler_differs_between_examples():
    a, b = _generate("retrieval", 0, 0), _generate("retrieval", 0, 1)
    assert a.prompt.split("\n\n")[1][:80] != b.prompt.split("\n\n")[1][:80]


# ---- held-out split ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ARITHMETIC)
def test_heldout_prompts_never_appear_in_train(name):
    level = "easy"  # the smallest problem spaces, where repeats are likeliest
    fam = make_family(name, level)
    n = 300
    train = {fam.generate(split_seed(0, "train"), i).prompt for i in range(n)}
    heldout = [e.prompt for e in heldout_examples(name, n, seed=0, level=level)]
    assert not train & set(heldout)
    assert len(set(heldout)) > n // 4  # a real sample, not one repeated problem


@pytest.mark.parametrize(
    "fields,words",
    [
        (
            dict(weights={"chain_sum": float("inf"), "countdown": 1.0}),
            "weights['chain_sum'] must be a finite",
        ),
        (
            dict(weights={"chain_sum": 1.0, "countdown": float("nan")}),
            "weights['countdown'] must be a finite",
        ),
        (dict(loss_weights={"chain_sum": -1.0}), "loss_weights['chain_sum'] must be a finite number >= 0"),
        (dict(loss_weights={"chain_sums": 2.0}), "loss_weights: unknown task family 'chain_sums'"),
        (dict(levels={"gsm": "easy"}), "levels: unknown task family 'gsm'"),
    ],
)
def test_mixture_numbers_and_names_that_mean_nothing_are_refused(fields, words):
    """Each was taken silently: an infinite weight drew the last family only, NaN dropped its family, a negative
    loss weight trained that family's loss up, and a misspelt family's level or loss weight was ignored."""
    with pytest.raises(ValueError, match=re.escape(words)):
        Mixture(MixtureConfig(**fields))


def test_mixture_heldout_disjoint_from_train():
    mixture = Mixture(MixtureConfig(retrieval_context_tokens=(256,)))
    n = 300
    train = list(mixture.examples(0, "train", 0, n))
    heldout = {e.prompt for e in mixture.examples(0, "heldout", 0, n)}
    assert not {e.prompt for e in train} & heldout
    assert {e.family for e in train} == set(FAMILIES)


def test_split_seed_bounds():
    assert split_seed(5, "heldout") == 5 + HELDOUT_SEED_OFFSET
    with pytest.raises(ValueError):
        split_seed(HELDOUT_SEED_OFFSET, "train")
    with pytest.raises(ValueError):
        split_seed(0, "test")


# ---- chat rendering ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_render_masks_the_assistant_turn(bpe, system):
    tok_eot = end_of_turn_id(bpe)
    for name in sorted(FAMILIES):
        ex = _generate(name, 0, 0)
        r = render(bpe, ex, system)
        prompt = prompt_ids(bpe, ex, system)
        assert r.ids[: len(prompt)] == prompt and r.num_prompt_tokens == len(prompt)
        assert r.loss_mask[len(prompt) :] == [1] * (len(r.ids) - len(prompt))
        # in the prompt only the trained tail (the retrieval question) is trained, and it spells that tail
        trained = [i for i, m in zip(prompt, r.loss_mask) if m]
        assert bpe.decode(trained, skip_special_tokens=False).strip() == ex.trained_prompt_tail
        assert bool(ex.trained_prompt_tail) == (name == "retrieval")
        where = [j for j in range(len(prompt)) if r.loss_mask[j]]
        assert where == list(range(where[0], where[-1] + 1)) if where else not ex.trained_prompt_tail
        assert not where or bpe.decode(prompt[where[-1] + 1 :], skip_special_tokens=False).startswith(
            "<|im_end|>"
        )
        assert r.ids[-1] == tok_eot
        reply = [i for i, m in zip(r.ids[len(prompt) :], r.loss_mask[len(prompt) :]) if m]
        assert bpe.decode(reply, skip_special_tokens=False) == assistant_text(ex) + "<|im_end|>"
        assert assistant_text(ex).endswith(f"\nAnswer: {ex.answer}")
        # the same ids as tokenizing the whole conversation at once
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": ex.prompt},
            {"role": "assistant", "content": assistant_text(ex)},
        ]
        full = bpe.apply_chat_template(messages, add_generation_prompt=False)
        assert bpe.encode(full) == r.ids + bpe.encode("\n")


def test_a_trained_prompt_tail_must_end_the_prompt():
    ex = _generate("retrieval", 0, 0)
    with pytest.raises(ValueError, match="not a tail"):
        dataclasses.replace(ex, trained_prompt_tail="Question: What is the code of nobody?")


def test_render_with_byte_tokenizer():
    tok = ByteTokenizer()
    ex = _generate("chain_sum", 0, 0)
    r = render(tok, ex)
    assert tok.decode(r.ids, skip_special_tokens=False).startswith("<|im_start|>user\n")
    assert sum(r.loss_mask) == len((assistant_text(ex)).encode()) + 1


# ---- packing ----------------------------------------------------------------------------------------------------


def _packer(tok, loss_weights=None, **kwargs):
    config = MixtureConfig(retrieval_context_tokens=(200, 300), loss_weights=loss_weights or {})
    return PackedBatches(tok, batch_size=3, seq_len=512, config=config, **kwargs)


def _segments(batch):
    cu = batch.cu_seqlens.tolist()
    return list(zip(cu[:-1], cu[1:]))


def test_packed_batches_shapes_masks_and_boundaries(bpe):
    eot, pad = end_of_turn_id(bpe), bpe.pad_token_id
    packer = _packer(bpe)
    for _ in range(3):
        b = next(packer)
        B, T = 3, 512
        for t in (b.input_ids, b.target_ids, b.loss_mask, b.valid_mask, b.position_ids):
            assert t.shape == (B, T)
        assert b.input_ids.dtype == torch.long and b.loss_mask.dtype == torch.bool
        assert b.cu_seqlens.dtype == torch.int32 and b.cu_seqlens[-1] == B * T
        cu = set(b.cu_seqlens.tolist())
        assert all(r * T in cu for r in range(B))  # no segment crosses a row
        keys = ("input_ids", "target_ids", "loss_mask", "valid_mask", "position_ids")
        flat = {k: getattr(b, k).flatten() for k in keys}
        docs = 0
        for s, e in _segments(b):
            assert (s // T) == ((e - 1) // T)
            assert flat["position_ids"][s:e].tolist() == list(range(e - s))
            ids, mask = flat["input_ids"][s:e], flat["loss_mask"][s:e]
            valid = flat["valid_mask"][s:e]
            assert not mask[-1] and not valid[-1]  # nothing is predicted across a document's end
            if ids[0] == pad:  # a row's padding tail
                assert (ids == pad).all() and not mask.any() and not valid.any()
                continue
            assert valid[:-1].all() and (mask <= valid).all()
            docs += 1
            assert ids[-1] == eot
            assert flat["target_ids"][s : e - 1].tolist() == ids[1:].tolist()
            text = bpe.decode(ids.tolist(), skip_special_tokens=False)
            assert text.startswith("<|im_start|>user\n")
            head, reply = text.split("<|im_start|>assistant\n")
            targets = flat["target_ids"][s:e][mask].tolist()
            assert bpe.decode(targets, skip_special_tokens=False) == reply  # masks cover the assistant only
            assert "\nAnswer: " in reply and reply.endswith("<|im_end|>")
        assert docs == b.num_documents and b.num_loss_tokens == int(b.loss_mask.sum())
        assert torch.equal(b.loss_weight, b.loss_mask.float())  # no family loss weights: the mask itself
        assert b.max_seqlen == max(e - s for s, e in _segments(b))
    assert packer.num_skipped == 0


def test_packed_batches_are_deterministic_and_resume(bpe):
    a = _packer(bpe)
    first = [next(a) for _ in range(2)]
    state = a.state_dict()
    following = next(a)
    b = _packer(bpe)
    assert all(torch.equal(x.input_ids, next(b).input_ids) for x in first)
    c = _packer(bpe)
    c.load_state_dict(state)
    assert torch.equal(next(c).input_ids, following.input_ids)
    held = _packer(bpe, split="heldout")
    assert not torch.equal(next(held).input_ids, first[0].input_ids)


def test_packing_rejects_rows_too_short_for_retrieval(bpe):
    with pytest.raises(ValueError, match="need rows of at least 2173 tokens"):
        PackedBatches(bpe, batch_size=1, seq_len=2048, config=MixtureConfig(retrieval_context_tokens=(2048,)))


def test_rows_shorter_than_every_document_are_an_error_not_a_hang(bpe):
    """`kestrel train --row-len 16`: every document was skipped as too long, and the packer looked for one that
    fits forever (the first step never came)."""
    config = MixtureConfig(weights={**DEFAULT_WEIGHTS, "retrieval": 0.0})
    packer = PackedBatches(bpe, batch_size=1, seq_len=16, config=config)
    with pytest.raises(
        ConfigError, match="rows of 16 tokens: the last 1000 documents .* raise the row length"
    ):
        next(packer)


def test_a_state_resumed_with_shorter_rows_skips_what_no_longer_fits(bpe):
    """A run resumed with a shorter --row-len restored its look-ahead buffer as saved: documents longer than the
    new rows were never packed nor counted, yet held a buffer slot each for good, and with the whole buffer too
    long every row was padding, for ever. They are skipped and counted as the stream skips any such document; the
    rest keep their order, and a state resumed at the same row length is unchanged."""
    config = MixtureConfig(weights={**DEFAULT_WEIGHTS, "retrieval": 0.0})
    saved = PackedBatches(bpe, batch_size=3, seq_len=512, config=config)
    next(saved), next(saved)
    state = saved.state_dict()
    lengths = {d.index: len(d.ids) for d in saved._buffer}
    row = sorted(lengths.values())[len(lengths) // 2]
    fits = [i for i in state["buffer"] if lengths[i] <= row]
    too_long = [i for i in state["buffer"] if lengths[i] > row]
    assert fits and too_long
    shorter = PackedBatches(bpe, batch_size=3, seq_len=row, config=config)
    shorter.load_state_dict(state)
    assert [d.index for d in shorter._buffer] == fits and shorter.num_skipped == len(too_long)
    same = PackedBatches(bpe, batch_size=3, seq_len=512, config=config)
    same.load_state_dict(state)
    assert same.state_dict() == state and same.num_skipped == 0
    full = PackedBatches(bpe, batch_size=3, seq_len=row, config=config, lookahead=len(too_long))
    full.load_state_dict({"next_index": state["next_index"], "buffer": too_long})
    assert next(full).num_documents > 0 and full.num_skipped >= len(too_long)


# ---- tokenizer ---------------------------------------------------------------------------------------------------


def test_bpe_loads_through_hf_tokenizer(bpe, bpe_dir):
    assert set(os.listdir(bpe_dir)) >= {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    ids = {s: bpe.encode(s)[0] for s in SPECIAL_TOKENS}
    assert set(bpe.eos_token_ids) == {ids["<|im_end|>"], ids["<|eos|>"]}
    assert bpe.bos_token_id == ids["<|bos|>"] and bpe.pad_token_id == ids["<|pad|>"]
    assert 300 < bpe.vocab_size <= 1024
    assert bpe.encode("hi", add_special_tokens=True)[0] == bpe.bos_token_id
    text = bpe.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}])
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
    assert bpe.encode(text).count(ids["<|im_start|>"]) == 3


@pytest.mark.parametrize(
    "text",
    [
        "",
        "State the final answer: 73 - 10 - 71 = -8",
        "  two  spaces\n\nand\ttabs ",
        "héllo wörld 😀 中文",
        "x=12345",
    ],
)
def test_bpe_round_trips(bpe, text):
    assert bpe.decode(bpe.encode(text)) == text


def test_bpe_splits_digits_one_per_token(bpe):
    ids = bpe.encode("The code of Anna Kolberg is 48213; 19 + 72 = 91, year 2024.")
    for i in ids:
        token = bpe.token_bytes(i).decode("utf-8", errors="replace")
        if any(c.isdigit() for c in token):
            assert len(token) == 1, token
    assert "".join(bpe.token_bytes(i).decode() for i in bpe.encode("48213")) == "48213"
    assert len(bpe.encode("48213")) == 5


def test_bpe_training_is_deterministic(tmp_path):
    texts = list(corpus_texts(120, seed=1))
    a, b = train_bpe(texts, vocab_size=600), train_bpe(texts, vocab_size=600)
    assert a.to_str() == b.to_str()
    save_tokenizer(a, str(tmp_path))
    assert (
        HFTokenizer(str(tmp_path)).encode("Answer: 42")
        == a.encode("Answer: 42", add_special_tokens=False).ids
    )


def test_write_corpus(tmp_path):
    path = str(tmp_path / "corpus.txt")
    write_corpus(path, 20, seed=0)
    text = open(path, encoding="utf-8").read()
    assert text.count("\nassistant\n") == 20 and text.count("\nAnswer: ") == 20
    assert "<|im_start|>" not in text


def test_family_loss_weights_scale_their_documents_loss_tokens_only(bpe):
    """MixtureConfig.loss_weights: a retrieval document's loss tokens weigh 4, every other loss token 1, off the
    mask 0; the documents drawn do not change."""
    plain, weighted = _packer(bpe), _packer(bpe, loss_weights={"retrieval": 4.0})
    seen = set()
    for _ in range(4):
        a, b = next(plain), next(weighted)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        flat_ids, flat_w = b.input_ids.flatten(), b.loss_weight.flatten()
        for s, e in _segments(b):
            if flat_ids[s] == bpe.pad_token_id:
                continue
            text = bpe.decode(flat_ids[s:e].tolist(), skip_special_tokens=False)
            want = 4.0 if "Question: What is the code of" in text else 1.0
            mask = b.loss_mask.flatten()[s:e]
            assert set(flat_w[s:e][mask].tolist()) == {want} and not flat_w[s:e][~mask].any()
            seen.add(want)
    assert seen == {1.0, 4.0}  # the stream had both kinds


def test_family_ids_name_each_documents_family_and_mark_padding(bpe):
    """Batch.family_ids: every token of a document carries its family's index in family_names (the retrieval
    documents are the ones that ask for a code), padding -1."""
    packer = _packer(bpe)
    retrieval = packer.family_names.index("retrieval")
    seen = set()
    for _ in range(4):
        batch = next(packer)
        flat_ids, flat_fam = batch.input_ids.flatten(), batch.family_ids.flatten()
        for s, e in _segments(batch):
            fams = set(flat_fam[s:e].tolist())
            if flat_ids[s] == bpe.pad_token_id:
                assert fams == {-1}
                continue
            assert len(fams) == 1 and 0 <= (fam := fams.pop()) < len(packer.family_names)
            text = bpe.decode(flat_ids[s:e].tolist(), skip_special_tokens=False)
            assert (fam == retrieval) == ("Question: What is the code of" in text)
            seen.add(fam)
    assert len(seen) >= 3  # the stream mixed families


def test_worker_processes_give_the_same_stream(bpe, bpe_dir):
    serial = _packer(bpe, loss_weights={"retrieval": 2.0})
    parallel = _packer(bpe_dir, loss_weights={"retrieval": 2.0}, num_workers=2)
    try:
        for _ in range(2):
            x, y = next(serial), next(parallel)
            assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_weight, y.loss_weight)
            assert torch.equal(x.family_ids, y.family_ids)
    finally:
        parallel.close()
    with pytest.raises(ValueError, match="path"):
        _packer(bpe, num_workers=2)


def test_close_kills_workers_when_terminate_hangs(bpe, monkeypatch):
    """close() gives Pool.terminate() `timeout` seconds, then kills the workers itself (a terminate that hung once
    under a loaded CPU would have held the trainer's exit, and the test suite, for good). The hang is made where
    terminate waits for the workers to let go of the task queue, after it has stopped the pool replacing them."""
    release = threading.Event()
    monkeypatch.setattr(
        multiprocessing.pool.Pool, "_help_stuff_finish", staticmethod(lambda *a: release.wait())
    )
    packer = _packer(bpe)
    pool = multiprocessing.get_context("spawn").Pool(2)
    workers = list(pool._pool)
    packer._pool = pool
    try:
        assert packer.close(timeout=0.5) is True
        assert packer._pool is None and not any(w.is_alive() for w in workers)
    finally:
        release.set()  # the hung terminate goes on to its end
    assert packer.close() is True  # nothing left to stop


def test_prefetch_gives_the_source_batches_in_order_with_the_state_after_each(bpe):
    """Prefetch runs ahead of its consumer, yet each state it hands out resumes the stream right after the batch
    it came with; an error of the source reaches the consumer; close() stops the thread."""
    direct = _packer(bpe)
    want = [(next(direct).input_ids, direct.state_dict()) for _ in range(5)]

    class Counting:  # the source, counting the batches the thread has begun
        def __init__(self, source):
            self.source, self.begun = source, 0

        def __next__(self):
            self.begun += 1
            return next(self.source)

        def state_dict(self):
            return self.source.state_dict()

    source = Counting(_packer(bpe))
    ahead = Prefetch(source, depth=2)
    deadline = time.monotonic() + 120
    while source.begun < 3:  # two batches waiting, the thread on the third
        assert time.monotonic() < deadline, "the prefetch thread made no third batch"
        time.sleep(0.01)
    got = [next(ahead) for _ in range(2)]
    assert ahead.close() and not ahead._thread.is_alive()
    for (batch, state), (ids, want_state) in zip(got, want):
        assert torch.equal(batch.input_ids, ids) and state == want_state
    assert 3 <= source.begun <= 5 and source.state_dict() == want[source.begun - 1][1]  # it ran ahead ...
    source.source.load_state_dict(got[-1][1])  # ... and the handed-out state resumes at the third batch
    assert torch.equal(next(source.source).input_ids, want[2][0])

    class Failing:
        def __next__(self):
            raise RuntimeError("renderer died")

    with pytest.raises(RuntimeError, match="renderer died"):
        next(Prefetch(Failing()))
    with pytest.raises(ValueError, match="depth"):
        Prefetch(source, depth=0)


def test_pack_rows_rejects_a_mask_of_another_length():
    from kestrel.train.data import Document, pack_rows

    with pytest.raises(ValueError, match="one entry per token"):
        pack_rows([[Document(0, [5, 6, 7], [0, 1])]], 8, pad_id=0)
