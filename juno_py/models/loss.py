"""Cross-entropy over a vocabulary without ever holding `[tokens, vocab]` logits for a whole batch.

The output projection runs on `chunk` positions at a time. When the hidden states need a gradient, each
chunk's gradient is computed right away (the logits of a chunk live only inside its iteration) and kept, the
size of the hidden states; backward only scales it. The gradient with respect to a chunk's logits (softmax minus
the one-hot target) is formed in place in the logits' own buffer, so a chunk costs one `[chunk, vocab]` buffer
where log_softmax and its backward would hold three or four. The projection must hold no trainable parameters (the
output layer and final norm are frozen): their gradients would not be computed.

Two heads go further and never hold a chunk's logits over the whole vocabulary: `LinearHead` (a quantized W
streamed on the CPU) and `TiledHead` (W's bytes on a GPU), both an online softmax over blocks of W's rows.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, ContextManager, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from juno_py.kernels import cross_entropy_grad_, online_tile_
from juno_py.kernels.gemm import addmm_out_, mm_out
from juno_py.kernels.reference import LOWEST


def _mm(a: Tensor, b: Tensor, out_dtype: torch.dtype) -> Tensor:
    """`a @ b` as the frozen linear's own products are: on a CPU, bf16 operands give bf16 products, widened."""
    return mm_out(a, b, out_dtype) if a.is_cuda or a.dtype == out_dtype else torch.mm(a, b).to(out_dtype)


def _chunk_loss(project: Callable[[Tensor], Tensor], h: Tensor, t: Tensor, ignore_index: int) -> Tensor:
    logits = project(h)
    if logits.dtype != torch.float64:
        logits = logits.float()
    return F.cross_entropy(logits, t, ignore_index=ignore_index, reduction="sum")


def _chunk_loss_and_grad(
    project: Callable[[Tensor], Tensor], h: Tensor, t: Tensor, ignore_index: int
) -> tuple[Tensor, Tensor]:
    """The summed cross-entropy of one chunk and its gradient with respect to `h`.

    With the logits z and m = max z per row: the loss is m + log Σ exp(z − m) − z_t, and ∂loss/∂z = softmax(z) −
    onehot(t), zero on ignored rows (`kernels.cross_entropy_grad_`: the fused kernel for fp32/bf16 logits on a GPU,
    the eager reference elsewhere; fp32 arithmetic, fp64 for fp64 logits). The gradient overwrites the logits'
    buffer where nothing else reads it; backward of `project` then maps it to `h`."""
    with torch.enable_grad():
        h = h.detach().requires_grad_(True)
        logits = project(h)
        # overwrite the logits' buffer only where nothing else reads it: not a view of another tensor, and not kept by
        # the op that made it for its backward (a tanh soft-cap keeps its output)
        in_place = logits._base is None and (logits.grad_fn is None or _output_not_saved(logits))
        loss, dz = cross_entropy_grad_(logits.detach(), t, ignore_index, in_place)
        (grad,) = torch.autograd.grad(logits, h, dz)
    return loss.detach(), grad


def _output_not_saved(out: Tensor) -> bool:
    """Whether the op that made `out` keeps no reference to it for backward (it saved its inputs, or nothing)."""
    fn = out.grad_fn
    for name in dir(fn):
        if name.startswith("_saved_") and not name.endswith("_raw"):
            value = getattr(fn, name, None)
            if isinstance(value, Tensor) and value.data_ptr() == out.data_ptr():
                return False
    return True


class LinearHead:
    """An output projection `logits = cap·tanh((x·Wᵀ + b)/cap)` (no cap when `cap` is 0) whose frozen W is read a
    block of rows at a time (`layer._blocks`, a FrozenQuantLinear streaming on the CPU). The loss then never holds a
    `[positions, vocab]` buffer, and W is decoded once per chunk of positions instead of twice (once for the
    logits, once for their gradient)."""

    def __init__(self, layer, cap: float = 0.0):
        self.layer, self.cap = layer, float(cap)

    @property
    def block_rows(self) -> int:
        return self.layer.chunk_rows

    def chunk(self, x: Tensor, t: Tensor, ignore_index: int, want_grad: bool) -> tuple[Tensor, Optional[Tensor]]:
        """The summed cross-entropy of one chunk and its gradient (`_head_chunk`)."""
        return _head_chunk(self, x, t, ignore_index, want_grad)

    def blocks(self, dtype: torch.dtype):
        """`(start, stop, W[start:stop] in dtype, bias slice or None)`, at most `block_rows` rows each."""
        bias, step = self.layer.bias, self.block_rows
        for a, b, w in self.layer._blocks(dtype):
            for a2 in range(a, b, step):  # a resident cache comes as one block: cut it into pieces
                b2 = min(a2 + step, b)
                yield a2, b2, w[a2 - a : b2 - a], None if bias is None else bias[a2:b2]
            del w


def _head_chunk(
    head: LinearHead, x: Tensor, t: Tensor, ignore_index: int, want_grad: bool
) -> tuple[Tensor, Optional[Tensor]]:
    """The summed cross-entropy of one chunk and its gradient with respect to x, in one pass over W's row blocks.

    Online softmax: per position a running maximum m, a running sum s = Σ exp(c − m), the same sum o without the
    target's term, and a running product acc = Σ_{j≠target} (exp(c_j − m) · c′_j)·W_j, all rescaled by
    exp(m_old − m_new) whenever m grows (c: capped logits, c′ their derivative with respect to the uncapped ones,
    1 without a cap). At the end loss = m + log s − c_target and ∂loss/∂x = acc / s − (o / s)·c′_target·W[target]
    (the softmax minus the one-hot target, through the projection), zero on ignored positions. fp32 arithmetic (fp64 for fp64 x); the products in the layer's matmul dtype."""
    layer = head.layer
    out_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    xc, _ = layer._operands(x.detach(), layer.in_features, 0, "hidden states")
    n = x.shape[0]
    valid = t != ignore_index
    m = torch.full((n,), -math.inf, dtype=out_dtype, device=x.device)
    s = torch.zeros(n, dtype=out_dtype, device=x.device)
    other = torch.zeros(n, dtype=out_dtype, device=x.device)  # s without the target's term
    target = torch.zeros(n, dtype=out_dtype, device=x.device)
    acc = torch.zeros(n, layer.in_features, dtype=out_dtype, device=x.device) if want_grad else None
    hit = torch.zeros(n, layer.in_features, dtype=out_dtype, device=x.device) if want_grad else None
    for a, b, w, bias in head.blocks(xc.dtype):
        c = _mm(xc, w.t(), out_dtype)
        if bias is not None:
            c += bias.to(out_dtype)
        if head.cap > 0:
            c.div_(head.cap).tanh_()
            deriv = 1 - c.square() if want_grad else None  # d(cap·tanh(l/cap))/dl
            c.mul_(head.cap)
        inside = valid & (t >= a) & (t < b)
        rows = inside.nonzero().squeeze(1)
        cols = t[rows] - a
        target[rows] = c[rows, cols]
        m_new = torch.maximum(m, c.amax(dim=1))
        rescale = torch.exp(m - m_new)  # 0 on the first block (m = −inf)
        c.sub_(m_new[:, None]).exp_()
        s.mul_(rescale)
        other.mul_(rescale)
        e_target = c[rows, cols]
        s[rows] += e_target
        c[rows, cols] = 0  # the target's term is kept apart: see the gradient below
        s_other = c.sum(dim=1)
        s.add_(s_other)
        other.add_(s_other)
        m = m_new
        if want_grad:
            if head.cap > 0:
                c.mul_(deriv)
            acc.mul_(rescale[:, None]).add_(_mm(c.to(w.dtype), w, out_dtype))
            if rows.numel():
                weight = w[cols].to(out_dtype)
                hit[rows] += weight * (deriv[rows, cols, None] if head.cap > 0 else 1)
        del c, w
    loss = (m + s.log() - target)[valid].sum()
    if not want_grad:
        return loss, None
    # softmax − onehot at the target is e_t/s − 1 = −(Σ of the other terms)/s: formed from that sum, not by
    # subtracting 1 from a probability near 1, which would cancel digits when the model is confident
    grad = acc.div_(s[:, None]).sub_(hit.mul_((other / s)[:, None]))
    grad[~valid] = 0
    return loss, grad.to(x.dtype)


# TiledHead: bytes of one tile's logits (positions × rows of W), and positions a chunk at most. 64 MiB keeps a
# Gemma-3-270M step's loss (262144-token vocabulary, 8 × 512 tokens) at 89 MiB above the forward's activations,
# where the whole decoded W and a [chunk, vocab] buffer took 870, in the same time (tiles of 8192 rows at 4096
# positions: 6.9 ms for the loss and its gradient either way, H100).
HEAD_TILE_BYTES = 64 << 20
HEAD_CHUNK_POSITIONS = 4096
# a tile has at least this many rows per column of W: each tile rescales the [positions, D] fp32 accumulator once,
# which stays a small share of the tile's own traffic (Llama-3-8B's D = 4096: tiles of 16384 rows)
HEAD_ROWS_PER_COLUMN = 4


class TiledHead:
    """The output projection of a model on a GPU (`ResidentQuantLinear`, W's bytes there), for the chunked loss as
    an online softmax over tiles of W's rows: each tile is decoded (or sliced from a resident cache), meets the
    chunk's hidden states in one product, and folds into each position's running maximum and sums
    (`kernels.online_tile_`); the gradient's product with the same tile follows at once. A chunk holds one tile of
    logits and one tile of W instead of `[chunk, vocab]` logits and the whole decoded W, for the same products.
    `cap`: the final logit soft cap (0: none)."""

    def __init__(self, layer, cap: float = 0.0, tile_bytes: int = HEAD_TILE_BYTES):
        self.layer, self.cap, self.tile_bytes = layer, float(cap), int(tile_bytes)

    def tile_rows(self, positions: int, element_size: int) -> int:
        """Rows of W a tile: as many as keep `positions` logits a row within `tile_bytes`, and at least
        HEAD_ROWS_PER_COLUMN per column of W; a multiple of 64 (at least 64, at most the vocabulary)."""
        rows = max(self.tile_bytes // max(1, positions * element_size), HEAD_ROWS_PER_COLUMN * self.layer.in_features)
        return max(1, min(self.layer.out_features, max(64, rows // 64 * 64)))

    def chunk(self, x: Tensor, t: Tensor, ignore_index: int, want_grad: bool) -> tuple[Tensor, Optional[Tensor]]:
        """The summed cross-entropy of one chunk of positions `x` `[n, D]` and, `want_grad`, its gradient with
        respect to x. With m, s, other, z_t, d_t the rows' state after every tile (`reference.online_tile_eager`):
        loss = m + log s − z_t on each supervised row, and ∂loss/∂x = acc/s − (other/s)·d_t·W[t], where acc sums the
        tiles' products of exp(c − m)·dc/dz (the target's column zeroed) with W, each rescaled as m grows: the
        softmax minus the one-hot target through the projection, the target's part formed from the sum of the
        other terms (1 − p_t = other/s) rather than from 1 − p_t. Nothing waits for the device."""
        layer = self.layer
        op = layer.weight_cache.dtype if layer.weight_cache is not None else layer.compute_dtype
        z_dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
        xc = x.detach().to(op)
        n, dev = x.shape[0], x.device
        state = (
            torch.full((n,), LOWEST, dtype=torch.float32, device=dev),  # running maximum
            torch.zeros(n, dtype=torch.float32, device=dev),  # Σ exp(c − m)
            torch.zeros(n, dtype=torch.float32, device=dev),  # the same without the target's term
            torch.zeros(n, dtype=torch.float32, device=dev),  # the target's c
            torch.ones(n, dtype=torch.float32, device=dev),  # the target's dc/dz
            torch.ones(n, dtype=torch.float32, device=dev),  # the last tile's rescaling
        )
        acc = torch.zeros(n, layer.in_features, dtype=torch.float32, device=dev) if want_grad else None
        bias = layer.bias
        step = self.tile_rows(n, z_dtype.itemsize)
        for a in range(0, layer.out_features, step):
            b = min(a + step, layer.out_features)
            w = layer.weight_cache[a:b] if layer.weight_cache is not None else layer.dequantize_rows(a, b, op)
            z = mm_out(xc, w.t(), z_dtype)
            if bias is not None:
                z += bias[a:b].to(z_dtype)
            online_tile_(z, t, a, state, ignore_index, self.cap)
            if acc is not None:
                acc.mul_(state[5].unsqueeze(1))
                addmm_out_(acc, z.to(w.dtype), w)
            del z, w
        m, s, other, zt, dt, _ = state
        valid = t != ignore_index
        vocab = layer.out_features
        outside = valid & ((t < 0) | (t >= vocab))  # a target no tile holds: NaN, as the fused kernel gives
        loss = torch.where(valid, torch.where(outside, math.nan, m + s.log() - zt), 0).sum()
        if acc is None:
            return loss, None
        rows = layer.dequantize_gather(torch.where(valid, t, 0).clamp(0, vocab - 1), op).float()
        grad = acc.div_(s.unsqueeze(1)).sub_(rows.mul_((other / s * dt).unsqueeze(1)))
        return loss, torch.where(valid.unsqueeze(1), grad, 0).to(x.dtype)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        targets: Tensor,
        project,
        chunk: int,
        ignore_index: int,
        head: Optional[LinearHead | TiledHead] = None,
    ) -> Tensor:
        total = torch.zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
        grad = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        for i in range(0, hidden.shape[0], chunk):
            h, t = hidden[i : i + chunk], targets[i : i + chunk]
            if head is not None:
                loss, g = head.chunk(h, t, ignore_index, grad is not None)
                if g is not None:
                    grad[i : i + chunk] = g
                total += loss
                continue
            if grad is None:
                total += _chunk_loss(project, h, t, ignore_index)
                continue
            loss, grad[i : i + chunk] = _chunk_loss_and_grad(project, h, t, ignore_index)
            total += loss
        ctx.save_for_backward(grad if grad is not None else hidden.new_empty(0))
        return total

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        (grad,) = ctx.saved_tensors
        return grad * grad_output.to(grad.dtype), None, None, None, None, None


def chunked_cross_entropy(
    hidden: Tensor,
    targets: Tensor,
    project: Callable[[Tensor], Tensor],
    chunk: int = 1024,
    ignore_index: int = -100,
    reduction: str = "mean",
    hold: Optional[ContextManager] = None,
    head: Optional[LinearHead | TiledHead] = None,
) -> Tensor:
    """Cross-entropy of `targets` under `project(hidden)` logits, `chunk` positions at a time.

    hidden `[..., D]`, targets `[...]` (positions equal to `ignore_index` carry no loss). `reduction`: "sum", or
    "mean" over the supervised positions (0 when there are none). `hold`: a context entered around all chunks
    (every chunk's forward and gradient run inside it), e.g. the model's `output_decoded()`, which decodes a
    quantized output weight on the GPU once instead of twice per chunk. `head`: the same projection as a
    LinearHead or TiledHead (the model's `loss_head()`), computed block by block in one pass instead of through
    `project`.
    """
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction is {reduction!r}: expected 'sum' or 'mean'")
    if chunk < 1:
        raise ValueError(f"chunk is {chunk}: expected a positive number of positions")
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1).to(hidden.device)
    if targets.shape[0] != hidden.shape[0]:
        raise ValueError(f"{targets.shape[0]} targets for {hidden.shape[0]} hidden states")
    with hold if hold is not None else contextlib.nullcontext():
        total = _ChunkedCrossEntropy.apply(hidden, targets, project, chunk, ignore_index, head)
    if reduction == "sum":
        return total
    return total / (targets != ignore_index).sum().clamp(min=1)
