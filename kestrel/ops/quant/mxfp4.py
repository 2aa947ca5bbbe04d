"""MXFP4 (OCP MX v1.0: E2M1 elements, E8M0 scales, blocks of 32 along the input dim) pack and unpack,
in the compressed-tensors `mxfp4-pack-quantized` byte layout (model-spec 7.1-7.2).

Packed weight [O, I/2] uint8: element 2j in the LOW nibble, 2j+1 in the HIGH nibble. Nibble = sign bit 3 +
E2M1 magnitude code 0..7 -> 0, 0.5, 1, 1.5, 2, 3, 4, 6.
Scale [O, I/32] uint8 E8M0: value 2^(e - 127), 255 = NaN.

Legend: O output rows, I input columns, G = I/32 scale blocks.
"""

from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
BLOCK = 32

# Round-to-nearest-even onto the E2M1 grid: a magnitude past midpoint k (between codes k and k+1) rounds up;
# on a midpoint exactly it rounds to the even code, i.e. up only when k+1 is even (0.75, 1.75, 3.5).
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_UP = (0.75, 1.75, 3.5)


def _e8m0_to_fp32(e: torch.Tensor) -> torch.Tensor:
    """2^(e - 127) built from fp32 bits, so it is exact (e = 0 is the subnormal 2^-127); 255 -> NaN."""
    e = e.to(torch.int32)
    bits = torch.where(e == 0, torch.full_like(e, 1 << 22), e << 23)
    bits = torch.where(e == 255, torch.full_like(e, 0x7FC00000), bits)
    return bits.view(torch.float32)


def unpack_mxfp4(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Dequantize: W[o, 32g + c] = E2M1(nibble) * 2^(scale[o, g] - 127). Returns [O, I] in dtype
    (computed in fp32; NaN where the scale byte is 255)."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"packed and scale must be uint8, got {packed.dtype} and {scale.dtype}")
    if packed.shape[:-1] != scale.shape[:-1] or packed.shape[-1] * 2 != scale.shape[-1] * BLOCK:
        raise ValueError(f"packed {tuple(packed.shape)} does not match scale {tuple(scale.shape)}")
    *lead, half = packed.shape
    lo = packed & 0x0F  # [O, I/2] even elements
    hi = packed >> 4  # [O, I/2] odd elements
    codes = torch.stack((lo, hi), dim=-1).view(*lead, 2 * half).long()  # [O, I]
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    table = torch.cat((table, -table))  # [16] codes 8..15 are the negatives (8 is -0.0)
    values = table[codes].view(*lead, -1, BLOCK)  # [O, G, 32]
    out = values * _e8m0_to_fp32(scale)[..., None]  # [O, G, 32]
    return out.view(*lead, 2 * half).to(dtype)


def pack_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [O, I] (I a multiple of 32) to (packed [O, I/2] uint8, scale [O, I/32] uint8).

    Per block: X = 2^(floor(log2(amax)) - 2) (emax of E2M1 is 2; an all-zero block gets e = 0, i.e. 2^-127),
    element = round-to-nearest-even onto the E2M1 grid of |w| / X, saturating at 6. Values that are exactly
    representable (E2M1 value * a common power of two whose amax rule gives that power) round-trip exactly.
    """
    if weight.dim() < 1 or weight.shape[-1] % BLOCK != 0:
        raise ValueError(f"last dim of weight {tuple(weight.shape)} must be a multiple of {BLOCK}")
    *lead, cols = weight.shape
    w = weight.float().reshape(*lead, cols // BLOCK, BLOCK)  # [O, G, 32]
    amax = w.abs().amax(-1)  # [O, G]
    # frexp: amax = m * 2^k with m in [0.5, 1), so floor(log2(amax)) = k - 1 exactly
    floor_log2 = torch.frexp(amax).exponent - 1  # [O, G]
    e = (floor_log2 - 2 + 127).clamp(0, 254)  # [O, G]
    e = torch.where(amax == 0, torch.zeros_like(e), e)
    e = torch.where(torch.isfinite(amax), e, torch.full_like(e, 255))
    q = w.abs() / _e8m0_to_fp32(e)[..., None]  # [O, G, 32], exact: division by a power of two
    midpoints = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=w.device)
    codes = torch.bucketize(q, midpoints)  # [O, G, 32] number of midpoints strictly below q; 7 saturates
    ties_up = torch.zeros_like(q, dtype=torch.bool)
    for t in _TIES_UP:
        ties_up |= q == t
    nibbles = (codes + ties_up.long()) | (torch.signbit(w).long() << 3)  # [O, G, 32]
    nibbles = nibbles.view(*lead, cols // 2, 2).to(torch.uint8)  # [O, I/2, 2]
    packed = nibbles[..., 0] | (nibbles[..., 1] << 4)  # [O, I/2]
    return packed, e.to(torch.uint8)
