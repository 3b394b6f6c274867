"""Attention of one layer over a batch: which keys each query sees, and the kernel that computes it.

Which keys a query sees is described by `AttentionMask`, built once per forward for each distinct sliding window
and shared by the layers: causality by position, the layer's sliding window, documents (packed rows: a query sees
only keys of its own document; padding tokens are documents of their own) and, for callers that hold one, an
explicit boolean `[B, T, S]` restriction. `attend` picks the kernel in one place (`choose_backend`):

- "causal": rows that are causal by index with no window, documents or cache: SDPA's causal kernels (flash).
- "flex" (CUDA): `torch.nn.attention.flex_attention`, compiled once, with a block mask built from per-block
  summaries of positions and documents (`block_tables`): never a `[T, S]` mask, and blocks no query of a block can
  see are skipped. Block masks that depend only on the shape (causal by index, sliding windows) are cached.
- "varlen" (CUDA, bf16/fp16): packed rows whose documents are contiguous runs of consecutive positions (what
  `--pack` makes), with or without a sliding window: `torch.nn.attention.varlen.varlen_attn` (flash attention over
  the documents laid end to end, `cu_seqlens` from the document ids), the fastest exact path for packed data.
  Otherwise, or where this torch has no such kernel, "flex" serves.
- "dense": SDPA with a boolean `[B, 1, T, S]` mask, on the CPU while `B·T·S` is at most `dense_limit()`, and on
  any device for a handful of queries (decoding) or an explicit mask.
- "chunked": the dense computation over blocks of queries, each recomputed in backward (activation
  checkpointing per block), so memory is O(T · chunk) instead of O(T²): the CPU above the dense limit.

Where this process cannot compile flex_attention (a compiler error from Dynamo, Inductor or Triton for this
model's shapes), the first failure is reported once, as a warning, and the masked paths serve from then on:
"dense" while `B·T·S` is at most `dense_limit()`, else "chunked".

Attention sinks (gpt-oss: one learned logit per head in every softmax's denominator) take their own path
(`_attend_sinks`): on CUDA flex_attention, whose log-sum-exp turns its output into the sinks' by a factor of
sigmoid(lse − sink) per row (`sink_renormalise`); elsewhere, and for decoding, the dense reference
(`sink_attention_dense`: scores `[B, H, T, S]` with the sink as one more softmax column), in blocks of queries
recomputed in backward where `B·H·T·S` passes `dense_limit()`. Neither forms a `[T, S]` mask on a GPU for
training-length rows.

Every backend computes the same function; `tests/models/test_attention.py` checks logits and adapter gradients
of each against the dense reference in float64.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

BACKENDS = ("causal", "varlen", "flex", "dense", "chunked")
BLOCK = 128  # flex_attention's block size (queries and keys)
DECODE_QUERIES = 16  # at most this many queries: a dense mask of [queries, keys] on any device
_settings: dict[str, Any] = {"dense_limit": 1 << 25, "force": None}
_PAD_DOC_Q = -(1 << 62)  # documents of the padding flex reads past the end: never equal to each other's
_PAD_DOC_K = _PAD_DOC_Q + 1


def dense_limit() -> int:
    """Largest `B·T·S` for which the CPU builds a dense mask; above it attention runs in blocks of queries. SDPA's
    CPU kernel keeps only the mask (and a float copy of it) beside O(T) statistics, about 5 bytes an entry: 160 MiB
    at the default limit (a 5792-token row, or 8 rows of 2048), where recomputing blocks would cost more time than
    the memory it saves is worth."""
    return int(_settings["dense_limit"])


@contextlib.contextmanager
def attention_settings(dense_limit: Optional[int] = None, force: Optional[str] = None) -> Iterator[None]:
    """Within the block: another dense limit (B·T·S), and/or every non-causal attention through one backend
    ("dense", "chunked" or "flex")."""
    if force is not None and force not in BACKENDS:
        raise ValueError(f"attention backend is {force!r}: expected one of {', '.join(BACKENDS)}")
    if dense_limit is not None and dense_limit < 1:
        raise ValueError(f"dense_limit is {dense_limit}: expected a positive number of mask entries")
    old = dict(_settings)
    if dense_limit is not None:
        _settings["dense_limit"] = dense_limit
    if force is not None:
        _settings["force"] = force
    try:
        yield
    finally:
        _settings.update(old)


def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:  # pragma: no cover - every supported torch has it
        return False
    return True


def attention_mask(q_pos: Tensor, k_pos: Tensor, window: int = 0, allowed: Optional[Tensor] = None) -> Tensor:
    """Which keys each query may see, bool `[B, 1, T, S]`: causal by position, within `window` positions
    (sliding layers), and inside `allowed` `[B, T, S]` (padding, packed documents) when given.

    A query that may see nothing would turn softmax into NaN; it sees everything instead (its output is garbage
    but finite, and such positions carry no loss).
    """
    delta = q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)
    mask = delta >= 0
    if window:
        mask &= delta < window
    if allowed is not None:
        mask &= allowed.to(mask.device, torch.bool)
    mask |= ~mask.any(-1, keepdim=True)
    return mask.unsqueeze(1)


@dataclass
class AttentionMask:
    """Which keys each query sees in one forward, for layers with sliding window `window` (0: none).

    q_pos `[B, T]`, k_pos `[B, S]`: positions of queries and keys. q_doc/k_doc: document ids (a query sees keys
    of its own document only), or None. allowed `[B, T, S]`: an explicit restriction, or None. by_index: positions
    are the indices (keys 0..S-1, queries S-T..S-1) and there are no documents: causal and sliding masks then
    depend on the shape alone."""

    q_pos: Tensor
    k_pos: Tensor
    window: int = 0
    q_doc: Optional[Tensor] = None
    k_doc: Optional[Tensor] = None
    allowed: Optional[Tensor] = None
    by_index: bool = False
    keep: bool = True  # keep what is built (False for the chunked backend's blocks: rebuilt in backward)
    _made: dict = field(default_factory=dict, repr=False)

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.q_pos.shape[0], self.q_pos.shape[1], self.k_pos.shape[1]

    @property
    def causal(self) -> bool:
        """Plain causal rows: SDPA's is_causal computes exactly this."""
        b, t, s = self.shape
        return self.by_index and t == s and self.allowed is None and (not self.window or self.window >= t)

    def rows(self, a: int, b: int) -> "AttentionMask":
        """The same mask for queries a..b-1 only."""
        return AttentionMask(
            self.q_pos[:, a:b],
            self.k_pos,
            self.window,
            None if self.q_doc is None else self.q_doc[:, a:b],
            self.k_doc,
            None if self.allowed is None else self.allowed[:, a:b],
            False,
            keep=False,
        )

    def dense(self) -> Tensor:
        """bool `[B, 1, T, S]` (see `attention_mask`)."""
        if "dense" not in self._made:
            allowed = self.allowed
            if self.q_doc is not None and self.k_doc is not None:
                same = self.q_doc.unsqueeze(-1) == self.k_doc.unsqueeze(-2)
                allowed = same if allowed is None else same & allowed.to(same.device, torch.bool)
            made = attention_mask(self.q_pos, self.k_pos, self.window, allowed)
            if not self.keep:
                return made
            self._made["dense"] = made
        return self._made["dense"]

    def block_mask(self):
        """flex_attention's BlockMask of this mask (cached for masks that depend only on the shape)."""
        if "block" not in self._made:
            self._made["block"] = _block_mask(self)
        return self._made["block"]


def choose_backend(device: torch.device, mask: Optional[AttentionMask]) -> str:
    """The kernel for this attention: the one place that decides (see the module docstring)."""
    if mask is None or mask.causal:
        return "causal"
    b, t, s = mask.shape
    force = _settings["force"]
    if force is not None and not (force == "flex" and mask.allowed is not None):
        return str(force)
    if mask.allowed is not None or t <= DECODE_QUERIES:
        return "dense" if device.type != "cpu" or b * t * s <= dense_limit() else "chunked"
    if device.type == "cuda" and "varlen" not in _flex_failed and packed_segments(mask) is not None:
        return "varlen"
    if device.type == "cuda" and flex_available():
        return "flex"
    return "dense" if b * t * s <= dense_limit() else "chunked"


def _varlen_kernel() -> Optional[Callable]:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def packed_segments(mask: AttentionMask) -> Optional[tuple[Tensor, int]]:
    """(cu_seqlens int32 `[N + 1]`, longest document) of the rows laid end to end, where every document is one
    contiguous run of consecutive positions (so causality by position is causality by index inside it) and
    queries and keys are the same tokens; else None. Checked once per mask (one host synchronisation), never
    while a CUDA graph is being captured."""
    if "segments" in mask._made:
        return mask._made["segments"]
    made = None
    b, t, s = mask.shape
    if (
        _varlen_kernel() is not None
        and mask.q_doc is not None
        and mask.k_doc is not None
        and mask.allowed is None
        and t == s
        and not (mask.q_pos.is_cuda and torch.cuda.is_current_stream_capturing())
    ):
        doc, pos = mask.q_doc.reshape(-1), mask.q_pos.reshape(-1)
        start = torch.ones_like(doc, dtype=torch.bool)
        start[1:] = doc[1:] != doc[:-1]
        start[::t] = True  # a row starts a document
        consecutive = start[1:] | (pos[1:] == pos[:-1] + 1)
        ordered = mask.q_doc.sort(dim=1).values  # a document that comes back later in its row is not one run
        distinct = int((ordered[:, 1:] != ordered[:, :-1]).sum()) + b
        same = torch.equal(mask.q_doc, mask.k_doc) and torch.equal(mask.q_pos, mask.k_pos)
        starts = start.nonzero().flatten()
        if same and bool(consecutive.all()) and int(starts.numel()) == distinct:
            bounds = torch.cat([starts, starts.new_tensor([b * t])])
            made = (bounds.to(torch.int32), int((bounds[1:] - bounds[:-1]).max()))
    if mask.keep:
        mask._made["segments"] = made
    return made


def _varlen(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, scale: float) -> Optional[Tensor]:
    """`attend` through varlen_attn, or None where this torch's kernel cannot take the call (then flex serves)."""
    import inspect

    fn, segments = _varlen_kernel(), packed_segments(mask)
    if fn is None or segments is None or q.dtype not in (torch.bfloat16, torch.float16) or q.shape[-1] > 256:
        return None
    cu, longest = segments
    b, h, t, d = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    params = inspect.signature(fn).parameters
    kwargs: dict[str, Any] = {"scale": scale}
    if "window_size" in params:
        kwargs["window_size"] = (mask.window - 1 if mask.window else -1, 0)
    elif "is_causal" in params and not mask.window:
        kwargs["is_causal"] = True
    else:
        return None
    qf = q.transpose(1, 2).reshape(b * t, h, d)
    kf = k.transpose(1, 2).reshape(b * t, hkv, d)
    vf = v.transpose(1, 2).reshape(b * t, hkv, dv)
    if hkv != h:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            kf, vf = kf.repeat_interleave(h // hkv, dim=1), vf.repeat_interleave(h // hkv, dim=1)
    out = fn(qf, kf, vf, cu, cu, longest, longest, **kwargs)
    return out.view(b, t, h, dv).transpose(1, 2)


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Optional[AttentionMask],
    scale: float,
    enable_gqa: bool = False,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """Attention of q `[B, H, T, D]` over k, v `[B, Hkv, S, D(v)]`: `[B, H, T, Dv]`. `mask` None: causal by index.
    `sinks` `[H]`: one logit per head added to each softmax's denominator (it takes weight, no value)."""
    if sinks is not None:
        return _attend_sinks(q, k, v, mask, scale, sinks)
    backend = choose_backend(q.device, mask)
    if backend == "causal":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
    assert mask is not None
    if backend == "dense":
        return _sdpa_masked(q, k, v, mask, scale, enable_gqa)
    if backend == "chunked":
        return _chunked(q, k, v, mask, scale, enable_gqa)
    if backend == "varlen":
        try:
            out = _varlen(q, k, v, mask, scale)
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
            if isinstance(e, torch.OutOfMemoryError):
                raise
            _give_up("varlen", e, "varlen_attn cannot take this model's packed rows ({}); flex_attention serves")
            out = None
        if out is not None:
            return out
        backend = "flex"
    if backend == "flex":
        if "flex" not in _flex_failed:
            try:
                return _flex()(q, k, v, block_mask=mask.block_mask(), scale=scale, enable_gqa=enable_gqa)
            except Exception as e:
                if not _is_compile_failure(e):
                    raise
                _give_up(
                    "flex",
                    e,
                    "flex_attention could not be compiled for this model ({}); attention falls back to masked SDPA, "
                    "in blocks of queries where a whole mask would be large",
                )
        b, t, s = mask.shape
        if b * t * s <= dense_limit():
            return _sdpa_masked(q, k, v, mask, scale, enable_gqa)
        return _chunked(q, k, v, mask, scale, enable_gqa)
    raise ValueError(f"attention backend is {backend!r}: expected one of {', '.join(BACKENDS)}")


def _sdpa_masked(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, scale: float, enable_gqa: bool) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense(), scale=scale, enable_gqa=enable_gqa)


def chunk_queries(t: int, s: int, b: int = 1) -> int:
    """Queries per block of the chunked backend: a block's mask holds at most `dense_limit()` entries."""
    return max(1, min(t, dense_limit() // max(1, b * s)))


def _chunked(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, scale: float, enable_gqa: bool) -> Tensor:
    b, t, s = mask.shape
    step = chunk_queries(t, s, b)
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    outs = []
    for a in range(0, t, step):
        rows = mask.rows(a, min(a + step, t))
        qa = q[:, :, a : a + step]
        if grad:  # keep only the inputs; the block's mask and scores are rebuilt in backward
            outs.append(checkpoint(_sdpa_masked, qa, k, v, rows, scale, enable_gqa, use_reentrant=False))
        else:
            outs.append(_sdpa_masked(qa, k, v, rows, scale, enable_gqa))
    return torch.cat(outs, dim=2)


# ----------------------------------------------------------------------------------------------------- sinks
def _by_index(q: Tensor, k: Tensor) -> AttentionMask:
    """The causal-by-index mask of t queries after s - t cached keys."""
    b, t, s = q.shape[0], q.shape[2], k.shape[2]
    k_pos = torch.arange(s, device=q.device).expand(b, s)
    return AttentionMask(k_pos[:, s - t :], k_pos, by_index=True)


def sink_attention_dense(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, scale: float, sinks: Tensor) -> Tensor:
    """The reference: scores `[B, H, T, S]` with the sink logit as one more column of each row's softmax, which
    is dropped before the values. Heads share key heads in groups (GQA) without copying k or v."""
    b, h, t, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    qg = q.view(b, hkv, g, t, d)
    scores = torch.einsum("bkgtd,bksd->bkgts", qg, k) * scale
    allowed = mask.dense().view(b, 1, 1, t, -1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, hkv, g, 1, 1).expand(b, hkv, g, t, 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    y = torch.einsum("bkgts,bksd->bkgtd", probs.to(v.dtype), v)
    return y.reshape(b, h, t, v.shape[-1])


def sink_renormalise(out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """Attention without sinks (`out` `[B, H, T, Dv]`, the log-sum-exp of each row's scores `lse` `[B, H, T]`) to
    attention with them: the sink adds exp(sink) to each denominator Z = exp(lse), so the output is scaled by
    Z / (Z + exp(sink)) = sigmoid(lse - sink)."""
    return out * torch.sigmoid(lse.to(out.dtype) - sinks.to(out.dtype).view(1, -1, 1)).unsqueeze(-1)


def _attend_sinks(
    q: Tensor, k: Tensor, v: Tensor, mask: Optional[AttentionMask], scale: float, sinks: Tensor
) -> Tensor:
    """Attention with sinks: flex_attention with its log-sum-exp on CUDA (`sink_renormalise`), else the dense
    reference, over blocks of queries (each recomputed in backward) where a whole `[B, H, T, S]` would pass
    `dense_limit()`."""
    mask = mask if mask is not None else _by_index(q, k)
    b, t, s = mask.shape
    h = q.shape[1]
    force = _settings["force"]
    use_flex = (
        force in (None, "flex") and q.device.type == "cuda" and flex_available() and mask.allowed is None
    ) and t > DECODE_QUERIES
    if use_flex and "flex" not in _flex_failed:
        try:
            from torch.nn.attention.flex_attention import AuxRequest

            gqa = q.shape[1] != k.shape[1]
            out, aux = _flex()(
                q, k, v, block_mask=mask.block_mask(), scale=scale, enable_gqa=gqa, return_aux=AuxRequest(lse=True)
            )
            return sink_renormalise(out, aux.lse, sinks)  # lse in natural log, differentiable
        except Exception as e:
            if not _is_compile_failure(e):
                raise
            _give_up(
                "flex",
                e,
                "flex_attention could not be compiled for this model ({}); attention with sinks falls back to the "
                "dense computation in blocks of queries",
            )
    if force != "chunked" and b * h * t * s <= dense_limit():
        return sink_attention_dense(q, k, v, mask, scale, sinks)
    step = chunk_queries(t, s, b * h)
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    outs = []
    for a in range(0, t, step):
        rows = mask.rows(a, min(a + step, t))
        qa = q[:, :, a : a + step]
        if grad:
            outs.append(checkpoint(sink_attention_dense, qa, k, v, rows, scale, sinks, use_reentrant=False))
        else:
            outs.append(sink_attention_dense(qa, k, v, rows, scale, sinks))
    return torch.cat(outs, dim=2)


# ------------------------------------------------------------------------------------------------------ flex
_compiled: dict[str, Callable] = {}
_flex_failed: dict[str, str] = {}  # "flex": why compiling it failed in this process (then the masked paths serve)


def _give_up(kernel: str, e: BaseException, message: str) -> None:
    """Record that `kernel` ("flex", "varlen") failed in this process (the other paths serve from now on) and warn
    once with `message`, whose `{}` receives the error's first line."""
    _flex_failed[kernel] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    warnings.warn(message.format(_flex_failed[kernel]), stacklevel=3)


def _is_compile_failure(e: BaseException) -> bool:
    """Whether `e` comes from torch.compile's compiler stack (Dynamo, Inductor, Triton lowering): a kernel this
    process cannot build, not an error of the inputs (out of memory and shape errors are raised as they are)."""
    if isinstance(e, torch.OutOfMemoryError):
        return False
    names = {type(x).__name__ for x in (e, e.__cause__, e.__context__) if x is not None}
    modules = {type(x).__module__ for x in (e, e.__cause__, e.__context__) if x is not None}
    return bool(
        names & {"BackendCompilerFailed", "InductorError", "LoweringException", "NoValidChoicesError"}
        or any(m.startswith(("torch._dynamo", "torch._inductor", "triton")) for m in modules)
    )


def _flex() -> Callable:
    """flex_attention compiled once per process (eager off CUDA: the CPU has no fused backward)."""
    from torch.nn.attention.flex_attention import flex_attention

    if "flex" not in _compiled:
        _compiled["flex"] = torch.compile(flex_attention) if torch.cuda.is_available() else flex_attention
    return _compiled["flex"]


def _pad_to(x: Tensor, n: int, value: Optional[int] = None) -> Tensor:
    """`[B, L]` padded on the right to length n: with `value`, or repeating the last column (None)."""
    extra = n - x.shape[1]
    if extra <= 0:
        return x
    tail = x[:, -1:].expand(-1, extra) if value is None else x.new_full((x.shape[0], extra), value)
    return torch.cat((x, tail), dim=1)


def block_tables(
    q_pos: Tensor,
    k_pos: Tensor,
    window: int = 0,
    q_doc: Optional[Tensor] = None,
    k_doc: Optional[Tensor] = None,
    block: int = BLOCK,
) -> tuple[Tensor, Tensor]:
    """Which (query block, key block) pairs need the mask, and which are entirely visible: bool `[B, Qb, Kb]` each
    (`partial`, `full`, disjoint), from each block's minimum and maximum position and document.

    A pair is skipped (neither) when no query of the block can see a key of it: document ranges that do not meet,
    every key after every query, or every key beyond the window. It is full when both blocks lie in one document,
    every key is at or before every query and within the window, and the key block holds no padding past S.
    Everything else is partial (the mask is evaluated per element). Only tensor operations: no host
    synchronisation, so a CUDA graph can capture it."""
    t, s = q_pos.shape[1], k_pos.shape[1]
    qb, kb = -(-t // block), -(-s // block)

    def ranges(x: Tensor, n: int) -> tuple[Tensor, Tensor]:
        blocks = _pad_to(x, n * block).view(x.shape[0], n, block)
        return blocks.amin(-1), blocks.amax(-1)

    qp_lo, qp_hi = ranges(q_pos, qb)
    kp_lo, kp_hi = ranges(k_pos, kb)
    qp_lo, qp_hi, kp_lo, kp_hi = qp_lo[:, :, None], qp_hi[:, :, None], kp_lo[:, None, :], kp_hi[:, None, :]
    seen = kp_lo <= qp_hi
    full = kp_hi <= qp_lo
    if window:
        seen = seen & (qp_lo - kp_hi < window)
        full = full & (qp_hi - kp_lo < window)
    if q_doc is not None and k_doc is not None:
        qd_lo, qd_hi = ranges(q_doc, qb)
        kd_lo, kd_hi = ranges(k_doc, kb)
        qd_lo, qd_hi, kd_lo, kd_hi = qd_lo[:, :, None], qd_hi[:, :, None], kd_lo[:, None, :], kd_hi[:, None, :]
        seen = seen & (qd_lo <= kd_hi) & (kd_lo <= qd_hi)
        full = full & (qd_lo == qd_hi) & (kd_lo == kd_hi) & (qd_lo == kd_lo)
    if s % block:
        full[:, :, -1] = False  # the last key block runs past S: the mask hides what lies beyond
    full = full & seen
    return seen & ~full, full


def _ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """BlockMask's form of a bool `[B, Qb, Kb]`: counts `[B, 1, Qb]` and the key blocks, listed first, `[B, 1, Qb,
    Kb]` (int32)."""
    counts = blocks.sum(-1, dtype=torch.int32)
    indices = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts.unsqueeze(1), indices.unsqueeze(1)


_SHAPE_MASKS: dict[tuple, Any] = {}
MAX_SHAPE_MASKS = 16


def _block_mask(mask: AttentionMask):
    from torch.nn.attention.flex_attention import BlockMask

    b, t, s = mask.shape
    window, device = mask.window, mask.q_pos.device
    if mask.by_index and mask.q_doc is None:
        key = (t, s, window, device)
        if key in _SHAPE_MASKS:
            return _SHAPE_MASKS[key]
        # the offset (cached keys before the first query) is a tensor: a Python number in the mask function would
        # make the compiled kernel specialise on it, and recompile for every length
        offset = torch.tensor(s - t, device=device)

        def index_mod(b_, h_, q_idx, kv_idx):
            ok = kv_idx <= q_idx + offset
            return ok & (q_idx + offset - kv_idx < window) if window else ok

        q_pos = torch.arange(s - t, s, device=device).unsqueeze(0)
        k_pos = torch.arange(s, device=device).unsqueeze(0)
        partial, full = block_tables(q_pos, k_pos, window)
        made = BlockMask.from_kv_blocks(
            *_ordered(partial), *_ordered(full), BLOCK_SIZE=BLOCK, mask_mod=index_mod, seq_lengths=(t, s)
        )
        if len(_SHAPE_MASKS) >= MAX_SHAPE_MASKS:
            _SHAPE_MASKS.pop(next(iter(_SHAPE_MASKS)))
        _SHAPE_MASKS[key] = made
        return made

    qb, kb = -(-t // BLOCK), -(-s // BLOCK)
    q_pos, k_pos = mask.q_pos, mask.k_pos
    q_doc, k_doc = mask.q_doc, mask.k_doc
    partial, full = block_tables(q_pos, k_pos, window, q_doc, k_doc)
    # the kernels read a whole last block: padded copies, whose padding matches nothing
    qp, kp = _pad_to(q_pos, qb * BLOCK), _pad_to(k_pos, kb * BLOCK)
    if q_doc is not None and k_doc is not None:
        qd, kd = _pad_to(q_doc, qb * BLOCK, _PAD_DOC_Q), _pad_to(k_doc, kb * BLOCK, _PAD_DOC_K)
    else:
        qd = torch.zeros_like(qp)
        kd = _pad_to(torch.zeros_like(k_pos), kb * BLOCK, _PAD_DOC_K)

    def doc_mod(b_, h_, q_idx, kv_idx):
        a, c = qp[b_, q_idx], kp[b_, kv_idx]
        ok = (c <= a) & (qd[b_, q_idx] == kd[b_, kv_idx])
        return ok & (a - c < window) if window else ok

    return BlockMask.from_kv_blocks(
        *_ordered(partial), *_ordered(full), BLOCK_SIZE=BLOCK, mask_mod=doc_mod, seq_lengths=(t, s)
    )


def block_mask_dense(mask: AttentionMask) -> Tensor:
    """What flex_attention computes with `mask.block_mask()`, as a bool `[B, T, S]`: the mask function on partial
    blocks, everything on full blocks, nothing elsewhere. For checking the block tables against `dense()`."""
    bm = mask.block_mask()
    b, t, s = mask.shape
    qb, kb = -(-t // BLOCK), -(-s // BLOCK)
    q_idx = torch.arange(qb * BLOCK, device=mask.q_pos.device)
    k_idx = torch.arange(kb * BLOCK, device=mask.q_pos.device)
    out = torch.zeros(b, qb * BLOCK, kb * BLOCK, dtype=torch.bool, device=mask.q_pos.device)
    for bi in range(b):
        src = min(bi, bm.kv_num_blocks.shape[0] - 1)
        elem = bm.mask_mod(torch.tensor(bi), torch.tensor(0), q_idx[:, None], k_idx[None, :]).expand(
            qb * BLOCK, kb * BLOCK
        )
        for i in range(qb):
            rows = slice(i * BLOCK, (i + 1) * BLOCK)
            for n, num, idx in ((0, bm.kv_num_blocks, bm.kv_indices), (1, bm.full_kv_num_blocks, bm.full_kv_indices)):
                for j in idx[src, 0, i, : int(num[src, 0, i])].tolist():
                    cols = slice(j * BLOCK, (j + 1) * BLOCK)
                    out[bi, rows, cols] = True if n else elem[rows, cols]
    return out[:, :t, :s]


__all__ = [
    "AttentionMask",
    "BACKENDS",
    "attend",
    "attention_mask",
    "attention_settings",
    "block_mask_dense",
    "block_tables",
    "sink_attention_dense",
    "sink_renormalise",
    "choose_backend",
    "packed_segments",
    "dense_limit",
    "flex_available",
]
