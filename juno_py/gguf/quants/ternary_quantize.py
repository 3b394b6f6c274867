"""TQ1_0, TQ2_0 and MXFP4 encoders that reproduce llama.cpp's reference quantizers (`quantize_row_tq1_0_ref`,
`quantize_row_tq2_0_ref`, `quantize_row_mxfp4_ref`, what `ggml_quantize_chunk` writes for them) byte for byte,
vectorized over blocks.

TQ1_0 and TQ2_0 scale a 256-value block by its largest magnitude and round each value to −1, 0 or 1 (C's `lroundf`:
ties away from zero). TQ1_0 packs five trits into a byte as the fraction `ceil(256 · t / 243)` of its base-3
number t (four in each of its last four bytes, shifted to the top trit); TQ2_0 stores `trit + 1` in 2 bits.
MXFP4 takes the power of two `2^(floor(log2f(amax)) − 2)` as the scale of 32 values (an e8m0 byte, stored
doubled-halved as ggml does) and picks each value's nearest doubled e2m1 level, the first one on a tie. Inputs
must be finite.
"""

from __future__ import annotations

import torch

from juno_py.gguf.constants import GGMLType
from juno_py.gguf.quants.kquant_quantize import _fp16
from juno_py.gguf.quants.registry import register_quantizer
from juno_py.gguf.quants.simple import round_half_away
from juno_py.gguf.quants.ternary import MXFP4_LEVELS

QK_K = 256
_POW3 = torch.tensor([81, 27, 9, 3, 1], dtype=torch.int32)


def _trits(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`lroundf(x · id) + 1` per value (int32, 0..2) with id = 1/amax (0 for an all-zero block), and the fp16 bytes
    of the scale amax. Where 1/amax overflows (a subnormal amax) x · id is ±inf or NaN, for which lroundf returns
    LONG_MIN on x86-64, 0 once truncated to C's int: the trit of zero, 1."""
    amax = x.abs().amax(1)
    inv = torch.where(amax != 0, torch.div(torch.ones(()), amax), torch.zeros(()))
    _, d_bytes = _fp16(amax)
    y = x * inv[:, None]
    return torch.where(y.isfinite(), round_half_away(y), 0) + 1, d_bytes


def _base3_fraction(t: torch.Tensor) -> torch.Tensor:
    """Trits [..., 5] (most significant first) → `ceil(256 · number / 243)` as uint8."""
    q = (t * _POW3).sum(-1)
    return ((q * 256 + 242) // 243).to(torch.uint8)


def quantize_tq1_0(x: torch.Tensor) -> torch.Tensor:
    """float32 [n_blocks, 256] → uint8 [n_blocks, 54]: 48 bytes of five trits, 4 of four, the fp16 scale."""
    nb = x.shape[0]
    t, d_bytes = _trits(x)
    head = t[:, :160].reshape(nb, 5, 32).transpose(1, 2)  # byte m: values m + 32n, n = 0..4
    mid = t[:, 160:240].reshape(nb, 5, 16).transpose(1, 2)  # byte 32 + m: values 160 + m + 16n
    tail = t[:, 240:].reshape(nb, 4, 4).transpose(1, 2)  # byte 48 + j: values 240 + j + 4m, then a zero trit
    tail = torch.cat([tail, torch.zeros_like(tail[..., :1])], -1)
    return torch.cat([_base3_fraction(head), _base3_fraction(mid), _base3_fraction(tail), d_bytes], 1)


def quantize_tq2_0(x: torch.Tensor) -> torch.Tensor:
    """float32 [n_blocks, 256] → uint8 [n_blocks, 66]: 64 bytes of four 2-bit `trit + 1` codes, the fp16 scale."""
    nb = x.shape[0]
    t, d_bytes = _trits(x)
    t = t.reshape(nb, 2, 4, 32)  # byte 32h + m: values 128h + m + 32n at bits 2n
    shifts = (2 * torch.arange(4, dtype=torch.int32))[:, None]
    qs = (t << shifts).sum(2).to(torch.uint8).reshape(nb, 64)
    return torch.cat([qs, d_bytes], 1)


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """ggml_e8m0_to_fp32_half: 2^(e − 128) as float32 (subnormal for e < 2)."""
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.to(torch.int32).view(torch.float32)


_MXFP4_LEVELS = MXFP4_LEVELS.float() if MXFP4_LEVELS is not None else None


def quantize_mxfp4(x: torch.Tensor) -> torch.Tensor:
    """float32 [n_blocks, 32] → uint8 [n_blocks, 17]: the e8m0 scale byte, 16 bytes of 4-bit level indices (value
    j in the low nibble of byte j, value 16 + j in the high one)."""
    assert _MXFP4_LEVELS is not None
    amax = x.abs().amax(1)
    # floorf(log2f(amax)): log2 correctly rounded to float32 first (an amax just below a power of two can round
    # up to the integer there), then the float → uint8 conversion, which wraps below 0 as C's does on x86-64
    log2 = torch.log2(amax.double()).float().floor()
    e = torch.where(amax > 0, (log2.to(torch.int32) + 125) & 0xFF, 0)
    d = _e8m0_half(e)
    err = (_MXFP4_LEVELS * d[:, None, None] - x[:, :, None]).abs()  # |kvalues[i]*d - x|, [nb, 32, 16]
    idx = err.argmin(-1)  # the first of equal errors, as the C loop's strict `<`
    qs = (idx[:, :16] | (idx[:, 16:] << 4)).to(torch.uint8)
    return torch.cat([e.to(torch.uint8)[:, None], qs], 1)


def _chunked(fn, block_size: int, chunk_blocks: int):
    def quantize_blocks(x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float32).reshape(-1, block_size)
        if x.shape[0] <= chunk_blocks:
            return fn(x)
        return torch.cat([fn(x[i : i + chunk_blocks]) for i in range(0, x.shape[0], chunk_blocks)])

    quantize_blocks.__name__ = fn.__name__
    quantize_blocks.__doc__ = fn.__doc__
    return quantize_blocks


TERNARY_QUANTIZERS = {
    GGMLType.TQ1_0: _chunked(quantize_tq1_0, QK_K, 1024),
    GGMLType.TQ2_0: _chunked(quantize_tq2_0, QK_K, 1024),
}
if _MXFP4_LEVELS is not None:
    TERNARY_QUANTIZERS[GGMLType.MXFP4] = _chunked(quantize_mxfp4, 32, 4096)

for _type, _fn in TERNARY_QUANTIZERS.items():
    register_quantizer(_type, _fn)
