"""IQ4_NL and IQ4_XS encoders that reproduce llama.cpp's quantizer without an importance matrix (what
`ggml_quantize_chunk` writes, i.e. `quantize_iq4_nl` / `quantize_iq4_xs` with no weights: a search over 15
scales around the block maximum on the non-linear grid, each value weighted by x²) byte for byte, vectorized
over blocks.

Exactness rests on the same float32 discipline as the k-quant encoders (`kquant_quantize.py`): sums run one term at
a time along the 32 values of a block, divisions stay divisions, products keep C's order (`w*q*x` is `(w*q)*x`).
The nearest grid level is llama.cpp's: C brackets x between two levels and keeps the lower when `x - lo < hi - x`
in float32, which for every finite x decides as comparing `2x` with `lo + hi` (see `best_index`), the comparison
used here. Any finite input matches; where the squared values overflow float32 (|x| above ~1.8e19) the fit is NaN
and the bytes follow ggml 0.21's NaN path (level 15; a later llama.cpp, which compares `2x` with `lo + hi`
directly, writes level 0 there).
"""

from __future__ import annotations

import torch

from juno_py.gguf.constants import GGMLType
from juno_py.gguf.quants.iquants import IQ4_LEVELS
from juno_py.gguf.quants.kquant_quantize import _f32, _first_absmax, _fp16, _seqsum, nearest_int
from juno_py.gguf.quants.registry import register_quantizer

QK4_NL = 32
QK_K = 256
NTRY = 7  # scales tried on each side of the first guess
_LEVELS = IQ4_LEVELS.float()
_GROUP_MAX_EPS = _f32(1e-15)
_ZERO = _f32(0.0)
_ONE = _f32(1.0)


# sums of neighbouring levels (exact small integers): level i+1 is nearer than level i from 2v >= _PAIR_SUMS[i] on
_PAIR_SUMS = _LEVELS[:-1] + _LEVELS[1:]


def best_index(v: torch.Tensor) -> torch.Tensor:
    """llama.cpp's `best_index_int8(16, kvalues_iq4nl, v)` (int64 level indices): the nearest level, ties to the
    upper one; below the lowest level 0, above the highest 15, NaN 15.

    C brackets v between two levels and keeps the lower when `v - lo < hi - v` in float32. Counting the sums of
    neighbouring levels at or below 2v (exact: doubling a float32 and adding two int8s do not round) decides the
    same way: every midpoint is at least 4.5 from 0, so near one the two differences are multiples of v's ulp
    below 2^24 of them, i.e. exact, and away from one rounding cannot make them equal. NaN counts as above all."""
    return torch.bucketize(v + v, _PAIR_SUMS, right=True)


def block_scales(x: torch.Tensor) -> torch.Tensor:
    """The scale llama.cpp's search settles on for each 32-value block (`quantize_row_iq4_nl_impl`, ntry 7, no
    importance weights): x is element-major [32, S]; returns [S], 0 for blocks whose largest |x| is below 1e-15.

    The 16 candidate scales (the first guess −max/−127, then `(k − 127)/max` for k = −7..7) do not depend on one
    another, so their sums are computed together, [16, 2, S]; only the choice among them runs in C's order."""
    n, S = x.shape
    mx = _first_absmax(x, 0)
    empty = mx.abs() < _GROUP_MAX_EPS
    first = torch.div(_ONE, torch.div(mx.neg(), _f32(float(IQ4_LEVELS[0]))))  # 1/d with d = -max/values[0]
    ks = torch.arange(-NTRY, NTRY + 1, dtype=torch.float32) + float(IQ4_LEVELS[0])  # itry + values[0], exact
    iscales = torch.cat([first[None], torch.div(ks[:, None], mx[None, :])])  # (itry + values[0])/max
    v = (x[:, None, :] * iscales[None]).contiguous()  # [n, 16, S]: id*xb[j] for every candidate
    q = _LEVELS[torch.bucketize(v.add_(v), _PAIR_SUMS, right=True)]  # best_index(id*xb[j]) from 2·(id*xb[j])
    wq = q * (x * x)[:, None, :]  # w*q with w = x²
    terms = torch.empty((n, 2 * NTRY + 2, 2, S), dtype=torch.float32)
    torch.mul(wq, x[:, None, :], out=terms[:, :, 0])  # w*q*xb[j]
    torch.mul(wq, q, out=terms[:, :, 1])  # w*q*q
    sumqx, sumq2 = _seqsum(terms).unbind(1)  # [16, S] each
    d = torch.where(sumq2[0] > 0, sumqx[0] / sumq2[0], _ZERO)
    best = d * sumqx[0]
    for c in range(1, 2 * NTRY + 2):
        take = (sumq2[c] > 0) & (sumqx[c] * sumqx[c] > best * sumq2[c])  # `if (sumq2 > 0 && sumqx*sumqx > best*sumq2)`
        d = torch.where(take, sumqx[c] / sumq2[c], d)
        best = torch.where(take, d * sumqx[c], best)
    return torch.where(empty, _ZERO, d)


def _pack_nibbles(L: torch.Tensor) -> torch.Tensor:
    """Levels [nb, k, 32] → [nb, 16k] bytes: value j in the low nibble of byte j, value 16 + j in the high one."""
    return (L[..., :16] | (L[..., 16:] << 4)).to(torch.uint8).reshape(L.shape[0], -1)


def _reciprocal_or_zero(v: torch.Tensor) -> torch.Tensor:
    """`v ? 1/v : 0` (NaN is true in C)."""
    return torch.where(v != 0, torch.div(_ONE, v), _ZERO)


def quantize_iq4_nl(x: torch.Tensor) -> torch.Tensor:
    """float32 [n_blocks, 32] → uint8 [n_blocks, 18]: fp16 scale, then 16 bytes of level indices."""
    x = x.reshape(-1, QK4_NL)
    d = block_scales(x.t().contiguous())
    d_half, d_bytes = _fp16(d)  # the levels are picked with the float32 scale, as in C
    L = best_index(x * _reciprocal_or_zero(d)[:, None])
    return torch.cat([d_bytes, _pack_nibbles(L.reshape(-1, 1, QK4_NL))], 1)


def quantize_iq4_xs(x: torch.Tensor) -> torch.Tensor:
    """float32 [n_blocks, 256] → uint8 [n_blocks, 136]: fp16 super-block scale, 8 signed 6-bit block scales (high
    2 bits in a uint16, low nibbles in 4 bytes), 128 bytes of level indices."""
    nb = x.shape[0]
    x = x.reshape(nb, QK_K)
    scales = block_scales(x.reshape(-1, 32).t().contiguous()).reshape(nb, 8)
    max_scale = _first_absmax(scales, 1)  # `if (abs_d > amax_scale)` from 0
    d = torch.div(max_scale.neg(), _f32(32.0))
    _, d_bytes = _fp16(d)
    id_ = _reciprocal_or_zero(d)
    ls = nearest_int(id_[:, None] * scales).clamp_(-32, 31)
    dl = d[:, None] * ls.float()
    L = best_index(x.reshape(nb, 8, 32) * _reciprocal_or_zero(dl)[..., None])
    codes = ls + 32
    scales_l = (codes[:, 0::2] & 0xF) | ((codes[:, 1::2] & 0xF) << 4)
    scales_h = ((codes >> 4) << (2 * torch.arange(8, dtype=torch.int32))).sum(1, dtype=torch.int32)
    scales_h = torch.stack([scales_h & 0xFF, scales_h >> 8], 1)
    return torch.cat([d_bytes, scales_h.to(torch.uint8), scales_l.to(torch.uint8), _pack_nibbles(L)], 1)


def _chunked(fn, block_size: int, chunk_blocks: int):
    """Encode in chunks of blocks: large enough to amortize the per-step overhead of the sequential sums, small
    enough for the working tensors to stay in cache."""

    def quantize_blocks(x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float32).reshape(-1, block_size)
        if x.shape[0] <= chunk_blocks:
            return fn(x)
        return torch.cat([fn(x[i : i + chunk_blocks]) for i in range(0, x.shape[0], chunk_blocks)])

    quantize_blocks.__name__ = fn.__name__
    quantize_blocks.__doc__ = fn.__doc__
    return quantize_blocks


IQ4_QUANTIZERS = {
    GGMLType.IQ4_NL: _chunked(quantize_iq4_nl, QK4_NL, 1024),
    GGMLType.IQ4_XS: _chunked(quantize_iq4_xs, QK_K, 128),
}

for _type, _fn in IQ4_QUANTIZERS.items():
    register_quantizer(_type, _fn)
