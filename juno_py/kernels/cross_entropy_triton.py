"""Fused Triton kernel for a chunk of the training loss: per-row cross-entropy of logits z `[n, V]` and its gradient
softmax(z) − onehot(target), written in z's dtype (into z's own buffer when the caller allows it).

Its eager reference is `juno_py.kernels.reference.cross_entropy_grad_eager`; `docs/kernels.md` states the numerics.
One program per row reads the row twice: an online maximum and sum of exponentials over blocks of the vocabulary,
then the gradient. fp32 arithmetic for bf16 and fp32 logits; a bf16 gradient is rounded to nearest even with
integer operations (`dora_triton._store`), so Triton's interpreter writes the bits the GPU writes. No atomics and no
host synchronisation: the loss sum is torch's sum of the per-row buffer, and a CUDA graph can capture the launch.

Imported only when a fused path runs (it imports triton; `@triton.jit` reads TRITON_INTERPRET when it runs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from juno_py.kernels.dora_triton import FUSED_DTYPES, INTERPRETED, _launch, _out_arg, _store
from juno_py.kernels.launch import cdiv, next_pow2

# Columns a program step and warps a program. Not swept on the H200 yet: 4096 columns over 8 warps is 16 values a
# thread per block, little register pressure, and 1046 rows × 128256 columns make 1046 programs of 32 blocks.
BLOCK = 4096
NUM_WARPS = 8
# the tiled head's kernel (`online_tile`): columns a program step and warps a program. On an H100 at 4096 rows of
# bf16 logits: 8192 columns 64 µs (3.1 TB/s read twice and written once; the best of 2 to 16 warps and 1024 to 8192
# columns a step took 62), 16384 columns 111 µs (the best)
TILE_BLOCK = 2048
TILE_WARPS = 8


@triton.jit
def _cross_entropy_kernel(
    z_ptr,
    t_ptr,
    loss_ptr,
    g_ptr,
    V,
    stride_zr,
    stride_zc,
    stride_gr,
    stride_gc,
    ignore_index,
    G_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """Row `program_id`: loss = M + log S − z_t with M = max z, S = Σ exp(z − M) (0 on an ignored row, NaN for a
    target outside [0, V)), and g = exp(z − M)/S − [col == t] (0 on an ignored row). BLOCKS (constexpr) blocks of
    BLOCK columns: a compile-time loop bound, as Triton 3.6's interpreter needs."""
    row = tl.program_id(0)
    t = tl.load(t_ptr + row)
    valid = t != ignore_index
    z_row = z_ptr + row.to(tl.int64) * stride_zr
    lanes = tl.arange(0, BLOCK)
    read_to = tl.where(valid, V, 0)  # the columns read: none on an ignored row (its loads are masked off)
    # pass 1: each lane keeps its own running maximum m and sum s = Σ exp(x − m), with one exponential per value and
    # no reduction inside the loop: a value above the lane's maximum rescales its sum by exp(m − x) and adds 1, any
    # other adds exp(x − m); either way the exponential is exp(−|x − m|). m starts at the lowest finite fp32 value,
    # so a -inf value (masked lanes, ignored rows, a masked vocabulary) adds exp(-inf) = 0 instead of a NaN.
    m = tl.full([BLOCK], -3.4028234663852886e38, tl.float32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    for b in range(BLOCKS):
        cols = b * BLOCK + lanes
        x = tl.load(z_row + cols * stride_zc, mask=cols < read_to, other=float("-inf")).to(tl.float32)
        e = tl.exp(-tl.abs(x - m))
        up = x > m
        s = tl.where(up, s * e + 1.0, s + e)
        m = tl.maximum(m, x)
    M = tl.max(m, axis=0)
    S = tl.sum(s * tl.exp(m - M), axis=0)  # a lane that saw no finite value has s = 0
    S = tl.where(valid, S, 1.0)  # an ignored row's S is 0: keep log and 1/S finite (they are not used)
    in_range = (t >= 0) & (t < V)
    z_t = tl.load(z_row + tl.where(in_range, t, 0) * stride_zc, mask=valid & in_range, other=0.0).to(tl.float32)
    loss = tl.where(in_range, M + tl.log(S) - z_t, float("nan"))
    tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))
    # pass 2: the gradient, written over the row (possibly z's own: each value is read before it is written). An
    # ignored row reads -inf everywhere and has 1/S = 0: its p is 0, and no column is its target.
    inv = tl.where(valid, tl.math.div_rn(1.0, S), 0.0)
    hit = tl.where(valid & in_range, t, -1).to(tl.int32)  # the target column (32-bit: cols are), -1 for none
    g_row = g_ptr + row.to(tl.int64) * stride_gr
    for b in range(BLOCKS):
        cols = b * BLOCK + lanes
        x = tl.load(z_row + cols * stride_zc, mask=cols < read_to, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - M) * inv
        _store(g_row + cols * stride_gc, tl.where(cols == hit, p - 1.0, p), cols < V, G_BF16)


def cross_entropy_grad(
    z: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, in_place: bool = False, block: int = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-row loss fp32 `[n]`, gradient in z's dtype `[n, V]`) of logits z `[n, V]` (bf16 or fp32, any strides)
    and int64 targets `[n]`. `in_place`: the gradient overwrites z (and is z); else it goes to a new buffer.
    `block`: columns a program step (a power of two; tests use small ones to exercise many blocks)."""
    if z.dim() != 2 or z.dtype not in FUSED_DTYPES:
        raise ValueError(
            f"fused cross-entropy: logits are {tuple(z.shape)} {z.dtype}, expected a 2-D float32 or bfloat16 tensor"
        )
    n, V = z.shape
    if targets.shape != (n,):
        raise ValueError(f"fused cross-entropy: {tuple(targets.shape)} targets for {n} rows of logits")
    if not INTERPRETED and z.device.type != "cuda":
        raise ValueError("fused cross-entropy: CPU tensors run only under TRITON_INTERPRET=1")
    targets = targets.to(device=z.device, dtype=torch.int64).contiguous()
    grad = z if in_place else torch.empty(n, V, dtype=z.dtype, device=z.device)
    loss = torch.empty(n, dtype=torch.float32, device=z.device)
    if V == 0:
        raise ValueError("fused cross-entropy: logits over an empty vocabulary")
    if n == 0:
        return loss, grad
    block = min(block, next_pow2(V))
    _launch(
        _cross_entropy_kernel,
        (n,),
        (z, targets, loss, _out_arg(grad), V, *z.stride(), *grad.stride(), int(ignore_index)),
        NUM_WARPS if block >= 1024 else 4,
        G_BF16=grad.dtype == torch.bfloat16,
        BLOCK=block,
        BLOCKS=cdiv(V, block),
    )
    return loss, grad


@triton.jit
def _capped(x, cap, CAP: tl.constexpr):
    """(c, dc/dx) of fp32 logits x under the soft cap c = cap·tanh(x/cap) (CAP), else (x, 1). tanh and its slope
    1 − tanh² from one exponential that never overflows, e = e^(−2|u|) with u = x/cap: sign(u)·(1 − e)/(1 + e) and
    4e/(1 + e)², the slope without the cancellation of 1 − tanh² where tanh is near ±1."""
    if CAP:
        u = x / cap
        e = tl.exp(-2.0 * tl.abs(u))
        r = (1.0 - e) / (1.0 + e)
        return cap * tl.where(u < 0, -r, r), 4.0 * e / ((1.0 + e) * (1.0 + e))
    else:
        return x, 1.0


@triton.jit
def _online_tile_kernel(
    z_ptr,
    e_ptr,
    t_ptr,
    m_ptr,
    s_ptr,
    o_ptr,
    zt_ptr,
    dt_ptr,
    scale_ptr,
    R,
    start,
    stride_zr,
    ignore_index,
    cap,
    CAP: tl.constexpr,
    E_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """Row `program_id` of one vocabulary tile (`reference.online_tile_eager` states the arithmetic): the target's
    logit read first, pass 1 the tile's maximum capped logit, pass 2 the exponentials against the new running
    maximum written over the row (0 at the target's column, times dc/dz under a cap) and summed, then the row's
    running state updated."""
    row = tl.program_id(0)
    t = tl.load(t_ptr + row)
    valid = t != ignore_index
    inside = valid & (t >= start) & (t < start + R)
    hit = tl.where(inside, t - start, -1).to(tl.int32)
    z_row = z_ptr + row.to(tl.int64) * stride_zr
    e_row = e_ptr + row.to(tl.int64) * stride_zr  # z's own buffer (bf16 through an int16 view)
    lanes = tl.arange(0, BLOCK)
    read_to = tl.where(valid, R, 0)
    z_t = tl.load(z_row + tl.where(inside, hit, 0), mask=inside, other=0.0).to(tl.float32)
    c_t, d_t = _capped(z_t, cap, CAP)
    mx = tl.full([BLOCK], -3.4028234663852886e38, tl.float32)
    for b in range(BLOCKS):
        cols = b * BLOCK + lanes
        ok = cols < read_to
        x, _ = _capped(tl.load(z_row + cols, mask=ok, other=0.0).to(tl.float32), cap, CAP)
        mx = tl.maximum(mx, tl.where(ok, x, -3.4028234663852886e38))
    m_old = tl.load(m_ptr + row)
    m_new = tl.maximum(m_old, tl.max(mx, axis=0))
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for b in range(BLOCKS):
        cols = b * BLOCK + lanes
        ok = cols < read_to
        x, d = _capped(tl.load(z_row + cols, mask=ok, other=0.0).to(tl.float32), cap, CAP)
        e = tl.exp(tl.where(ok & (cols != hit), x - m_new, -3.4028234663852886e38))  # 0 off the row and at t
        total += e
        if CAP:
            e = e * d
        _store(e_row + cols, e, cols < R, E_BF16)
    summed = tl.sum(total, axis=0)
    e_t = tl.exp(tl.where(inside, c_t - m_new, -3.4028234663852886e38))
    sc = tl.exp(m_old - m_new)
    tl.store(s_ptr + row, tl.load(s_ptr + row) * sc + summed + e_t)
    tl.store(o_ptr + row, tl.load(o_ptr + row) * sc + summed)
    tl.store(m_ptr + row, m_new)
    tl.store(scale_ptr + row, sc)
    tl.store(zt_ptr + row, tl.where(inside, c_t, tl.load(zt_ptr + row)))
    tl.store(dt_ptr + row, tl.where(inside, d_t, tl.load(dt_ptr + row)))


def online_tile(
    z: torch.Tensor,
    targets: torch.Tensor,
    start: int,
    state: tuple[torch.Tensor, ...],
    ignore_index: int = -100,
    cap: float = 0.0,
    block: int = TILE_BLOCK,
    num_warps: int = 0,
) -> None:
    """`reference.online_tile_eager` in one launch: z `[n, R]` (bf16 or fp32, rows contiguous) overwritten, the six
    fp32 `[n]` state tensors updated in place. `block`: columns a program step (tests use small ones); `num_warps`:
    warps a program (0: TILE_WARPS, 4 below 1024 columns)."""
    if z.dim() != 2 or z.dtype not in FUSED_DTYPES or (z.shape[1] > 1 and z.stride(1) != 1):
        raise ValueError(
            f"tiled cross-entropy: logits are {tuple(z.shape)} {z.dtype} with strides {z.stride()}, expected a 2-D "
            f"float32 or bfloat16 tensor with contiguous rows"
        )
    n, R = z.shape
    if targets.shape != (n,) or any(x.shape != (n,) or x.dtype != torch.float32 for x in state):
        raise ValueError(f"tiled cross-entropy: {n} rows of logits need {n} targets and six float32 [{n}] states")
    if not INTERPRETED and z.device.type != "cuda":
        raise ValueError("tiled cross-entropy: CPU tensors run only under TRITON_INTERPRET=1")
    if n == 0 or R == 0:
        return
    block = min(block, next_pow2(R))
    _launch(
        _online_tile_kernel,
        (n,),
        (z, _out_arg(z), targets, *state, R, int(start), z.stride(0), int(ignore_index), float(cap)),
        num_warps or (TILE_WARPS if block >= 1024 else 4),
        CAP=cap > 0,
        E_BF16=z.dtype == torch.bfloat16,
        BLOCK=block,
        BLOCKS=cdiv(R, block),
    )


__all__ = ["cross_entropy_grad", "online_tile", "BLOCK", "NUM_WARPS"]
