"""KESTREL_DSA_TOPK_ROWS: decode's CUDA top-k also writes the selection's pool rows, and the sparse MLA decode
reads them instead of translating the positions in a launch of its own (`selected_rows`).

On the CPU the layer's plumbing (`MLAttention._attend_decode_paged`) runs with stand-ins for the kernels: which
top-k runs, what reaches `mla_decode_paged`, and that a replayed selection and a captured one go as before. On
CUDA (with the CUDA top-k built) the engine's decode steps with the switch on: every sparse MLA call given rows
gets the rows `selected_rows` makes and the output it gives bit for bit, and the tokens are those of the switch
off, eagerly and through the decode graphs.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kestrel.layers.mla as mla
from kestrel.ops.dsa import by_position, cuda_topk, topk_select

B, L, PS, K = 3, 64, 4, 8  # rows, score width (16 pages of 4), page size, top-k


@pytest.fixture(scope="module")
def layer():
    """A DSA layer of `tiny` (top-k 8)."""
    from kestrel.models.loader import build_model

    model = build_model("tiny", seed=2)
    found = [m for m in model.modules() if isinstance(m, mla.MLAttention) and m.indexer is not None]
    assert found and found[0].indexer.topk == K
    return found[0]


class Stand:
    """Stand-ins for the kernels `_attend_decode_paged` calls, recording their calls: the scores, the CUDA top-k
    (`cuda_topk.topk_cuda`, swapped for one whose identity the layer checks), its rows twin, Triton's top-k and
    the sparse MLA decode (which returns its arguments)."""

    def __init__(self, monkeypatch, rows_made: bool = True):
        from kestrel.ops.dsa import triton_scores
        from kestrel.ops.mla import triton_decode

        g = torch.Generator().manual_seed(1)
        self.scores = torch.randn(B, L, generator=g)  # [B, L]
        self.lens = torch.tensor([L, 5, 30])
        self.table = torch.randperm(B * (L // PS) + 4, generator=g)[: B * (L // PS)].view(B, L // PS)
        self.calls: list[str] = []
        self.rows_made = rows_made

        def scores(*args, **kwargs):
            self.calls.append("scores")
            return self.scores

        monkeypatch.setattr(triton_scores, "indexer_scores_paged_triton", scores)
        # one bound method object: the layer tells the CUDA top-k by identity (`cuda_topk.topk_cuda`)
        self.cuda = self.topk_cuda
        monkeypatch.setattr(cuda_topk, "topk_cuda", self.cuda)
        monkeypatch.setattr(cuda_topk, "topk_cuda_with_rows", self.with_rows)
        monkeypatch.setattr(triton_decode, "mla_decode_paged", self.decode)

    def positions(self, scores, lens, k):
        return by_position(topk_select(scores, lens - 1, k))  # [B, k]

    def topk_cuda(self, scores, lens, k):
        self.calls.append("topk_cuda")
        return self.positions(scores, lens, k)

    def topk_triton(self, scores, lens, k):
        self.calls.append("topk_triton")
        return self.positions(scores, lens, k)

    def with_rows(self, scores, lens, k, table, page_size):
        self.calls.append("with_rows")
        assert table is self.table and page_size == PS
        positions = self.positions(scores, lens, k)
        pages = table.gather(1, positions.clamp(min=0) // page_size)
        rows = torch.where(positions >= 0, pages * page_size + positions % page_size, -1).int()
        self.made = (positions, rows)
        return positions, (rows if self.rows_made else None)

    def decode(self, *args, rows=None):
        self.calls.append("decode")
        return SimpleNamespace(indices=args[9], rows=rows, table=args[3], lens=args[5])


def attend(layer, stand: Stand, replay=None, capture=None):
    """layer._attend_decode_paged over a stand-in paged cache (its page table and lens from `stand`)."""
    cache = SimpleNamespace(
        paged=lambda layer_id: (None, None, stand.table, stand.lens, PS), index_scales=lambda layer_id: None
    )
    ctx = SimpleNamespace(cache=cache, selection_replay=replay, selection_capture=capture)
    q = torch.zeros(B, 1, 1)
    idx = (torch.zeros(B, 1, 1), torch.zeros(B, 1), None)
    return layer._attend_decode_paged(ctx, q, q, None, None, idx)


@pytest.mark.parametrize("kernel", ["cuda", "triton"])
def test_off_runs_the_top_k_alone(layer, monkeypatch, kernel):
    """KESTREL_DSA_TOPK_ROWS off (the default): the top-k `fast_topk` picks, and no rows reach the decode."""
    monkeypatch.delenv("KESTREL_DSA_TOPK_ROWS", raising=False)
    stand = Stand(monkeypatch)
    pick = stand.cuda if kernel == "cuda" else stand.topk_triton
    monkeypatch.setattr(mla, "fast_topk", lambda device: pick)
    got = attend(layer, stand)
    assert stand.calls == ["scores", f"topk_{kernel}", "decode"]
    assert got.rows is None and torch.equal(got.indices, stand.positions(stand.scores, stand.lens, K))


def test_on_makes_the_rows_in_the_top_ks_launch(layer, monkeypatch):
    """On, with the CUDA top-k: one call makes the positions and their rows, and the decode gets both."""
    monkeypatch.setenv("KESTREL_DSA_TOPK_ROWS", "on")
    stand = Stand(monkeypatch)
    monkeypatch.setattr(mla, "fast_topk", lambda device: stand.cuda)
    got = attend(layer, stand)
    assert stand.calls == ["scores", "with_rows", "decode"]
    assert got.indices is stand.made[0] and got.rows is stand.made[1]
    assert got.table is stand.table and got.lens is stand.lens


def test_on_without_rows_from_the_pick_or_with_tritons_top_k(layer, monkeypatch):
    """On, but the pick is not a short variant (no rows made: the decode translates the positions itself), or the
    top-k is Triton's (the switch does not apply)."""
    monkeypatch.setenv("KESTREL_DSA_TOPK_ROWS", "on")
    stand = Stand(monkeypatch, rows_made=False)
    monkeypatch.setattr(mla, "fast_topk", lambda device: stand.cuda)
    got = attend(layer, stand)
    assert stand.calls == ["scores", "with_rows", "decode"]
    assert got.rows is None and got.indices is stand.made[0]
    stand = Stand(monkeypatch)
    monkeypatch.setattr(mla, "fast_topk", lambda device: stand.topk_triton)
    got = attend(layer, stand)
    assert stand.calls == ["scores", "topk_triton", "decode"] and got.rows is None


def test_on_with_a_capture_stores_the_positions(layer, monkeypatch):
    """A capture (RL) stores the positions as before, one row a sequence; the rows still reach the decode."""
    monkeypatch.setenv("KESTREL_DSA_TOPK_ROWS", "on")
    stand = Stand(monkeypatch)
    monkeypatch.setattr(mla, "fast_topk", lambda device: stand.cuda)
    capture = {}
    got = attend(layer, stand, capture=capture)
    stored = capture[layer.layer_id]
    assert len(stored) == B and torch.equal(torch.cat(stored), stand.made[0])
    assert got.rows is stand.made[1]


def test_on_with_a_replay_translates_as_before(layer, monkeypatch):
    """A replayed selection runs no top-k: the decode gets the replayed positions and no rows (selected_rows
    translates them, as with the switch off)."""
    monkeypatch.setenv("KESTREL_DSA_TOPK_ROWS", "on")
    stand = Stand(monkeypatch)
    monkeypatch.setattr(mla, "fast_topk", lambda device: stand.cuda)
    chosen = [torch.full((1, K), b, dtype=torch.int64) for b in range(B)]
    got = attend(layer, stand, replay={layer.layer_id: chosen})
    assert "with_rows" not in stand.calls and "topk_cuda" not in stand.calls
    assert torch.equal(got.indices, torch.cat(chosen)) and got.rows is None


def test_on_with_dense_attention_selects_nothing(layer, monkeypatch):
    """With the layer's top-k off (dense attention) and a capture, nothing is selected: no indices, no rows."""
    monkeypatch.setenv("KESTREL_DSA_TOPK_ROWS", "on")
    stand = Stand(monkeypatch)
    monkeypatch.setattr(mla, "fast_topk", lambda device: stand.cuda)
    monkeypatch.setattr(layer.indexer, "topk", None)
    got = attend(layer, stand, capture={})
    assert "with_rows" not in stand.calls and got.indices is None and got.rows is None


# ---------------------------------------------------------------- on the device


def _engine_tokens(model, graphs: bool) -> dict[str, list[int]]:
    from kestrel.engine.sampling_params import SamplingParams
    from tests.engine.test_engine import _engine, _prompt

    engine = _engine(
        model,
        device="cuda",
        max_running_requests=4,
        max_model_len=256,
        kv_cache_bytes=64 * 2**20,
        disable_cuda_graph=not graphs,
    )
    jobs = [(_prompt(n, i), m) for i, (n, m) in enumerate(((3, 14), (12, 10), (30, 6), (9, 12)))]
    for i, (ids, m) in enumerate(jobs):
        engine.add_request(ids, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True), str(i))
    tokens = {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return tokens


@pytest.mark.skipif(
    not (torch.cuda.is_available() and cuda_topk.available()),
    reason=f"the CUDA top-k: {cuda_topk.UNAVAILABLE_REASON or 'no CUDA device'}",
)
def test_decode_with_rows_from_the_top_k_equals_off_bit_for_bit(monkeypatch):
    """`tiny` on CUDA, decode through the paged kernels with KESTREL_DSA_TOPK_ROWS=on: in every sparse MLA call
    given rows (eager steps) the rows are `selected_rows` of the indices and the output equals the call without
    them (the translation in its own launch) bit for bit; the tokens equal those of the switch off, eagerly and
    through the decode graphs (where the rows come from the captured top-k)."""
    from kestrel.models.loader import build_model
    from kestrel.ops.mla import triton_decode

    model = build_model("tiny", dtype=torch.float32, device="cuda", seed=11)
    monkeypatch.setenv("KESTREL_ATTN_BACKEND", "auto")
    monkeypatch.setenv("KESTREL_DSA_TOPK", "cuda")
    monkeypatch.setenv("KESTREL_DSA_TOPK_REGISTERS", "auto")
    monkeypatch.setenv("KESTREL_DSA_TOPK_ROWS", "off")
    off = _engine_tokens(model, graphs=False)

    real, checked = triton_decode.mla_decode_paged, []

    def spy(*args, rows=None, **kwargs):
        out = real(*args, rows=rows, **kwargs)
        if rows is not None:
            _, _, _, table, ps, lens, _, _, _, indices = args
            same_rows = torch.equal(rows, triton_decode.selected_rows(indices, table, ps, lens))
            checked.append(same_rows and torch.equal(out, real(*args, **kwargs)))
        return out

    monkeypatch.setenv("KESTREL_DSA_TOPK_ROWS", "on")
    monkeypatch.setattr(triton_decode, "mla_decode_paged", spy)
    on = _engine_tokens(model, graphs=False)
    assert checked and all(checked), checked  # rows reached the decode, and matched every time
    assert on == off
    monkeypatch.setattr(triton_decode, "mla_decode_paged", real)
    assert _engine_tokens(model, graphs=True) == off
