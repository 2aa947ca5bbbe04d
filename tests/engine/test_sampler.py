"""The sampler given the logits' argmax from the runner's decode graph: greedy rows take it only where nothing
changed their logits (no penalty, no early-stop ban); sampled rows are drawn from the logits either way. The
penalties' counts built on the device equal the reference's from the full token lists."""

from __future__ import annotations

import pytest
import torch

from kestrel.engine.engine import RequestError
from kestrel.engine.request import Request
from kestrel.engine.sampler import Sampler
from kestrel.engine.sampling_params import SamplingParams

V = 16


def _req(**params) -> Request:
    return Request("r", [3, 4], SamplingParams(**params), seed=5, max_total_tokens=64)


def _logits() -> torch.Tensor:
    x = torch.zeros(3, V)
    x[:, 7] = 5.0  # every row's argmax is 7, but for the given one below
    return x


def test_greedy_rows_take_the_given_argmax():
    """A given argmax that is not the logits' own (a stand-in, to see which one is taken) goes to the greedy
    rows; the sampled row is drawn from the logits as without it."""
    sampler = Sampler(eos_token_ids=(1,))
    reqs = [_req(temperature=0), _req(temperature=1.0, top_k=1), _req(temperature=0)]
    given = torch.tensor([9, 9, 9])
    assert sampler.tokens(_logits(), reqs, argmax=given).tolist() == [9, 7, 9]
    assert sampler.tokens(_logits(), reqs).tolist() == [7, 7, 7]
    assert sampler(_logits(), reqs, argmax=given)[0] == [9, 7, 9]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_changed_logits_ignore_the_given_argmax(dtype):
    """A penalty or an early-stop ban on any row changes the logits the argmax was taken from: every row's
    greedy token is then the changed logits' own. In the model's dtype too (the runner hands bf16 logits)."""
    sampler = Sampler(eos_token_ids=(7,))
    given = torch.tensor([9, 9, 9])
    banned = [_req(temperature=0), _req(temperature=0, min_tokens=2), _req(temperature=0)]
    got = sampler.tokens(_logits().to(dtype), banned, argmax=given).tolist()
    assert got[0] == got[2] == 7 and got[1] != 7  # only the second row bans the EOS (7)
    penalized = [_req(temperature=0), _req(temperature=0, presence_penalty=1.0), _req(temperature=0)]
    assert sampler.tokens(_logits().to(dtype), penalized, argmax=given).tolist() == [7, 7, 7]
    sampled = [
        _req(temperature=0.5, seed=1, min_tokens=3),
        _req(temperature=0, logprobs=2),
        _req(temperature=0),
    ]
    tokens, logprobs = sampler(_logits().to(dtype), sampled, argmax=given)
    assert tokens[0] != 7 and tokens[1:] == [7, 7] and logprobs[1].token_id == 7 and logprobs[0] is None


@pytest.mark.parametrize("dense_max_rows", [16, 0])
def test_penalties_count_prompts_outputs_and_the_pending_tokens(monkeypatch, dense_max_rows):
    """The penalties' counts and seen tokens, built on the device (each prompt uploaded once and kept, the outputs
    in one copy, the pending tokens of a step in flight added): the reference formula on counts built by hand from
    the full token lists, over steps in a row, with a request leaving and a new one taking its row. Over [B, V]
    (a few rows) and at the seen tokens only (PENALTIES_DENSE_MAX_ROWS 0: many rows' form), the same values."""
    from kestrel.engine import sampler as sampler_module
    from kestrel.ops.sampling.naive import apply_penalties

    monkeypatch.setattr(sampler_module, "PENALTIES_DENSE_MAX_ROWS", dense_max_rows)
    sampler = Sampler(eos_token_ids=(1,))
    g = torch.Generator().manual_seed(0)
    params = dict(temperature=0, frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.4)
    reqs = [
        Request("a", [3, 4, 4], SamplingParams(**params), seed=1, max_total_tokens=64),
        Request("b", [5], SamplingParams(**params), seed=2, max_total_tokens=64),
    ]
    reqs[0].output_ids = [4, 9]

    def want(x, reqs, pending):
        counts, seen = torch.zeros(len(reqs), V), torch.zeros(len(reqs), V, dtype=torch.bool)
        for i, r in enumerate(reqs):
            outs = r.output_ids + ([pending[i]] if pending is not None else [])
            for t in outs:
                counts[i, t] += 1
            seen[i, r.prompt_ids + outs] = True
        f = lambda k: torch.tensor([getattr(r.params, k) for r in reqs])  # noqa: E731
        return apply_penalties(
            x, counts, seen, f("repetition_penalty"), f("frequency_penalty"), f("presence_penalty")
        )

    for step, pending in enumerate([None, [9, 5], [2, 5]]):
        if step == 2:  # "b" leaves; a new request, same id, another prompt of the same length, takes its row
            reqs[1] = Request("b", [6], SamplingParams(**params), seed=3, max_total_tokens=64)
        x = torch.randn(2, V, generator=g) * 3
        p = None if pending is None else torch.tensor(pending)
        torch.testing.assert_close(sampler._penalize(x, reqs, p), want(x, reqs, pending), rtol=0, atol=0)
        reqs[0].output_ids.append(7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_graphs_hand_on_their_logits_argmax():
    """tiny on CUDA with decode graphs, greedy and seeded requests together: every decode step's forward hands
    on the argmax of the logits it returns, and the overlap schedule (which samples from it ahead) gives the
    plain schedule's tokens."""
    from kestrel.config import EngineConfig
    from kestrel.engine.engine import Engine
    from kestrel.models.loader import build_model
    from tests.engine.test_engine import _prompt, _run

    net = build_model("tiny", dtype=torch.bfloat16, device="cuda", seed=3)
    jobs = {
        f"r{i}": (_prompt(20 + i, i), SamplingParams(temperature=0.7 * (i % 2), seed=i, max_tokens=24))
        for i in range(5)
    }
    tokens = {}
    for overlap in (True, False):
        config = EngineConfig(
            model="tiny", page_size=4, max_running_requests=8, disable_overlap_schedule=not overlap
        )
        engine = Engine(config, model=net)
        checked = []
        forward = engine.runner.forward

        def counted(batch, decode_ids=None, forward=forward, engine=engine, checked=checked):
            logits = forward(batch, decode_ids)
            if engine.runner.argmax is not None:
                checked.append(torch.equal(engine.runner.argmax, logits.argmax(-1)))
            return logits

        engine.runner.forward = counted
        tokens[overlap] = _run(engine, jobs)[0]
        assert len(checked) > 10 and all(checked), (overlap, checked)
    assert tokens[True] == tokens[False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_many_rows_take_the_seen_tokens_penalties_and_the_triton_argmax(monkeypatch):
    """Past PENALTIES_DENSE_MAX_ROWS rows on CUDA, penalized, steered (logit_bias, allowed_token_ids) and
    early-stop-banned logits go through the penalties at the seen tokens and the Triton argmax: the CPU's tokens
    (torch's argmax), and the dense form's on CUDA."""
    from kestrel.engine import sampler as sampler_module

    g = torch.Generator().manual_seed(2)
    W = 3000
    reqs = []
    for i in range(sampler_module.PENALTIES_DENSE_MAX_ROWS + 5):
        params = dict(temperature=0, min_tokens=3 if i % 7 == 0 else 0)
        if i % 3:
            params |= dict(frequency_penalty=0.8, presence_penalty=0.5, repetition_penalty=1.5)
        if i % 4 == 1:  # steered rows too: logit_bias, allowed_token_ids
            params |= dict(logit_bias={t: float(t % 7) - 3 for t in range(i, W, 97)})
        if i % 5 == 2:
            params |= dict(allowed_token_ids=list(range(i, W, 13)))
        r = Request(f"r{i}", torch.randint(0, W, (40,), generator=g).tolist(), SamplingParams(**params), seed=i,
                    max_total_tokens=128)  # fmt: skip
        r.output_ids = torch.randint(0, W, (5,), generator=g).tolist()
        reqs.append(r)
    logits = (torch.randn(len(reqs), W, generator=g) * 2).to(torch.bfloat16)
    for r in reqs[::2]:  # each row's best logit among its seen tokens, for the penalties to decide
        logits[reqs.index(r), r.output_ids[0]] = 9.0
    want = Sampler(eos_token_ids=(1,)).tokens(logits, reqs)
    got = Sampler(eos_token_ids=(1,)).tokens(logits.cuda(), reqs)
    assert got.tolist() == want.tolist()
    monkeypatch.setattr(sampler_module, "PENALTIES_DENSE_MAX_ROWS", len(reqs))
    assert Sampler(eos_token_ids=(1,)).tokens(logits.cuda(), reqs).tolist() == want.tolist()


def test_sampling_params_bounds_and_child_seeds():
    """Values the device cannot take are refused when the request is made; the samples of a seeded n > 1 request
    take mixed seeds, in int64, the first the request's own."""
    from kestrel.engine.sampling_params import INT64_MAX, INT64_MIN, child_seed

    for bad in (
        dict(seed=2**63),
        dict(seed=INT64_MIN - 1),
        dict(top_k=2**31),
        dict(stop_token_ids=[2**31]),
        dict(temperature=float("inf")),
        dict(temperature=float("nan")),
        dict(min_tokens=5, max_tokens=2),
        dict(stop=[str(i) for i in range(65)]),
        dict(stop=["x" * 1025]),
        dict(stop_token_ids=list(range(1025))),
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert len(SamplingParams(stop=[str(i) for i in range(63)] + ["x" * 1024]).stop) == 64  # the limits taken
    assert len(SamplingParams(stop_token_ids=list(range(1024))).stop_token_ids) == 1024
    assert SamplingParams(temperature=1e-40).greedy and not SamplingParams(temperature=1e-5).greedy
    for seed in (INT64_MAX, INT64_MIN, 0, 42):
        kids = SamplingParams(n=4, seed=seed).children()
        assert [k.n for k in kids] == [1] * 4 and kids[0].seed == seed
        assert len({k.seed for k in kids}) == 4 and all(INT64_MIN <= k.seed <= INT64_MAX for k in kids)
    assert {child_seed(42, j) for j in range(4)}.isdisjoint({child_seed(43, j) for j in range(1, 4)} | {43})
    assert [k.seed for k in SamplingParams(n=2).children()] == [None, None]


def test_a_failed_generate_leaves_the_llm_usable():
    """A bad prompt in one LLM.generate call aborts that call's requests: the next call runs."""
    from kestrel.engine.llm import LLM

    llm = LLM("tiny", device="cpu", max_model_len=64)
    with pytest.raises(RequestError):
        llm.generate(["Hello", list(range(100))], SamplingParams(max_tokens=2), use_tqdm=False)
    (out,) = llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2 and not llm.engine.requests


def test_logit_bias_and_allowed_tokens_steer_every_kind_of_row():
    """OpenAI's logit_bias is added to the logits (before the penalties, as vLLM; in fp32: a bias of 0.04 lifts a
    bf16 logit a step below another past it); vLLM's allowed_token_ids leaves only those tokens, greedy or sampled;
    the given argmax is then not taken; the logprobs stay the model's (vLLM's default)."""
    sampler = Sampler(eos_token_ids=(1,))
    given = torch.tensor([9, 9, 9])
    x = _logits()
    # 4.96875 in bf16, a step below 7's 5.0: plus 0.04 in bf16 ties with it (and 7 comes first)
    x[:, 12] = 4.97
    reqs = [
        _req(temperature=0, logit_bias={12: 0.04}),
        _req(temperature=0),
        _req(temperature=0, logit_bias={7: -100}),
    ]
    assert sampler.tokens(x, reqs, argmax=given).tolist() == [12, 7, 12]
    assert sampler.tokens(x.to(torch.bfloat16), reqs, argmax=given).tolist() == [12, 7, 12]
    # before the penalties, as vLLM: 7 (an output, 5.0) biased by 5 and divided by the repetition penalty 2 is 5.0,
    # below 12's 6.0 (the penalty first, then the bias: 7.5)
    x[:, 12] = 6.0
    out = _req(temperature=0, repetition_penalty=2.0, logit_bias={7: 5.0})
    out.output_ids = [7]
    assert sampler.tokens(x[:1], [out]).tolist() == [12]
    allowed = [
        _req(temperature=0, allowed_token_ids=[2, 12]),
        _req(temperature=1.0, allowed_token_ids=[12, 2, 12]),
        _req(temperature=0, allowed_token_ids=[5], logit_bias={5: -100, 6: 100}),
    ]
    assert allowed[1].params.allowed_token_ids == [2, 12]  # sorted, once each
    x[:, 12] = 1.0
    tokens, logprobs = sampler(x, allowed, argmax=given)
    assert tokens[0] == 12 and tokens[1] in (2, 12) and tokens[2] == 5
    drawn = set()
    for seed in range(40):
        params = SamplingParams(temperature=2.0, allowed_token_ids=[2, 12], logprobs=1)
        row = [Request("r", [3, 4], params, seed=seed, max_total_tokens=64)]
        t, lp = sampler(x[:1], row)
        drawn.add(t[0])
        assert lp[0].logprob == pytest.approx(torch.log_softmax(x[0], -1)[t[0]].item())  # the model's
    assert drawn == {2, 12}


def test_steering_of_many_rows_over_steps_equals_the_reference():
    """The sampler's steering (each request's ids and values kept on the device while it is in the rows, what a
    batch of rows needs kept while the rows stay) against `steer_logits` on the pairs listed by hand, over steps
    in which requests leave and new ones take their rows."""
    from kestrel.ops.sampling.naive import steer_logits

    g = torch.Generator().manual_seed(0)
    W = 50

    def make(i):
        params = {"temperature": 0}
        if i % 2 == 0:
            ids = torch.randperm(W, generator=g)[: 1 + i % 5].tolist()
            params["logit_bias"] = {t: float(torch.randn((), generator=g) * 3) for t in ids}
        if i % 3 == 0:
            params["allowed_token_ids"] = torch.randperm(W, generator=g)[: 2 + i % 7].tolist()
        return Request(f"r{i}", [1], SamplingParams(**params), seed=i, max_total_tokens=64)

    def reference(x, reqs):
        br, bc, bv, ar, ac = [], [], [], [], []
        for i, r in enumerate(reqs):
            for t, v in (r.params.logit_bias or {}).items():
                br, bc, bv = br + [i], bc + [t], bv + [v]
            for t in r.params.allowed_token_ids or []:
                ar, ac = ar + [i], ac + [t]
        restricted = torch.tensor([r.params.allowed_token_ids is not None for r in reqs])
        T = lambda v, dt=torch.int64: torch.tensor(v, dtype=dt)  # noqa: E731
        return steer_logits(x, T(br), T(bc), T(bv, torch.float32), restricted, T(ar), T(ac))

    sampler = Sampler(eos_token_ids=())
    reqs = [make(i) for i in range(7)]
    for step in range(6):
        x = torch.randn(len(reqs), W, generator=g)
        want = reference(x, reqs)
        got = sampler._steer(x, reqs)
        assert torch.equal(got, want), step
        again = torch.randn(
            len(reqs), W, generator=g
        )  # the same rows: what they need is kept, not made again
        kept = sampler._steer_batch
        assert (
            torch.equal(sampler._steer(again, reqs), reference(again, reqs)) and sampler._steer_batch is kept
        )
        assert sampler.tokens(x, reqs).tolist() == want.argmax(-1).tolist()
        steered = {id(r) for r in reqs if r.params.logit_bias or r.params.allowed_token_ids}
        assert set(sampler._steering) == steered
        reqs[step % len(reqs)] = make(7 + step)  # one leaves, a new one takes its row
    sampler.tokens(x, [make(1)])  # no steered row: nothing kept
    assert sampler._steering == {}


def test_logit_bias_and_allowed_tokens_are_checked():
    """Keys and values SamplingParams cannot take, and the engine's vocabulary (every prompt checked before it
    is queued): each a clear error naming its field."""
    from kestrel.engine.llm import LLM

    for bad, says in (
        (dict(logit_bias={3: 101}), "logit_bias values"),
        (dict(logit_bias={3: float("nan")}), "logit_bias values"),
        (dict(logit_bias={-1: 1.0}), "logit_bias keys"),
        (dict(logit_bias={"3": 1.0}), "logit_bias keys"),
        (dict(logit_bias=[3]), "logit_bias must be a mapping"),
        (dict(allowed_token_ids=[]), "allowed_token_ids must not be empty"),
        (dict(allowed_token_ids=[1.5]), "allowed_token_ids must be token ids"),
        (dict(allowed_token_ids=5), "allowed_token_ids must be a list"),
    ):
        with pytest.raises(ValueError, match=says):
            SamplingParams(**bad)
    assert SamplingParams(logit_bias={}).logit_bias is None  # asks for nothing
    # the samples of a request are copies, not validated again (128 of 262,144 allowed ids took 16 s), each with
    # the largest ids the engine checks against its vocabulary
    parent = SamplingParams(
        n=3, seed=1, logit_bias={9: 1.0, 4: -1.0}, allowed_token_ids=[7, 3], stop_token_ids=[2]
    )
    kids = parent.children()
    assert [k.n for k in kids] == [1, 1, 1] and len({k.seed for k in kids}) == 3 and parent.n == 3
    assert all(
        k.max_token_ids == {"stop_token_ids": 2, "logit_bias": 9, "allowed_token_ids": 7} for k in kids
    )
    assert SamplingParams(**vars(kids[1])) == kids[1]  # its fields alone: rebuilt from them, as a user may
    llm = LLM("tiny", device="cpu", max_model_len=64)
    vocab = llm.engine.model.config.vocab_size
    eos = llm.engine.eos_token_ids[0]
    for bad, field in (
        (dict(logit_bias={vocab: 1.0}), "logit_bias"),
        (dict(allowed_token_ids=[0, vocab]), "allowed_token_ids"),
        (dict(allowed_token_ids=[eos], min_tokens=1), "allowed_token_ids"),
    ):
        with pytest.raises(RequestError, match=field) as e:
            llm.generate(["Hello"], SamplingParams(max_tokens=2, **bad), use_tqdm=False)
        assert e.value.param == field
    (out,) = llm.generate(
        ["Hello"], SamplingParams(max_tokens=6, allowed_token_ids=[40, 41], ignore_eos=True), use_tqdm=False
    )
    assert set(out.outputs[0].token_ids) <= {40, 41} and len(out.outputs[0].token_ids) == 6
