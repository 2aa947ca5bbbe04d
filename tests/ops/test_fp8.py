"""FP8 E4M3 rows with one scale each (the optional storage of the DSA indexer keys)."""

import torch

from kestrel.cache.kv_pool import KVPool
from kestrel.ops.quant import FP8, dequantize_fp8_rows, quantize_fp8_rows
from kestrel.presets import preset_config


def test_round_trip_error_within_e4m3_precision():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g) * torch.logspace(-3, 3, 64)[:, None]  # rows across six decades
    q, scale = quantize_fp8_rows(x)
    assert q.dtype == FP8 and scale.shape == (64, 1)
    back = dequantize_fp8_rows(q, scale, torch.float32)
    # 3 mantissa bits: half a step is 2^-4 of the value; below E4M3's smallest normal, a step is 2^-9 x scale
    bound = x.abs() * 2**-4 + scale * 2**-10
    assert ((back - x).abs() <= bound * 1.0001).all()
    torch.testing.assert_close(back.abs().amax(-1), x.abs().amax(-1), rtol=1e-6, atol=0)  # max -> 448 exactly


def test_zero_row_and_bf16_output():
    q, scale = quantize_fp8_rows(torch.zeros(2, 8))
    assert torch.equal(dequantize_fp8_rows(q, scale, torch.bfloat16), torch.zeros(2, 8, dtype=torch.bfloat16))


def test_pool_stores_fp8_keys_and_reads_them_back_dequantized():
    config = preset_config("tiny")
    pool = KVPool(config, 4, 4, torch.float32, "cpu", index_fp8=True)
    layer = config.mla_layer_ids[0]
    assert pool.index_k[layer].dtype == FP8 and pool.index_scale[layer].shape == (20, 1)
    keys = torch.randn(3, config.index_head_dim)
    rows = torch.tensor([5, 9, 13])
    pool.write_index(layer, rows, keys)
    q, scale = quantize_fp8_rows(keys)
    assert torch.equal(pool.read_index(layer, rows), dequantize_fp8_rows(q, scale, torch.float32))
    plain = KVPool(config, 4, 4, torch.float32, "cpu")
    saved = len(config.mla_layer_ids) * (config.index_head_dim * 4 - config.index_head_dim - 4)
    assert (
        KVPool.bytes_per_token(config, torch.float32) - KVPool.bytes_per_token(config, torch.float32, True)
        == saved
    )
    assert not plain.index_scale and plain.index_k[layer].dtype == torch.float32
