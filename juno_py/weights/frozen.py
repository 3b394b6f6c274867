"""Frozen quantized linear (CPU streaming): a GGUF weight, or a row range of one, that stays quantized.

`FrozenQuantLinear` owns a view of the tensor's bytes in the file's memory map and an optional frozen
bias. Its matmuls dequantize a bounded block of rows at a time (`chunk_rows`, sized from a scratch budget
in bytes) and multiply each block into its slice of the output, so no `[n_out, n_in]` float weight ever
exists unless a resident cache is asked for. Backward computes only the input gradient, with the same
streaming transpose; the weight is not a Parameter and has no gradient.
"""

from __future__ import annotations

import warnings
from typing import Optional, Union

import numpy as np
import torch
from torch import nn
from torch.autograd.function import once_differentiable

from juno_py.errors import GGUFFormatError, UnsupportedQuantType
from juno_py.gguf import quants

# fp32 bytes of dequantized rows per chunk. 8 MiB holds every SmolLM2 projection in one chunk (one codec
# call, one BLAS call: best at every T we measured, see docs/benchmarks.md) and keeps an 8192-wide layer
# at 256 rows a chunk.
DEFAULT_SCRATCH_BYTES = 8 << 20

# below this many tokens, streaming bf16 compute runs in fp32 instead: casting each decoded block to bf16 is
# one more pass over it, which the faster bf16 matmul repays only from about 16 tokens on (measured on
# SmolLM2 shapes, AVX-512 BF16; at 1 token the bf16 product is no faster at all). A bf16 cache needs no cast
# and always computes in bf16.
BF16_MIN_TOKENS = 16

CACHE_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp32": torch.float32}
COMPUTE_DTYPES = (torch.float32, torch.bfloat16)


def default_chunk_rows(n_in: int, n_out: int, scratch_bytes: int = DEFAULT_SCRATCH_BYTES) -> int:
    """Rows of fp32 dequantized weight that fit in `scratch_bytes` (at least one row, at most the layer)."""
    return max(1, min(n_out, scratch_bytes // (4 * max(n_in, 1))))


def _byte_rows(raw, row_bytes: int, what: str) -> torch.Tensor:
    """The raw bytes as a torch uint8 `[rows, row_bytes]` tensor sharing memory with `raw` (no copy)."""
    if isinstance(raw, torch.Tensor):
        t = raw if raw.dtype == torch.uint8 else raw.view(torch.uint8)
    else:
        arr = np.asarray(raw)
        if arr.dtype != np.uint8:
            arr = arr.view(np.uint8)
        with warnings.catch_warnings():
            # a read-only memory map: torch warns that writing through the tensor is undefined. We never write.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            t = torch.from_numpy(arr)
    if t.numel() % row_bytes:
        raise GGUFFormatError(f"{what or 'frozen linear'}: {t.numel()} bytes are not a whole number of "
                              f"{row_bytes}-byte rows")
    return t.reshape(-1, row_bytes)


class StreamingLinearFn(torch.autograd.Function):
    """`y = x·Wᵀ (+ b)` through a FrozenQuantLinear; backward gives `dx = dy·W` only.

    Saved for backward: nothing but a reference to the layer (its bytes are the weight). Neither x nor
    any dequantized block is kept, so a training step holds no per-layer weight memory.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: "FrozenQuantLinear", bias: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.layer = layer
        ctx.x_dtype = x.dtype
        y = layer._stream_forward(x)
        if bias is not None:
            y += bias.to(y.dtype)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor):
        dx = None
        if ctx.needs_input_grad[0]:
            dx = ctx.layer._stream_transpose(dy).to(ctx.x_dtype)
        return dx, None, None


class FrozenQuantLinear(nn.Module):
    """A frozen `y = x·Wᵀ + b` whose W stays quantized: rows `[0, n_out)` of GGML blocks, each `n_in` wide.

    raw: uint8 `[n_out, bytes_per_row]` (numpy or torch; a memory-map view is kept as it is, never copied
    and never written). bias: a frozen float tensor `[n_out]` or None. `cache="bf16"|"fp32"` keeps the
    dequantized weight resident (memory for speed); `"none"` streams. `compute_dtype=torch.bfloat16` runs
    the matmuls in bf16 (output fp32; below BF16_MIN_TOKENS tokens a streaming layer computes in fp32); fp32
    is exact to the dequantized values. Outputs are float32 (float64 for float64 inputs, which gradient checks
    use). Rows per block: `chunk_rows`, or as many fp32 rows as fit in `scratch_bytes`.

    The raw bytes, bias and cache are non-persistent buffers (never in a state_dict); the module refuses to
    be pickled or deep-copied, which would copy the mapped weight.
    """

    def __init__(self, raw, ggml_type: int, n_in: int, bias: Optional[torch.Tensor] = None, *,
                 chunk_rows: Optional[int] = None, scratch_bytes: int = DEFAULT_SCRATCH_BYTES,
                 cache: str = "none", compute_dtype: torch.dtype = torch.float32, name: str = ""):
        super().__init__()
        codec = quants.get_codec(ggml_type, name)
        if n_in <= 0 or n_in % codec.block_size:
            raise UnsupportedQuantType(f"{name or codec.name}: row length {n_in} is not a positive multiple of "
                                       f"the {codec.name} block size {codec.block_size}")
        if cache not in CACHE_DTYPES:
            raise ValueError(f"{name or 'frozen linear'}: cache {cache!r}, expected one of {', '.join(CACHE_DTYPES)}")
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"{name or 'frozen linear'}: compute_dtype {compute_dtype}, expected torch.float32 "
                             f"or torch.bfloat16")
        self.name = name
        self._ggml_type = int(ggml_type)
        self._n_in = int(n_in)
        # non-persistent buffers: they follow .to(device) but never enter a state_dict (adapters only)
        self.register_buffer("raw", _byte_rows(raw, codec.row_bytes(n_in), name), persistent=False)
        n_out = self._n_out = self.raw.shape[0]
        if bias is not None:
            bias = bias.detach().reshape(-1).to(torch.float32)
            if bias.numel() != n_out:
                raise ValueError(f"{name or 'frozen linear'}: bias has {bias.numel()} values, expected {n_out}")
        self.register_buffer("bias", bias, persistent=False)
        self.chunk_rows = default_chunk_rows(n_in, n_out, scratch_bytes) if chunk_rows is None else int(chunk_rows)
        if self.chunk_rows < 1:
            raise ValueError(f"{name or 'frozen linear'}: chunk_rows must be at least 1, got {chunk_rows}")
        self.cache = cache
        self.compute_dtype = compute_dtype
        self._row_norms_sq: Optional[torch.Tensor] = None
        self.register_buffer("weight_cache", None, persistent=False)
        if CACHE_DTYPES[cache] is not None:
            self.weight_cache = self._dequantize_all(CACHE_DTYPES[cache])

    @classmethod
    def from_gguf(cls, gguf_file, tensor_name: str, rows: Optional[slice] = None,
                  bias: Union[torch.Tensor, str, None] = None, **kw) -> "FrozenQuantLinear":
        """The 2-D tensor `tensor_name` of an open GGUFFile, or the row range `rows` of it (a fused
        `attn_qkv` or gate/up tensor split into logical targets). `bias` is a tensor (the whole tensor's
        bias or the range's) or the name of a bias tensor in the file; it is sliced to `rows` as needed."""
        info = gguf_file.tensor(tensor_name)
        if len(info.shape) != 2:
            raise GGUFFormatError(f"{gguf_file.path}: tensor {tensor_name!r} has shape {info.shape}, "
                                  f"expected a 2-D weight (n_out, n_in)")
        n_rows = info.shape[0]
        start, stop, step = (rows or slice(0, n_rows)).indices(n_rows)
        if step != 1 or stop <= start:
            raise ValueError(f"tensor {tensor_name!r}: row range {rows} of {n_rows} rows is empty or not contiguous")
        if isinstance(bias, str):
            bias = gguf_file.dequantize(bias)
        if bias is not None:
            bias = bias.reshape(-1)
            if bias.numel() == n_rows and stop - start != n_rows:
                bias = bias[start:stop]
            elif bias.numel() != stop - start:
                raise ValueError(f"tensor {tensor_name!r}: bias has {bias.numel()} values, expected {n_rows} (whole "
                                 f"tensor) or {stop - start} (rows {start}:{stop})")
        if "name" not in kw:
            kw["name"] = tensor_name if stop - start == n_rows else f"{tensor_name}[{start}:{stop}]"
        return cls(gguf_file.raw_rows(tensor_name, slice(start, stop)), info.ggml_type, info.shape[1], bias, **kw)

    # ---- shape and type -------------------------------------------------------------------------------------
    @property
    def in_features(self) -> int:
        return self._n_in

    @property
    def out_features(self) -> int:
        return self._n_out

    @property
    def ggml_type(self) -> int:
        return self._ggml_type

    # ---- dequantized rows -----------------------------------------------------------------------------------
    def dequantize_rows(self, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `[start, stop)` of W decoded from the bytes (exact: never from a bf16 cache), `[stop-start, n_in]`."""
        w = quants.dequantize(self._ggml_type, self.raw[start:stop], self._n_in, what=self.name)
        return w if dtype == torch.float32 else w.to(dtype)

    def _dequantize_all(self, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(self._n_out, self._n_in, dtype=dtype, device=self.raw.device)
        for a, b, w in self._blocks(torch.float32, exact=True):
            out[a:b] = w
            del w
        return out

    def _blocks(self, dtype: torch.dtype, exact: bool = False):
        """Yield `(start, stop, rows of W in dtype)` covering `[0, n_out)`, one block at a time.

        A resident cache of the right dtype is one block; otherwise blocks of `chunk_rows` rows are decoded
        (or sliced from the cache) and converted into one scratch buffer reused by the whole call. A caller
        drops its reference to a block before asking for the next, so only one block is ever alive.
        `exact`: decode from the bytes even when a cache exists.
        """
        n_out, step = self._n_out, self.chunk_rows
        cache = None if exact else self.weight_cache
        if cache is not None and cache.dtype == dtype:
            yield 0, n_out, cache
            return
        scratch = None
        for a in range(0, n_out, step):
            b = min(a + step, n_out)
            w = cache[a:b] if cache is not None else self.dequantize_rows(a, b)
            if w.dtype != dtype:
                # fp32 decode needs no conversion: the codec's output is the block's buffer
                if scratch is None:
                    scratch = torch.empty(min(step, n_out), self._n_in, dtype=dtype, device=w.device)
                w = scratch[: b - a].copy_(w)
            yield a, b, w
            del w

    def _matmul_dtype(self, x: torch.Tensor, tokens: int) -> torch.dtype:
        if x.dtype == torch.float64:
            return torch.float64
        if self.compute_dtype == torch.bfloat16 and (tokens >= BF16_MIN_TOKENS or self.cache == "bf16"):
            return torch.bfloat16
        return torch.float32

    def _operands(self, t: torch.Tensor, n_from: int, n_to: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        """`t [..., n_from]` as a matrix in the matmul dtype, and the empty output `[tokens, n_to]` (fp32, or
        fp64 for fp64 inputs)."""
        if t.shape[-1] != n_from:
            raise ValueError(f"{self.name or 'frozen linear'}: {what} has {t.shape[-1]} features, expected {n_from}")
        t2 = t.reshape(-1, n_from)
        dtype = self._matmul_dtype(t, t2.shape[0])
        out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        return t2.to(dtype), torch.empty(t2.shape[0], n_to, dtype=out_dtype, device=t.device)

    # ---- streaming matmuls (no autograd) --------------------------------------------------------------------
    def _stream_forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x·Wᵀ` for x `[..., n_in]`: each block of rows of W multiplies into its column slice of the output."""
        xc, out = self._operands(x, self._n_in, self._n_out, "input")
        for a, b, w in self._blocks(xc.dtype):
            if xc.dtype == out.dtype:
                torch.mm(xc, w.t(), out=out[:, a:b])  # BLAS writes the column slice in place (ldc = n_out)
            else:
                out[:, a:b] = torch.mm(xc, w.t())  # bf16 products, widened to fp32
            del w
        return out.reshape(*x.shape[:-1], self._n_out)

    def _stream_transpose(self, g: torch.Tensor) -> torch.Tensor:
        """`g·W` for g `[..., n_out]` (the adjoint of `_stream_forward`), accumulated block by block in fp32."""
        gc, out = self._operands(g, self._n_out, self._n_in, "gradient")
        for a, b, w in self._blocks(gc.dtype):
            if gc.dtype != out.dtype:
                part = torch.mm(gc[:, a:b], w)  # bf16 per block, summed across blocks in fp32
                if a == 0:
                    out.copy_(part)
                else:
                    out += part
            elif a == 0:
                torch.mm(gc[:, a:b], w, out=out)
            else:
                torch.addmm(out, gc[:, a:b], w, out=out)
            del w
        return out.reshape(*g.shape[:-1], self._n_in)

    # ---- public matmuls -------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._apply_fn(x, self.bias)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`x·Wᵀ` without the bias (autograd: input gradient only). DoRA's factored norm takes
        `U = W·Aᵀ = layer.matmul(A).T` for its r rows of A: no separate method is needed."""
        return self._apply_fn(x, None)

    def _apply_fn(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return StreamingLinearFn.apply(x, self, bias)
        # no graph to record (inference, or an input that needs no gradient): skip the Function's overhead
        y = self._stream_forward(x)
        return y if bias is None else y.add_(bias)

    def matmul_transposed(self, g: torch.Tensor) -> torch.Tensor:
        """`g·W` for g `[..., n_out]` → `[..., n_in]` (what backward runs; no autograd)."""
        return self._stream_transpose(g)

    def row_norms_sq(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Squared L2 norms of the exact dequantized rows `[n_out]` (fp64 arithmetic, computed once, kept in fp64;
        returned as `dtype`)."""
        if self._row_norms_sq is None:
            out = torch.empty(self._n_out, dtype=torch.float64, device=self.raw.device)
            for a, b, w in self._blocks(torch.float32, exact=True):
                out[a:b] = w.to(torch.float64).square().sum(dim=1)
                del w
            self._row_norms_sq = out
        return self._row_norms_sq.to(dtype)

    # ---- housekeeping ---------------------------------------------------------------------------------------
    def extra_repr(self) -> str:
        name = f"{self.name}, " if self.name else ""
        return (f"{name}in_features={self.in_features}, out_features={self.out_features}, "
                f"type={quants.get_codec(self._ggml_type).name}, bias={self.bias is not None}, cache={self.cache}, "
                f"compute_dtype={str(self.compute_dtype).removeprefix('torch.')}, chunk_rows={self.chunk_rows}")

    def __reduce_ex__(self, protocol):
        raise TypeError(f"FrozenQuantLinear {self.name!r} views a memory-mapped GGUF file and is never pickled or "
                        f"copied: save the adapters (their state_dict), and reload the base from its GGUF")


def scratch_bytes_for(layer: FrozenQuantLinear) -> int:
    """fp32 bytes one dequantized chunk of `layer` occupies: the unit the memory bound is stated in."""
    return 4 * min(layer.chunk_rows, layer.out_features) * layer.in_features


__all__ = ["FrozenQuantLinear", "StreamingLinearFn", "DEFAULT_SCRATCH_BYTES", "BF16_MIN_TOKENS",
           "default_chunk_rows", "scratch_bytes_for"]
