"""Prompt logprobs (vLLM's `prompt_logprobs`, what `echo` with `logprobs` returns): each prompt token's logprob given
the tokens before it and the top k, against the model's own full forward, across chunked-prefill boundaries,
beside other requests in the same steps, and with the prompt already in the prefix cache (which such a request
must not use: its cached positions have no logits)."""

from __future__ import annotations

import pytest
import torch

from kestrel.config import EngineConfig
from kestrel.engine.engine import Engine
from kestrel.engine.sampling_params import SamplingParams
from kestrel.models.loader import build_model


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=7)


def _engine(model, **kw) -> Engine:
    return Engine(EngineConfig(model="tiny", page_size=4, max_running_requests=8, **kw), model=model)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(engine: Engine, jobs: dict) -> dict:
    """request id -> (tokens, prompt logprobs) for jobs {id: (prompt, params)} submitted together."""
    for rid, (prompt, params) in jobs.items():
        engine.add_request(prompt, params, rid)
    out = {rid: ([], None) for rid in jobs}
    while engine.has_unfinished():
        for o in engine.step():
            tokens, plp = out[o.request_id]
            if o.prompt_logprobs is not None:
                assert plp is None, "prompt logprobs twice"
                plp = o.prompt_logprobs
            out[o.request_id] = (tokens + o.new_token_ids, plp)
    return out


def _check(model, prompt: list[int], plp, k: int) -> None:
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor(prompt)).float(), -1)  # row p: the token after p
    assert len(plp) == len(prompt) and plp[0] is None
    for p, lp in enumerate(plp[1:], 1):
        row = ref[p - 1]
        assert lp.token_id == prompt[p]
        assert abs(lp.logprob - row[prompt[p]].item()) < 1e-3, p
        assert len(lp.top) == k
        kth = row.topk(k).values[-1].item() if k else None
        for token, value in lp.top:  # the top k by value (ties may order either way)
            assert abs(value - row[token].item()) < 1e-3 and value >= kth - 1e-3


@pytest.mark.parametrize("chunk", [8, 64], ids=["chunked", "whole"])
def test_prompt_logprobs_are_the_models(model, chunk):
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    asks = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    prompt, other = _prompt(30, 1), _prompt(21, 2)
    alone = _run(_engine(model, chunked_prefill_size=chunk), {"o": (other, greedy), "p": (prompt, greedy)})
    engine = _engine(model, chunked_prefill_size=chunk)
    _run(engine, {"warm": (prompt, greedy)})  # the prompt is in the prefix cache now
    out = _run(engine, {"o": (other, greedy), "p": (prompt, asks)})
    _check(model, prompt, out["p"][1], 3)
    assert out["o"] == (alone["o"][0], None)  # the request beside it: its tokens, no prompt logprobs
    assert out["p"][0] == alone["p"][0]  # asking for them changes no sampled token
    # preempted and computed again: recorded once; the cache serves the prompt once they are all known
    again = _run(engine, {"p": (prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))})
    _check(model, prompt, again["p"][1], 0)


def test_prompt_logprobs_of_a_one_token_prompt_and_the_offline_api(model):
    from kestrel.engine.llm import LLM

    out = _run(_engine(model), {"one": ([5], SamplingParams(max_tokens=1, prompt_logprobs=2))})
    assert out["one"][1] == [None]
    llm = LLM.__new__(LLM)  # the offline API over the engine above's model
    llm.engine, llm._calls = _engine(model), 0
    llm.tokenizer = llm.engine.tokenizer
    prompt = _prompt(12, 4)
    (res,) = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=1, n=2), use_tqdm=False)
    _check(model, prompt, res.prompt_logprobs, 1)
    (res,) = llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert res.prompt_logprobs is None
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the prefill and decode kernels")
def test_prompt_logprobs_on_cuda_are_decodes(tmp_path):
    """On CUDA, the shipped model in bf16: one prefill's prompt logprobs of prompt + greedy tokens against those
    tokens' logprobs as decode computed them (other kernels, so bf16-close, not equal: session 70 on an H100,
    at most 0.023 apart over 8 tokens)."""
    from kestrel import LLM
    from kestrel.presets import shipped_model_dir

    if shipped_model_dir() is None:
        pytest.skip("no shipped model in this tree")
    llm = LLM(None, device="cuda", max_model_len=4096, kv_cache_bytes=2**30)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    (out,) = llm.generate(["Question: what is 17 + 25?\nAnswer:"], greedy, use_tqdm=False)
    gen, n = out.outputs[0], len(out.prompt_token_ids)
    (res,) = llm.generate(
        [out.prompt_token_ids + gen.token_ids], SamplingParams(max_tokens=1, prompt_logprobs=2)
    )
    got = res.prompt_logprobs[n:]
    assert [lp.token_id for lp in got] == gen.token_ids
    assert [lp.top[0][0] for lp in got] == gen.token_ids  # greedy's tokens are the top ones
    assert max(abs(a.logprob - b.logprob) for a, b in zip(got, gen.logprobs)) < 0.1
