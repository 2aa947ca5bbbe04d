from kestrel.ops.mla.naive import (
    mla_attention_absorbed,
    mla_attention_expanded,
    mla_attention_rows,
    mla_decode_batched,
    split_kv_b,
    write_rows,
)

__all__ = [
    "mla_attention_absorbed",
    "mla_attention_expanded",
    "mla_attention_rows",
    "mla_decode_batched",
    "split_kv_b",
    "write_rows",
]
