"""K-quant encoders (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) that reproduce llama.cpp's reference quantizers
(`quantize_row_q*_K_ref`, the path taken without an importance matrix) byte for byte, vectorized over blocks.

Exactness rests on doing every float32 operation the C code does, in the same order: sums run one term at a
time along the sub-block (`_seqsum`), `nearest_int` is the 1.5·2^23 trick, divisions stay divisions
(`scalar / tensor` in torch multiplies by a reciprocal, so constants are 0-d tensors), and sqrt goes through
float64 to be correctly rounded. Any finite input matches, up to ±3.4e38 where the C sums overflow; for NaN or
inf inputs the bytes (garbage in llama.cpp too) may differ.
"""

from __future__ import annotations

import torch

from juno_py.gguf.constants import GGMLType
from juno_py.gguf.quants.registry import register_quantizer

QK_K = 256


def _f32(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


_GROUP_MAX_EPS = _f32(1e-15)
_ZERO = _f32(0.0)
_ONE = _f32(1.0)


# ----------------------------------------------------------------------------------------- float32 helpers


def nearest_int(v: torch.Tensor) -> torch.Tensor:
    """llama.cpp's `nearest_int` (int32): add 12582912.f and keep the low mantissa bits. Round half to even for
    |v| < 2^22, and the same bits as the C code outside that range."""
    return ((v + 12582912.0).view(torch.int32) & 0x7FFFFF) - 0x400000


def _seqsum(t: torch.Tensor, first_is_start: bool = False) -> torch.Tensor:
    """Sum over dim 0 one term after another in float32, like `float s = 0; for (...) s += t[i];`.
    With `first_is_start` the sum starts from t[0] itself (`float s = t[0]; for (i = 1; ...)`)."""
    acc = t[0].clone() if first_is_start else t[0] + 0.0
    for i in range(1, t.shape[0]):
        acc.add_(t[i])
    return acc


def _sqrtf(v: torch.Tensor) -> torch.Tensor:
    # torch's float32 sqrt is not always correctly rounded; float64 then one rounding is.
    return torch.sqrt(v.double()).float()


def _first_absmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The signed value of the first element with the largest magnitude, 0 when none is above 0: the C loop
    `if (fabsf(v) > amax) { amax = fabsf(v); max = v; }` from amax = max = 0, which also skips NaN."""
    a = torch.where(x.isnan(), -1.0, x.abs())
    amax, idx = a.max(dim, keepdim=True)
    return torch.where(amax > 0, x.gather(dim, idx), _ZERO).squeeze(dim)


def _fp16(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGML_FP32_TO_FP16 (round to nearest even): the half as float32 and its two little-endian bytes."""
    h = v.to(torch.float16)
    return h.float(), h.view(torch.uint8).reshape(*v.shape, 2)


def _as_int8(v: torch.Tensor) -> torch.Tensor:
    return ((v + 128) & 0xFF) - 128


# ------------------------------------------------------------------------------- per-sub-block searches
# Sub-block tensors are element-major: x is [n, S] for S sub-blocks of n values, so that x[i] is contiguous and
# the sums over a sub-block are n vector adds. Candidate scales are tried one after another, as in C.


def make_qkx2_quants(
    x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Affine (scale, min) fit of each sub-block with levels 0..nmax: returns L [n, S] (int32), scale [S], and
    the negated min [S], as llama.cpp's `make_qkx2_quants`.

    The candidate scales are tried in order and each one starts from the best min found so far, so the loop
    over candidates stays sequential; every step is vectorized over sub-blocks."""
    n, S = x.shape
    xmin = x.amin(0)
    mn = torch.where(xmin > 0, _ZERO, xmin)
    mx = x.amax(0)
    flat = mx == mn
    sum_w = _seqsum(w, first_is_start=True)
    sum_x = _seqsum(w * x, first_is_start=True)

    iscale = torch.div(_f32(nmax), mx - mn)
    scale = torch.div(_ONE, iscale)
    L = _levels(x, iscale, mn, nmax)
    best = _seqsum(w * _error(scale * L + mn - x, use_mad))
    # the levels kept so far are _levels(x, kept_iscale, kept_from): rebuilt once at the end
    kept_iscale, kept_from = iscale, mn

    steps = torch.arange(nstep + 1, dtype=torch.float32)
    k = (_f32(rmin) + _f32(rdelta) * steps) + nmax  # (rmin + rdelta*is + nmax), float32
    l = torch.empty_like(x)
    terms = torch.empty((n, 3, S), dtype=torch.float32)
    for c in range(nstep + 1):
        span = mx - mn
        iscale = k[c] / span
        torch.sub(x, mn, out=l).mul_(iscale)
        # nearest_int is plain rounding while |v| < 2^22; the best min can drift towards max, and then the
        # C code reads garbage bits out of nearest_int, which we reproduce
        if bool((iscale.abs() * (span.abs() + (mn - xmin).abs()) < 4194000).all()):
            l.round_().clamp_(0, nmax)
        else:
            l.copy_(nearest_int(l).clamp_(0, nmax))
        wl = torch.mul(w, l, out=terms[:, 0])
        torch.mul(wl, l, out=terms[:, 1])
        torch.mul(wl, x, out=terms[:, 2])
        sum_l, sum_l2, sum_xl = _seqsum(terms).unbind(0)

        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        clipped = this_min > 0
        this_min = torch.where(clipped, _ZERO, this_min)
        this_scale = torch.where(clipped, sum_xl / sum_l2, this_scale)
        err = l.mul_(this_scale).add_(this_min).sub_(x)  # the levels are not needed any more
        cur = _seqsum(_error(err, use_mad).mul_(w))

        take = (D > 0) & (cur < best)  # `if (cur_error < best_error)`
        best = torch.where(take, cur, best)
        scale = torch.where(take, this_scale, scale)
        kept_iscale = torch.where(take, iscale, kept_iscale)
        kept_from = torch.where(take, mn, kept_from)
        mn = torch.where(take, this_min, mn)

    L = _levels(x, kept_iscale, kept_from, nmax)
    return torch.where(flat, 0, L.to(torch.int32)), torch.where(flat, _ZERO, scale), -mn


def _levels(x: torch.Tensor, iscale: torch.Tensor, mn: torch.Tensor, nmax: int) -> torch.Tensor:
    """`MAX(0, MIN(nmax, nearest_int(iscale*(x[i] - min))))` as float."""
    return nearest_int(iscale * (x - mn)).clamp_(0, nmax).float()


def _error(diff: torch.Tensor, use_mad: bool) -> torch.Tensor:
    return diff.abs_() if use_mad else diff.mul_(diff)


def make_qx_quants(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric scale fit with levels -nmax..nmax-1 weighted by x² (`make_qx_quants`, rmse_type 1, no
    importance weights): returns L [n, S] offset by nmax (0 for all-zero sub-blocks) and the scale [S]."""
    n, S = x.shape
    mx = _first_absmax(x, 0)
    zero = mx.abs() < _GROUP_MAX_EPS
    steps = torch.tensor([0] + list(range(-9, 0)) + list(range(1, 10)), dtype=torch.float32)
    k = _f32(0.1) * steps + nmax  # initial guess first, then is = -9..9
    w = x * x
    wx = w * x
    l = torch.empty_like(x)
    L = torch.empty_like(x)
    terms = torch.empty((n, 2, S), dtype=torch.float32)
    for c in range(k.numel()):
        iscale = torch.div(-k[c], mx)
        torch.mul(x, iscale, out=l).round_().clamp_(-nmax, nmax - 1)  # |iscale*x| <= nmax + 1
        torch.mul(wx, l, out=terms[:, 0])  # w*x[i]*l
        torch.mul(w, l, out=terms[:, 1]).mul_(l)  # w*l*l
        sumlx, suml2 = _seqsum(terms).unbind(0)
        if c == 0:
            scale = torch.where(suml2 != 0, sumlx / suml2, _ZERO)
            best = scale * sumlx
            L.copy_(l)
            continue
        take = (suml2 > 0) & (sumlx * sumlx > best * suml2)  # `if (suml2 > 0 && sumlx*sumlx > best*suml2)`
        scale = torch.where(take, sumlx / suml2, scale)
        best = torch.where(take, scale * sumlx, best)
        torch.where(take, l, L, out=L)

    L = L.to(torch.int32) + nmax
    return torch.where(zero, 0, L), torch.where(zero, _ZERO, scale)


def make_q3_quants(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric fit weighted by x² refined by coordinate descent (`make_q3_quants` with do_rmse): returns
    L [n, S] offset by nmax (0 for all-zero sub-blocks) and the scale [S]."""
    n, S = x.shape
    mx = _first_absmax(x, 0)
    zero = mx.abs() < _GROUP_MAX_EPS
    iscale = torch.div(_f32(-nmax), mx)
    L = (iscale * x).round_().clamp_(-nmax, nmax - 1)  # |iscale*x| <= nmax + 1: plain rounding
    w = x * x
    wx = w * x
    sumlx = _seqsum(wx * L)
    suml2 = _seqsum(w * L * L)
    L = list(L.unbind(0))
    for _ in range(5):
        # a pass that changes nothing leaves the state as it was, so C's early `break` needs no mask
        n_changed = 0
        for i in range(n):
            slx0 = sumlx - wx[i] * L[i]
            sl2 = suml2 - w[i] * L[i] * L[i]
            new_l = nearest_int(x[i] * sl2 / slx0).clamp_(-nmax, nmax - 1).float()
            slx = slx0 + wx[i] * new_l
            sl2 = sl2 + w[i] * new_l * new_l
            take = (slx0 > 0) & (new_l != L[i]) & (sl2 > 0) & (slx * slx * suml2 > sumlx * sumlx * sl2)
            L[i] = torch.where(take, new_l, L[i])
            sumlx = torch.where(take, slx, sumlx)
            suml2 = torch.where(take, sl2, suml2)
            n_changed += int(take.any())
        if not n_changed:
            break
    L = torch.stack(L).to(torch.int32) + nmax
    scale = torch.where(suml2 > 0, sumlx / suml2, _ZERO)
    return torch.where(zero, 0, L), torch.where(zero, _ZERO, scale)


# ---------------------------------------------------------------------------------------- block encoders


def _requantize(
    x: torch.Tensor, L: torch.Tensor, d: torch.Tensor, dm: torch.Tensor | None, lo: int, hi: int, offset: int
) -> torch.Tensor:
    """Second pass of every k-quant: re-round each value with the stored (fp16 × 6-bit) sub-block scale and
    min; sub-blocks whose scale decodes to 0 keep the levels of the search. x, L: [nb, n_sub, n]; d, dm:
    [nb, n_sub]."""
    v = (x + dm[..., None] if dm is not None else x) / d[..., None]
    q = nearest_int(v).clamp_(lo, hi) + offset
    return torch.where((d != 0)[..., None], q, L)


def _pack_bits(L: torch.Tensor, bits: int) -> torch.Tensor:
    """OR groups along dim -2 into one byte: L [..., k, 32] → [..., 32], group g shifted by g*bits."""
    shifts = torch.arange(L.shape[-2], dtype=torch.int32)[:, None] * bits
    return (L << shifts).sum(-2).to(torch.uint8)


def _sub_blocks(x: torch.Tensor, n: int) -> torch.Tensor:
    """[nb, 256] → element-major [n, nb*256/n]."""
    return x.reshape(-1, n).t().contiguous()


def _from_sub_blocks(t: torch.Tensor, nb: int) -> torch.Tensor:
    """Inverse of `_sub_blocks` for a per-element [n, S] tensor → [nb, 256/n, n]."""
    return t.t().reshape(nb, QK_K // t.shape[0], t.shape[0])


def _unsigned_scale_codes(
    values: torch.Tensor, top: int, clamp: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sub-block scales (or mins) [nb, k] → integer codes of `top/max · v` (as stored in uint8) and the fp16
    super-block factor `max/top`: returns codes (int32), the factor as float32 and its bytes."""
    vmax = torch.where(values.isnan(), _ZERO, values).amax(1).clamp(min=0)  # `if (v > vmax)` from 0
    pos = vmax > 0
    inv = torch.where(pos, torch.div(_f32(top), vmax), _ZERO)
    codes = nearest_int(inv[:, None] * values) & 0xFF
    if clamp:
        codes = codes.clamp(max=top)
    codes = torch.where(pos[:, None], codes, 0)
    factor, factor_bytes = _fp16(torch.where(pos, vmax / top, _ZERO))
    return codes, factor, factor_bytes


def quantize_q2_k(x: torch.Tensor) -> torch.Tensor:
    nb = x.shape[0]
    xs = _sub_blocks(x, 16)
    L, scales, mins = make_qkx2_quants(xs, xs.abs(), 3, -0.5, 0.1, 15, use_mad=True)
    ls, d, d_bytes = _unsigned_scale_codes(scales.reshape(nb, 16), 15, clamp=False)
    lm, dmin, dmin_bytes = _unsigned_scale_codes(mins.reshape(nb, 16), 15, clamp=False)
    sc = ls | ((lm << 4) & 0xFF)
    L = _requantize(
        x.reshape(nb, 16, 16),
        _from_sub_blocks(L, nb),
        d[:, None] * (sc & 0xF).float(),
        dmin[:, None] * (sc >> 4).float(),
        0,
        3,
        0,
    )
    qs = _pack_bits(L.reshape(nb, 2, 4, 32), 2).reshape(nb, 64)
    return torch.cat([sc.to(torch.uint8), qs, d_bytes, dmin_bytes], 1)


def quantize_q3_k(x: torch.Tensor) -> torch.Tensor:
    nb = x.shape[0]
    L, scales = make_q3_quants(_sub_blocks(x, 16), 4)
    scales = scales.reshape(nb, 16)
    max_scale = _first_absmax(scales, 1)
    nz = max_scale != 0
    iscale = torch.div(_f32(-32.0), max_scale)
    codes = _as_int8(nearest_int(iscale[:, None] * scales)).clamp(-32, 31) + 32
    codes = torch.where(nz[:, None], codes, 0)
    d, d_bytes = _fp16(torch.where(nz, torch.div(_ONE, iscale), _ZERO))
    L = _requantize(x.reshape(nb, 16, 16), _from_sub_blocks(L, nb), d[:, None] * (codes - 32).float(), None, -4, 3, 4)
    L = L.reshape(nb, 8, 32)
    hmask = _pack_bits((L > 3).to(torch.int32), 1)
    qs = _pack_bits((L & 3).reshape(nb, 2, 4, 32), 2).reshape(nb, 64)
    low = (codes[:, :8] & 0xF) | ((codes[:, 8:] & 0xF) << 4)
    high = _pack_bits((codes >> 4).reshape(nb, 4, 4), 2)  # byte 8+m: code 4g+m at bits 2g
    return torch.cat([hmask, qs, low.to(torch.uint8), high, d_bytes], 1)


def _quantize_qkx_k(x: torch.Tensor, nmax: int, rmin: float, nstep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared part of Q4_K and Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins. Returns the 16 header
    bytes (d, dmin, 12 scale bytes) and the levels L [nb, 8, 32]."""
    nb = x.shape[0]
    xs = _sub_blocks(x, 32)
    av_x = _sqrtf(_seqsum(xs * xs) / 32)
    L, scales, mins = make_qkx2_quants(xs, av_x + xs.abs(), nmax, rmin, 0.1, nstep, use_mad=False)
    ls, d, d_bytes = _unsigned_scale_codes(scales.reshape(nb, 8), 63, clamp=True)
    lm, dmin, dmin_bytes = _unsigned_scale_codes(mins.reshape(nb, 8), 63, clamp=True)
    L = _requantize(
        x.reshape(nb, 8, 32), _from_sub_blocks(L, nb), d[:, None] * ls.float(), dmin[:, None] * lm.float(), 0, nmax, 0
    )
    packed = torch.cat(
        [
            ls[:, :4] | ((ls[:, 4:] >> 4) << 6),
            lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
            (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4),
        ],
        1,
    ).to(torch.uint8)
    return torch.cat([d_bytes, dmin_bytes, packed], 1), L


def quantize_q4_k(x: torch.Tensor) -> torch.Tensor:
    header, L = _quantize_qkx_k(x, 15, -1.0, 20)
    qs = _pack_bits(L.reshape(-1, 4, 2, 32), 4).reshape(-1, 128)
    return torch.cat([header, qs], 1)


def quantize_q5_k(x: torch.Tensor) -> torch.Tensor:
    header, L = _quantize_qkx_k(x, 31, -0.5, 15)
    qh = _pack_bits((L >> 4), 1)  # bit 2n+h for sub-block 2n+h
    qs = _pack_bits((L & 0xF).reshape(-1, 4, 2, 32), 4).reshape(-1, 128)
    return torch.cat([header, qh, qs], 1)


def quantize_q6_k(x: torch.Tensor) -> torch.Tensor:
    nb = x.shape[0]
    L, scales = make_qx_quants(_sub_blocks(x, 16), 32)
    scales = scales.reshape(nb, 16)
    max_scale = _first_absmax(scales, 1)
    empty = max_scale.abs() < _GROUP_MAX_EPS
    iscale = torch.div(_f32(-128.0), max_scale)
    d, d_bytes = _fp16(torch.div(_ONE, iscale))
    codes = _as_int8(nearest_int(iscale[:, None] * scales).clamp(max=127))
    L = _requantize(x.reshape(nb, 16, 16), _from_sub_blocks(L, nb), d[:, None] * codes.float(), None, -32, 31, 32)
    L = L.reshape(nb, 2, 4, 32)  # halves of 128, quarters of 32
    ql = _pack_bits((L & 0xF).reshape(nb, 2, 2, 2, 32).transpose(2, 3), 4).reshape(nb, 128)
    qh = _pack_bits(L >> 4, 2).reshape(nb, 64)
    out = torch.cat([ql, qh, (codes & 0xFF).to(torch.uint8), d_bytes], 1)
    return torch.where(empty[:, None], 0, out).to(torch.uint8)


def _chunked(fn, chunk_blocks: int):
    """Encode in chunks of blocks: large enough to amortize per-op overhead over the sequential loops, small
    enough for the working tensors (~10 per chunk, 1 MB each at 1024 blocks) to stay in cache."""

    def quantize_blocks(x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float32).reshape(-1, QK_K)
        if x.shape[0] <= chunk_blocks:
            return fn(x)
        return torch.cat([fn(x[i : i + chunk_blocks]) for i in range(0, x.shape[0], chunk_blocks)])

    quantize_blocks.__name__ = fn.__name__
    quantize_blocks.__doc__ = (
        f"float32 [n_blocks, 256] → uint8 [n_blocks, type_size], as llama.cpp's "
        f"{fn.__name__.replace('quantize_', 'quantize_row_').replace('_k', '_K')}_ref."
    )
    return quantize_blocks


KQUANT_QUANTIZERS = {
    GGMLType.Q2_K: _chunked(quantize_q2_k, 1024),
    GGMLType.Q3_K: _chunked(quantize_q3_k, 4096),  # its coordinate descent is 80 small steps per chunk
    GGMLType.Q4_K: _chunked(quantize_q4_k, 1024),
    GGMLType.Q5_K: _chunked(quantize_q5_k, 1024),
    GGMLType.Q6_K: _chunked(quantize_q6_k, 1024),
}

for _type, _fn in KQUANT_QUANTIZERS.items():
    register_quantizer(_type, _fn)
