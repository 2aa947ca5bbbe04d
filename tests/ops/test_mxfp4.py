"""MXFP4 pack/unpack: E2M1 table, nibble order, E8M0 scales, rounding and round trips."""

from __future__ import annotations

import pytest
import torch

from kestrel.ops.quant import BLOCK, E2M1_VALUES, pack_mxfp4, unpack_mxfp4

E2M1 = torch.tensor(E2M1_VALUES)
SIGNED = torch.cat((E2M1, -E2M1))  # index = 4-bit code


def _row(values, fill=0.0):
    """One 32-wide block (a [1, 32] weight) with `values` first, then `fill`."""
    w = torch.full((1, BLOCK), fill)
    w[0, : len(values)] = torch.tensor(values)
    return w


def test_unpack_hand_bytes():
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0] = 0x21  # low nibble 1 -> 0.5 (element 0), high nibble 2 -> 1.0 (element 1)
    packed[0, 1] = 0x9F  # low nibble 0xF -> -6.0, high nibble 0x9 -> -0.5
    packed[0, 2] = 0x87  # low 7 -> 6.0, high 8 -> -0.0
    packed[0, 3] = 0xDA  # low 0xA -> -1.0, high 0xD -> -3.0
    scale = torch.tensor([[127]], dtype=torch.uint8)
    w = unpack_mxfp4(packed, scale, torch.float32)
    assert w.shape == (1, 32)
    assert w[0, :8].tolist() == [0.5, 1.0, -6.0, -0.5, 6.0, -0.0, -1.0, -3.0]
    assert torch.signbit(w[0, 5])
    assert (w[0, 8:] == 0).all()
    # scale 130 = 2^3, scale 120 = 2^-7, scale 0 = 2^-127 (an fp32 subnormal)
    for e in (130, 120, 0):
        w = unpack_mxfp4(packed, torch.tensor([[e]], dtype=torch.uint8), torch.float32)
        assert w[0, :2].tolist() == [0.5 * 2.0 ** (e - 127), 1.0 * 2.0 ** (e - 127)]


def test_unpack_full_table_and_block_scales():
    codes = torch.arange(16, dtype=torch.uint8).repeat(4)  # 64 elements, every code 4 times
    packed = (codes[0::2] | (codes[1::2] << 4))[None]  # [1, 32]
    scale = torch.tensor([[126, 129]], dtype=torch.uint8)  # block 0 * 0.5, block 1 * 4
    w = unpack_mxfp4(packed, scale, torch.float32)
    expected = SIGNED[codes.long()] * torch.tensor([0.5] * 32 + [4.0] * 32)
    assert torch.equal(w[0], expected)
    assert unpack_mxfp4(packed, scale).dtype == torch.bfloat16


def test_unpack_scale_255_is_nan():
    packed = torch.full((2, 32), 0x21, dtype=torch.uint8)
    scale = torch.tensor([[127, 255], [255, 127]], dtype=torch.uint8)
    w = unpack_mxfp4(packed, scale, torch.float32)
    assert w[0, :32].isfinite().all() and w[0, 32:].isnan().all()
    assert w[1, :32].isnan().all() and w[1, 32:].isfinite().all()


def test_nibble_order_low_is_even():
    w = _row([1.0, 6.0])  # amax 6 -> scale 2^0
    packed, scale = pack_mxfp4(w)
    assert scale.tolist() == [[127]]
    assert packed[0, 0].item() == 0x72  # element 0 (1.0, code 2) low, element 1 (6.0, code 7) high
    assert (packed[0, 1:] == 0).all()


def test_pack_rounding_ties_to_even_and_saturation():
    # amax 6 pins the block scale at 2^0, so the other entries are the values to round
    inputs = [6.0, 2.5, 3.5, 5.0, 0.25, 0.75, 1.25, 1.75, 0.3, 2.6, 4.9, 5.1, 7.9, -2.5, -0.25, -7.0]
    expect = [6.0, 2.0, 4.0, 4.0, 0.00, 1.00, 1.00, 2.00, 0.5, 3.0, 4.0, 6.0, 6.0, -2.0, -0.00, -6.0]
    w = _row(inputs)
    packed, scale = pack_mxfp4(w)
    assert scale.tolist() == [[127]]
    out = unpack_mxfp4(packed, scale, torch.float32)
    assert out[0, : len(inputs)].tolist() == expect
    # saturation is relative to the block scale X: amax 7.9 gives X = 1, top value 6
    packed, scale = pack_mxfp4(_row([7.9, 1.0]))
    assert scale.tolist() == [[127]] and unpack_mxfp4(packed, scale, torch.float32)[0, :2].tolist() == [
        6.0,
        1.0,
    ]


def test_pack_scale_rule():
    # X = 2^(floor(log2 amax) - 2)
    for amax, e in [
        (6.0, 127),
        (4.0, 127),
        (3.99, 126),
        (8.0, 128),
        (1.0, 125),
        (1e-3, 115),
        (2.0**-100, 25),
    ]:
        _, scale = pack_mxfp4(_row([amax]))
        assert scale.item() == e, amax
    _, scale = pack_mxfp4(_row([-5.0]))
    assert scale.item() == 127


def test_zero_block():
    w = torch.zeros(2, 64)
    w[1, 32:] = 1.0
    packed, scale = pack_mxfp4(w)
    assert scale.tolist() == [[0, 0], [0, 125]]
    assert (packed[:, :16] == 0).all() and (packed[0] == 0).all()
    assert torch.equal(unpack_mxfp4(packed, scale, torch.float32), w)


def test_round_trip_exact_on_representable_values():
    g = torch.Generator().manual_seed(0)
    O, G = 24, 7
    codes = torch.randint(0, 16, (O, G, BLOCK), generator=g)
    # make each block's amax code 4.0 or 6.0 (magnitude codes 6, 7) so the amax rule picks the block's power
    pos = torch.randint(0, BLOCK, (O, G), generator=g)
    top = torch.randint(6, 8, (O, G), generator=g) | (torch.randint(0, 2, (O, G), generator=g) << 3)
    codes.scatter_(2, pos[..., None], top[..., None])
    powers = torch.randint(-20, 20, (O, G, 1), generator=g).float()
    w = (SIGNED[codes] * torch.exp2(powers)).view(O, G * BLOCK)
    packed, scale = pack_mxfp4(w)
    assert packed.shape == (O, G * BLOCK // 2) and packed.dtype == torch.uint8
    assert scale.shape == (O, G) and scale.dtype == torch.uint8
    assert torch.equal(scale.long(), powers[..., 0].long() + 127)
    assert torch.equal(unpack_mxfp4(packed, scale, torch.float32), w)
    assert torch.equal(unpack_mxfp4(packed, scale, torch.bfloat16), w.bfloat16())
    # and the bytes themselves round-trip
    packed2, scale2 = pack_mxfp4(unpack_mxfp4(packed, scale, torch.float32))
    assert torch.equal(scale2, scale)
    assert torch.equal(unpack_mxfp4(packed2, scale2, torch.float32), w)


def test_random_weights_round_to_nearest_grid_point():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 96, generator=g, dtype=torch.bfloat16).float()
    packed, scale = pack_mxfp4(w)
    deq = unpack_mxfp4(packed, scale, torch.float32)
    x = torch.exp2(scale.float() - 127).repeat_interleave(BLOCK, dim=1)  # [O, I] block power X
    nearest = (SIGNED * x[..., None] - w[..., None]).abs().amin(-1)  # distance to the closest X * E2M1 value
    assert torch.equal((deq - w).abs(), nearest)  # includes saturation of |w| in (6X, 8X) to 6X
    assert ((deq - w).abs() <= 2 * x).all()


def test_bad_shapes_raise():
    with pytest.raises(ValueError):
        pack_mxfp4(torch.zeros(4, 48))
    with pytest.raises(ValueError):
        unpack_mxfp4(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError):
        unpack_mxfp4(torch.zeros(4, 16, dtype=torch.int8), torch.zeros(4, 1, dtype=torch.uint8))
