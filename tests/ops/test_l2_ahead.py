"""kestrel.ops.l2_ahead (KESTREL_L2_AHEAD): decode steps of a few rows ask each layer's weights into L2 from a side
stream. On the CPU: what is asked, in which order, within which budget, and that nothing else changes (the model's
outputs, the engine's tokens); on CUDA: the kernel runs in and out of graphs and the tokens stay the same."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kestrel.engine import runner as runner_module
from kestrel.engine.sampling_params import SamplingParams
from kestrel.layers.context import ForwardContext, forward_context
from kestrel.models.kimi import KimiForCausalLM
from kestrel.models.loader import build_model, init_random_weights
from kestrel.ops import l2_ahead
from kestrel.presets import preset_config
from tests.engine.test_engine import _engine, _prompt, _run

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class Recorder:
    """Stands in for L2Ahead: records each ask (the tensors) and each join."""

    def __init__(self, device=None):
        self.log: list = []

    def ask(self, tensors):
        self.log.append(list(tensors))

    def join(self):
        self.log.append("join")


def test_segments_take_tensors_in_order_within_the_budget():
    a, b, c = (
        torch.zeros(1000, 8),
        torch.zeros(64, dtype=torch.bfloat16),
        torch.zeros(4096, dtype=torch.uint8),
    )
    segs = l2_ahead.segments([a, b, c], max_bytes=32000 + 128 + 100)
    # a whole (32000 B), b whole (128 B), c cut to the budget's rest rounded down to 16 (96 of 100)
    assert [n for _, n in segs] == [32000, 128, 96]
    assert all(v.dtype == torch.uint8 and v.dim() == 1 for v, _ in segs)
    assert segs[0][0].data_ptr() == a.data_ptr() and segs[0][0].numel() == 32000
    odd = torch.zeros(7, dtype=torch.uint8)  # 7 bytes: under the prefetch's 16-byte unit
    strided = torch.zeros(64, 64)[:, ::2]
    assert [n for _, n in l2_ahead.segments([odd, strided, a])] == [32000]  # neither asked for
    many = [torch.zeros(16, dtype=torch.uint8) for _ in range(l2_ahead.MAX_SEGMENTS + 3)]
    assert len(l2_ahead.segments(many)) == l2_ahead.MAX_SEGMENTS
    assert l2_ahead.segments([a], max_bytes=15) == []


def test_off_and_unsupported_devices(monkeypatch):
    """Off unless KESTREL_L2_AHEAD=on, and only on CUDA (where PDL, so sm_90, is on); a bad value is an error."""
    monkeypatch.delenv("KESTREL_L2_AHEAD", raising=False)
    assert not l2_ahead.supported(torch.device("cpu"))
    monkeypatch.setenv("KESTREL_L2_AHEAD", "on")
    assert not l2_ahead.supported(torch.device("cpu"))
    monkeypatch.setenv("KESTREL_L2_AHEAD", "sometimes")
    with pytest.raises(ValueError, match="KESTREL_L2_AHEAD"):
        l2_ahead.supported(torch.device("cpu"))


@pytest.mark.parametrize("attn_res", [True, False])
def test_model_asks_each_layers_weights_ahead_and_computes_the_same(monkeypatch, attn_res):
    """With an L2Ahead in the context: the first layer's attention weights first; then for each layer i its MLP
    weights (never the routed experts) before its attention, and layer i + 1's attention weights before its MLP;
    one join at the end. The logits are the same bits as without it. Both residual forms (AttnRes, pre-norm)."""
    monkeypatch.setattr(l2_ahead, "MIN_BYTES", 0)  # tiny's weights are all small: ask for every one
    config = preset_config("tiny")
    if not attn_res:
        config = dataclasses.replace(config, attn_res_block_size=None)
    model = KimiForCausalLM(config)
    init_random_weights(model, seed=1)
    ids = torch.randint(0, config.vocab_size, (5,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), forward_context(ForwardContext.build([5])):
        plain = model(ids)
    recorder = Recorder()
    ctx = ForwardContext.build([5])
    ctx.extras["l2_ahead"] = recorder
    with torch.no_grad(), forward_context(ctx):
        asked = model(ids)
    assert torch.equal(plain, asked)
    layers = model.model.layers
    want = [layers[0].weights_ahead()[0]]
    for i, layer in enumerate(layers):
        want.append(layer.weights_ahead()[1])
        if i + 1 < len(layers):
            want.append(layers[i + 1].weights_ahead()[0])
    want.append("join")
    got = recorder.log
    assert len(got) == len(want) and got[-1] == "join"
    for g, w in zip(got[:-1], want[:-1]):
        assert [id(t) for t in g] == [id(t) for t in w]
    attn, mlp = layers[1].weights_ahead()  # a MoE layer (tiny's first MLP is dense)
    names = {id(p): n for n, p in layers[1].named_parameters()}
    assert {names[id(p)].split(".")[0] for p in attn} == {"self_attn"}
    assert mlp and all(names[id(p)].startswith("mlp.") and ".experts." not in names[id(p)] for p in mlp)
    assert any(".experts." in n for n in names.values())  # the routed experts are there, and left out


def test_weights_ahead_skips_small_tensors():
    """At the default MIN_BYTES (64 KB) mini's norms, biases and gates' vectors are not asked for: a KDA layer
    asks its three projections, its MLP the router and the shared expert's two."""
    config = preset_config("mini")
    with torch.device("meta"):
        model = KimiForCausalLM(config, dtype=torch.bfloat16)
    attn, mlp = model.model.layers[0].weights_ahead()
    assert [tuple(p.shape) for p in attn] == [(4232, 2048), (1024, 128), (2048, 1024)]
    assert [tuple(p.shape) for p in mlp] == [(64, 2048), (512, 2048), (2048, 256)]


def test_runner_gives_decode_steps_of_few_rows_an_l2ahead(monkeypatch):
    """The runner puts its L2Ahead (one, made at the first such step) in the context of decode steps of at most
    MAX_ROWS rows where `supported`; the engine's greedy tokens are those of a run without it. (On the CPU
    `supported` is monkeypatched and the recorder stands in for the side stream.)"""
    monkeypatch.setattr(l2_ahead, "MIN_BYTES", 0)
    made = []

    def make(device):
        made.append(Recorder(device))
        return made[-1]

    def run(on: bool, n: int) -> dict:
        monkeypatch.setattr(runner_module, "l2_ahead_supported", lambda device: on)
        monkeypatch.setattr(runner_module, "L2Ahead", make)
        model = build_model("tiny", seed=5)
        engine = _engine(model, max_running_requests=24)
        greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        return _run(engine, {str(i): (_prompt(5 + i % 3, i), greedy) for i in range(n)})[0]

    for n in (3, l2_ahead.MAX_ROWS + 4):
        made.clear()
        assert run(True, n) == run(False, n)
        if n <= l2_ahead.MAX_ROWS:
            assert len(made) == 1 and made[0].log.count("join") >= 3  # one a decode step
        else:  # the decode steps all had more rows than MAX_ROWS
            assert not made


@cuda
def test_ask_runs_on_cuda_in_and_out_of_a_graph(monkeypatch):
    """The kernel asks (sm_90+: where PDL is on; elsewhere `supported` is False and nothing runs) and changes no
    byte; in a CUDA graph the side stream forks and joins."""
    monkeypatch.setenv("KESTREL_L2_AHEAD", "on")
    device = torch.device("cuda")
    if not l2_ahead.supported(device):
        pytest.skip("needs sm_90+ with PDL on")
    ws = [torch.randn(n, 2048, device=device, dtype=torch.bfloat16) for n in (4232, 7, 1024)]
    saved = [w.clone() for w in ws]
    ahead = l2_ahead.L2Ahead(device)
    for group in (
        ws,
        ws[:2],
        [ws[2]],
    ):  # eagerly, compiling each launch the graph takes (as capture_graphs warms up)
        ahead.ask(group)
    ahead.join()
    torch.cuda.synchronize()
    x = torch.randn(2048, device=device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ahead.ask(ws[:2])
        y = x * 2
        ahead.ask([ws[2]])
        y = y + 1
        ahead.join()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x * 2 + 1)
    assert all(torch.equal(w, s) for w, s in zip(ws, saved))


@cuda
@pytest.mark.parametrize("graphs", [True, False])
def test_engine_tokens_with_l2_ahead_on_cuda(monkeypatch, graphs):
    """mini-shaped asks on the tiny model (MIN_BYTES 0: every weight asked), decode graphs or eager steps:
    the same greedy tokens as with KESTREL_L2_AHEAD off."""
    monkeypatch.setattr(l2_ahead, "MIN_BYTES", 0)
    monkeypatch.setenv("KESTREL_L2_AHEAD", "on")
    if not l2_ahead.supported(torch.device("cuda")):
        pytest.skip("needs sm_90+ with PDL on")
    out = {}
    for on in ("off", "on"):
        monkeypatch.setenv("KESTREL_L2_AHEAD", on)
        model = build_model("tiny", dtype=torch.bfloat16, device="cuda", seed=5)
        engine = _engine(model, device="cuda", max_running_requests=4, disable_cuda_graph=not graphs)
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        out[on] = _run(engine, {str(i): (_prompt(6 + i, i), greedy) for i in range(3)})[0]
        if on == "on":
            assert engine.runner._l2_ahead is not None
    assert out["on"] == out["off"]


def test_an_mla_layer_asks_in_the_order_it_reads():
    """mini's MLA layers: x's projections first (q, the latent row, the output gate, the indexer's, read in one
    launch), then kv_b and o_proj; the 24 MB budget takes the first launch's weights and stops in the indexer's.
    In module order it had stopped inside the gate and never asked the indexer's (session 50's review)."""
    config = preset_config("mini")
    with torch.device("meta"):
        model = KimiForCausalLM(config, dtype=torch.bfloat16)
    layer = model.model.layers[3]  # mini's first MLA layer
    attn = layer.self_attn
    names = {id(p): n for n, p in attn.named_parameters()}
    order = [names[id(p)] for p in layer.attention_weights_ahead()]
    first = ["q_proj", "kv_a_proj_with_mqa", "g_proj", "indexer.wq", "indexer.wk", "indexer.weights_proj"]
    assert order == [f"{n}.weight" for n in [*first, "kv_b_proj", "o_proj"]]
    assert sorted(map(id, attn.weights_in_read_order())) == sorted(map(id, attn.parameters()))
    asked = [n for _, n in l2_ahead.segments(layer.attention_weights_ahead())]  # meta tensors: address 0
    assert asked == [12 << 20, 2304 << 10, 8 << 20, (24 << 20) - (12 << 20) - (2304 << 10) - (8 << 20)]
