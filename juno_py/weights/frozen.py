"""Frozen quantized linear: a GGUF weight, or a row range of one, that stays quantized (CPU streaming, GPU resident).

`FrozenQuantLinear` owns a view of the tensor's bytes in the file's memory map and an optional frozen
bias. Its matmuls dequantize a bounded block of rows at a time (`chunk_rows`, sized from a scratch budget
in bytes) and multiply each block into its slice of the output, so no `[n_out, n_in]` float weight ever
exists unless a resident cache is asked for. Backward computes only the input gradient, with the same
streaming transpose; the weight is not a Parameter and has no gradient.

On a GPU (`.to("cuda")` moves the bytes there, still quantized) the same layer decodes tiles with Triton
(`juno_py.kernels.dequant_triton`) into bf16 (or fp32) and multiplies them with cuBLAS: forward by blocks of
rows, transpose by blocks of columns, each product reducing over the whole inner dimension in fp32. For a few
tokens (playback decode) a fused dequantize-matvec kernel reads the bytes once instead. DoRA's training step gets
the base product and U = W·Aᵀ from one decode of each tile (`matmul_with_exact`). Types without a kernel decode
through the torch codecs on the CPU, block by block.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator, Optional, Union

import numpy as np
import torch
from torch import nn
from torch.autograd.function import once_differentiable

from juno_py.errors import GGUFFormatError, UnsupportedQuantType
from juno_py.gguf import quants
from juno_py.kernels import dequant as device_dequant
from juno_py.kernels import split_bf16, split_track
from juno_py.kernels.gemm import addmm_out_, mm_out

# fp32 bytes of dequantized rows per chunk. 8 MiB holds every SmolLM2 projection in one chunk (one codec
# call, one BLAS call: best at every T we measured, see docs/performance.md) and keeps an 8192-wide layer
# at 256 rows a chunk.
DEFAULT_SCRATCH_BYTES = 8 << 20

# below this many tokens, streaming bf16 compute runs in fp32 instead: casting each decoded block to bf16 is
# one more pass over it, which the faster bf16 matmul repays only from about 16 tokens on (measured on
# SmolLM2 shapes, AVX-512 BF16; at 1 token the bf16 product is no faster at all). A bf16 cache needs no cast
# and always computes in bf16.
BF16_MIN_TOKENS = 16

CACHE_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp32": torch.float32}
COMPUTE_DTYPES = (torch.float32, torch.bfloat16)

# Device path. Bytes of one dequantized tile (in the compute dtype): 128 MiB decodes an 8192 × 8192 bf16 W in one
# tile (a 28672-wide one in four), so a step issues few decodes and GEMMs (each launch costs the H200's host 10 to
# 50 µs of CPU). On the H200: a Q4_K DoRA step at 8192→8192, r 384 took 1.36× and
# 1.14× the dense step's time in two runs, against 1.43× with 64 MiB; llama8b-4l's graphed step 59.1 against 61.2 ms.
# A DoRA step holds two such tiles (W's bf16 halves), 256 MiB, beside its activations.
DEFAULT_DEVICE_SCRATCH_BYTES = 128 << 20
# up to this many tokens the fused dequantize-matvec kernel replaces decode-then-multiply (playback decode); measured
# on the H200 by benchmarks/dequant_gpu.py: the matvec is 2-3x faster at 1 token, even at 4, 1.4-2x slower at 8
MATVEC_MAX_TOKENS = 4
# where the decoding runs: "auto" (Triton on CUDA for the types it has, else the torch codecs), "torch" (the
# torch codecs only), "triton" (the Triton kernels on any device: CPU tests run them under TRITON_INTERPRET=1)
DEQUANT_BACKENDS = ("auto", "torch", "triton")


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

    Device path (bytes on a GPU, or `dequant="triton"`): tiles of `device_scratch_bytes` are decoded by Triton
    and multiplied by cuBLAS in `compute_dtype` with fp32 accumulation; bf16 inputs give bf16 outputs, fp32
    inputs fp32 outputs; up to MATVEC_MAX_TOKENS tokens use the fused dequantize-matvec kernel.

    The raw bytes, bias and cache are non-persistent buffers (never in a state_dict); the module refuses to
    be pickled or deep-copied, which would copy the mapped weight.
    """

    def __init__(self, raw, ggml_type: int, n_in: int, bias: Optional[torch.Tensor] = None, *,
                 chunk_rows: Optional[int] = None, scratch_bytes: int = DEFAULT_SCRATCH_BYTES,
                 cache: str = "none", compute_dtype: torch.dtype = torch.float32, name: str = "",
                 dequant: str = "auto", device_scratch_bytes: int = DEFAULT_DEVICE_SCRATCH_BYTES):
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
        if dequant not in DEQUANT_BACKENDS:
            raise ValueError(f"{name or 'frozen linear'}: dequant {dequant!r}, expected one of "
                             f"{', '.join(DEQUANT_BACKENDS)}")
        self.name = name
        self.dequant = dequant
        self.device_scratch_bytes = int(device_scratch_bytes)
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
        """Rows `[start, stop)` of W decoded from the bytes (exact: never from a bf16 cache), `[stop-start, n_in]`,
        on the device of the bytes. bf16 is the exact values rounded to nearest even."""
        return self.dequantize_tile((start, stop), (0, self._n_in), dtype)

    def dequantize_tile(self, rows: tuple[int, int], cols: tuple[int, int],
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W[r0:r1, c0:c1] decoded from the bytes, on the device of the bytes: Triton where it runs, else the
        torch codecs (on the CPU; whole rows decoded, the columns cut from them)."""
        (r0, r1), (c0, c1) = rows, cols
        if self._use_triton():
            if dtype in device_dequant.OUT_DTYPES:
                return device_dequant.dequantize_tile(self.raw, self._ggml_type, self._n_in, rows, cols, dtype)
            return device_dequant.dequantize_tile(self.raw, self._ggml_type, self._n_in, rows, cols).to(dtype)
        raw = self.raw[r0:r1]
        # whole rows in bf16: the codec rounds on its last pass instead of a separate conversion over memory
        direct = dtype if dtype == torch.bfloat16 and (c0, c1) == (0, self._n_in) else torch.float32
        w = quants.dequantize(self._ggml_type, raw.cpu() if raw.device.type != "cpu" else raw, self._n_in,
                              what=self.name, dtype=direct)
        if (c0, c1) != (0, self._n_in):
            w = w[:, c0:c1]
        return w.to(self.raw.device, dtype) if (w.device, w.dtype) != (self.raw.device, dtype) else w

    def _use_triton(self) -> bool:
        """Decode with the Triton kernels: on CUDA (auto) or when forced, for the types they cover."""
        if self.dequant == "torch" or not device_dequant.has_kernel(self._ggml_type):
            return False
        if self.dequant == "auto" and self.raw.device.type != "cuda":
            return False
        if not device_dequant.triton_ready(self.raw.device):
            if self.dequant == "triton":
                raise RuntimeError(f"{self.name or 'frozen linear'}: dequant='triton' needs Triton and a CUDA device "
                                   f"(or TRITON_INTERPRET=1 on the CPU)")
            return False
        return True

    def _on_device_path(self) -> bool:
        """GPU-resident arithmetic: bytes on an accelerator, or the Triton kernels forced (interpreter tests)."""
        return self.raw.device.type != "cpu" or self.dequant == "triton"

    def _dequantize_all(self, dtype: torch.dtype) -> torch.Tensor:
        if self._on_device_path():
            return self.dequantize_rows(0, self._n_out, dtype)
        out = torch.empty(self._n_out, self._n_in, dtype=dtype, device=self.raw.device)
        for a, b, w in self._blocks(torch.float32, exact=True):
            out[a:b] = w
            del w
        return out

    def set_weights_cache(self, cache: str) -> "FrozenQuantLinear":
        """Keep ("bf16", "fp32") or drop ("none") a dequantized copy of W, decoded where the bytes are now (on a
        GPU: by the Triton kernels, after the move, so the copy is never built on the CPU)."""
        if cache not in CACHE_DTYPES:
            raise ValueError(f"{self.name or 'frozen linear'}: cache {cache!r}, expected one of {', '.join(CACHE_DTYPES)}")
        self.cache = cache
        self.weight_cache = None
        if CACHE_DTYPES[cache] is not None:
            self.weight_cache = self._dequantize_all(CACHE_DTYPES[cache])
        return self

    @contextlib.contextmanager
    def decoded(self) -> Iterator["FrozenQuantLinear"]:
        """Inside the block W is decoded once, on the device path in the operands' dtype (`compute_dtype`), and every
        product (forward and transpose) multiplies that copy instead of decoding tiles per call: the chunked loss
        runs the output projection forward and backward once per chunk of positions, which would otherwise
        decode the whole vocabulary's weight twice a chunk. Costs `n_out·n_in` values of memory while it lasts
        (bf16: 1 GiB for a 128256×4096 output). The products are those of the tile path (each reduces over the
        whole inner dimension in fp32). A layer that already keeps a cache, or streams on the CPU, is left as is."""
        if self.weight_cache is not None or not self._on_device_path():
            yield self
            return
        self.weight_cache = self.dequantize_rows(0, self._n_out, self.compute_dtype)
        try:
            yield self
        finally:
            self.weight_cache = None

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
            w = cache[a:b] if cache is not None else \
                self.dequantize_rows(a, b, dtype if dtype == torch.bfloat16 else torch.float32)
            if w.dtype != dtype:
                # fp32 decode needs no conversion: the codec's output is the block's buffer
                if scratch is None:
                    scratch = torch.empty(min(step, n_out), self._n_in, dtype=dtype, device=w.device)
                w = scratch[: b - a].copy_(w)
            yield a, b, w
            del w

    def _matmul_dtype(self, x: torch.Tensor, tokens: int, exact: bool = False) -> torch.dtype:
        if x.dtype == torch.float64:
            return torch.float64
        if exact:
            return torch.float32
        if self.compute_dtype == torch.bfloat16 and (tokens >= BF16_MIN_TOKENS or self.cache == "bf16"):
            return torch.bfloat16
        return torch.float32

    def _operands(self, t: torch.Tensor, n_from: int, n_to: int, what: str,
                  exact: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`t [..., n_from]` as a matrix in the matmul dtype, and the empty output `[tokens, n_to]` (fp32, or
        fp64 for fp64 inputs)."""
        if t.shape[-1] != n_from:
            raise ValueError(f"{self.name or 'frozen linear'}: {what} has {t.shape[-1]} features, expected {n_from}")
        t2 = t.reshape(-1, n_from)
        dtype = self._matmul_dtype(t, t2.shape[0], exact)
        out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        return t2.to(dtype), torch.empty(t2.shape[0], n_to, dtype=out_dtype, device=t.device)

    # ---- device matmuls (GPU resident; no autograd) ---------------------------------------------------------
    def _device_dtypes(self, t: torch.Tensor, exact: bool = False) -> tuple[torch.dtype, torch.dtype]:
        """(dtype of the products' operands, dtype of the result) on the device path: float64 stays float64
        (gradient checks); `exact`: fp32 operands; otherwise the operands are the resident cache's dtype, or
        `compute_dtype`, and the result has the input's dtype when that is bf16 (bf16 activations), else fp32."""
        if t.dtype == torch.float64:
            return torch.float64, torch.float64
        if exact:
            return torch.float32, torch.float32
        op = self.weight_cache.dtype if self.weight_cache is not None else self.compute_dtype
        return op, torch.bfloat16 if t.dtype == torch.bfloat16 else torch.float32

    def _device_step(self, n_other: int, elem: int) -> int:
        return max(1, self.device_scratch_bytes // (elem * max(n_other, 1)))

    def _device_forward(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        if x.shape[-1] != self._n_in:
            raise ValueError(f"{self.name or 'frozen linear'}: input has {x.shape[-1]} features, expected {self._n_in}")
        x2 = x.reshape(-1, self._n_in)
        op, res = self._device_dtypes(x, exact)
        tokens = x2.shape[0]
        cache = self.weight_cache
        if cache is not None and (cache.dtype == op or not exact):
            y = mm_out(x2.to(op), cache.t(), res)
        elif op != torch.float64 and 0 < tokens <= MATVEC_MAX_TOKENS and self._use_triton():
            # x in the compute dtype, as the tile path multiplies it (the kernel widens it to fp32 exactly)
            y = device_dequant.dequant_matvec(self.raw, self._ggml_type, self._n_in, x2.to(op),
                                              round_bf16=op == torch.bfloat16).to(res)
        elif exact and op == torch.float32:
            y = self._device_split_exact(x2)
        else:
            xc = x2.to(op)
            step = self._forward_step(xc)
            y = None
            for a in range(0, self._n_out, step):
                b = min(a + step, self._n_out)
                w = self.dequantize_rows(a, b, op)
                y = self._rows_product(xc, w, y, a, b, res)
                del w
        return y.reshape(*x.shape[:-1], self._n_out)

    def _forward_step(self, xc: torch.Tensor) -> int:
        """Rows of W a forward tile decodes: `device_scratch_bytes` of W in the operands' dtype, in whole 256 rows."""
        return _aligned_step(self._device_step(self._n_in, xc.element_size()), self._n_out)

    def _rows_product(self, xc: torch.Tensor, w: torch.Tensor, y: Optional[torch.Tensor], a: int, b: int,
                      res: torch.dtype) -> torch.Tensor:
        """The forward tile's product x·W[a:b]ᵀ into y's columns a:b (y `[tokens, n_out]` in `res`, made at the first
        tile; the whole product when the tile is all of W). Returns y."""
        if b - a == self._n_out:
            return mm_out(xc, w.t(), res)
        if y is None:
            y = torch.empty(xc.shape[0], self._n_out, dtype=res, device=xc.device)
        if res == xc.dtype:  # cuBLAS writes the column slice in place (ldc = n_out): no copy
            torch.mm(xc, w.t(), out=y[:, a:b])
        else:
            y[:, a:b] = mm_out(xc, w.t(), res)
        return y

    def _device_split_exact(self, x2: torch.Tensor) -> torch.Tensor:
        """x·Wᵀ to fp32 accuracy on bf16 tensor cores (DoRA's U = W·Aᵀ, `matmul_exact`). Each operand is split into
        two bf16 parts, v = v_hi + v_lo with v_hi = bf16(v) and v_lo = bf16(v − v_hi) (together within about 2⁻¹⁷
        of v: a quantized weight needs up to 21 significant bits, a bf16 holds 8), and
        x·Wᵀ ≈ [x_hi; x_lo]·W_hiᵀ (top and bottom halves added) + x_hi·W_loᵀ, leaving out x_lo·W_loᵀ (2⁻¹⁸ of the
        product): two bf16 GEMMs with fp32 accumulation instead of one fp32 GEMM, which runs at about a fifteenth
        of the bf16 rate on an H100/H200 (3.5 ms against 0.7 ms for U at 28672×8192, r = 384)."""
        t = x2.shape[0]
        xs = split_bf16(x2)
        step = _aligned_step(self._device_step(self._n_in, 4), self._n_out)  # an fp32 tile, then its two halves
        y = torch.empty(t, self._n_out, dtype=torch.float32, device=x2.device)
        for a in range(0, self._n_out, step):
            b = min(a + step, self._n_out)
            ws = split_bf16(self.dequantize_rows(a, b, torch.float32))
            rows = b - a
            both = mm_out(xs, ws[:rows].t(), torch.float32)
            torch.add(both[:t], both[t:], out=y[:, a:b])
            y[:, a:b] += mm_out(xs[:t], ws[rows:].t(), torch.float32)
            del ws, both
        return y

    def _fuses_exact(self, x: torch.Tensor, A: torch.Tensor) -> bool:
        """Whether `matmul_with_exact` decodes each tile once for both products: on the Triton device path with bf16
        operands for the base product (compute_dtype bf16, no resident cache), beyond the matvec's token counts,
        and fp32 rows of A. Elsewhere the two products run as `matmul` and `matmul_exact` run them."""
        return (x.dtype != torch.float64 and A.dtype == torch.float32 and A.dim() == 2 and A.shape[0] > 0
                and self.weight_cache is None and self.compute_dtype == torch.bfloat16
                and x.numel() // max(x.shape[-1], 1) > MATVEC_MAX_TOKENS and self._use_triton())

    def _device_forward_with_exact(self, x: torch.Tensor, A: torch.Tensor,
                                   A_split: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                    torch.Tensor]:
        """x·Wᵀ (bf16 operands, as `_device_forward`) and A·Wᵀ to fp32 accuracy from one split decode per tile:
        `dequantize_split_tile` writes W_hi = bf16(W) and W_lo = bf16(W − W_hi) of the tile's rows in one pass, side
        by side in each row of a `[rows, 2·n_in]` buffer, and x·W_hiᵀ is the forward's own tile product (same tiles,
        same GEMMs), while U = A_hi·W_hiᵀ + A_hi·W_loᵀ + A_lo·W_hiᵀ (A split by `split_bf16`; A_lo·W_loᵀ, 2⁻¹⁸ of U,
        left out) takes two GEMMs accumulating in fp32 straight into U's rows: [W_hi | W_lo]·[A_hi | A_hi]ᵀ over
        the concatenated inner dimension, then W_hi·A_loᵀ added (cuBLAS's beta = 1). That is `_device_split_exact`'s
        U without its fp32 tile, its split, its second decode of W and its separate adds. Transient: the two bf16
        halves of one forward tile (2 × `device_scratch_bytes`, what `_device_split_exact` holds too) and
        [A_hi | A_hi] (r × 2·n_in bf16). Returns (x·Wᵀ, U `[r, n_out]` as the transpose of a contiguous
        `[n_out, r]`, the split A): A is split here, when not given, after the first tile's base product is issued,
        so that the GPU starts on the big GEMM without waiting for the split's launches."""
        r = A.shape[0]
        ut = torch.empty(self._n_out, r, dtype=torch.float32, device=x.device)
        parts = {}

        def tile_u(a: int, b: int, hi: torch.Tensor, both: torch.Tensor) -> None:
            if not parts:
                parts["As"] = As = split_bf16(A) if A_split is None else A_split
                parts["A_hi2"] = As[:r].repeat(1, 2)  # [A_hi | A_hi]
            addmm_out_(ut[a:b], both, parts["A_hi2"].t(), beta=0)
            addmm_out_(ut[a:b], hi, parts["As"][r:].t())

        y = self._device_split_tiles(x, A, tile_u)
        return y, ut.t(), parts["As"]

    def _device_forward_with_update(self, x: torch.Tensor, A: torch.Tensor, A_ref: torch.Tensor, ut: torch.Tensor,
                                    return_split: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """`_device_forward_with_exact` for a running U: the same split decode and base product per tile, and
        ut[a:b] += [W_hi | W_lo]·[D | D]ᵀ (one GEMM, cuBLAS's beta = 1) with D = bf16(A − A_ref) (`split_track`,
        which moves A_ref by D). W_hi·D + W_lo·D is W·D to fp32 accuracy (W_lo·D's own rounding is 2⁻⁹ of a term
        2⁻⁹ the size of W·D), so U stays W·A_refᵀ over the exact W; against `_device_forward_with_exact` this is
        two products per tile instead of three, one GEMM instead of two. Returns (x·Wᵀ, `split_bf16(A)` or None)."""
        parts = {}

        def tile_u(a: int, b: int, hi: torch.Tensor, both: torch.Tensor) -> None:
            if not parts:
                parts["As"], parts["D2"] = split_track(A, A_ref, copies=2)  # A's bf16 parts, [D | D]
            addmm_out_(ut[a:b], both, parts["D2"].t())

        y = self._device_split_tiles(x, A, tile_u)
        return y, parts["As"] if return_split else None

    def _device_split_tiles(self, x: torch.Tensor, A: torch.Tensor, tile_u) -> torch.Tensor:
        """x·Wᵀ (bf16 operands, as `_device_forward`) from one split decode per forward tile into a `[rows, 2·n_in]`
        buffer (W_hi and W_lo side by side in each row), calling `tile_u(a, b, W_hi, [W_hi | W_lo])` for rows a:b
        after the tile's base product is issued (the first call, after the first big GEMM: the place to split A)."""
        n_in = self._n_in
        if x.shape[-1] != n_in or A.shape[-1] != n_in:
            raise ValueError(f"{self.name or 'frozen linear'}: inputs have {x.shape[-1]} and {A.shape[-1]} features, "
                             f"expected {n_in}")
        op, res = self._device_dtypes(x)
        xc = x.reshape(-1, n_in).to(op)
        step = self._forward_step(xc)
        pair = torch.empty(min(step, self._n_out), 2, n_in, dtype=torch.bfloat16, device=x.device)  # [hi | lo] rows
        y = None
        for a in range(0, self._n_out, step):
            b = min(a + step, self._n_out)
            hi, lo = device_dequant.dequantize_split_tile(self.raw, self._ggml_type, n_in, (a, b),
                                                          out=pair.transpose(0, 1))
            y = self._rows_product(xc, hi, y, a, b, res)
            tile_u(a, b, hi, pair[:b - a].view(b - a, 2 * n_in))
            del hi, lo
        return y.reshape(*x.shape[:-1], self._n_out)

    def _device_transpose(self, g: torch.Tensor) -> torch.Tensor:
        """`g·W` by blocks of columns of W: every product reduces over all n_out rows at once (fp32 accumulation)."""
        if g.shape[-1] != self._n_out:
            raise ValueError(f"{self.name or 'frozen linear'}: gradient has {g.shape[-1]} features, expected "
                             f"{self._n_out}")
        g2 = g.reshape(-1, self._n_out)
        op, res = self._device_dtypes(g)
        gc = g2.to(op)
        cache = self.weight_cache
        if cache is not None:
            out = mm_out(gc, cache, res)
        else:
            step = _aligned_step(self._device_step(self._n_out, gc.element_size()), self._n_in)
            out = None
            for c in range(0, self._n_in, step):
                d = min(c + step, self._n_in)
                w = self.dequantize_tile((0, self._n_out), (c, d), op)
                if d - c == self._n_in:
                    out = mm_out(gc, w, res)
                else:
                    if out is None:
                        out = torch.empty(g2.shape[0], self._n_in, dtype=res, device=g.device)
                    if res == op:
                        torch.mm(gc, w, out=out[:, c:d])
                    else:
                        out[:, c:d] = mm_out(gc, w, res)
                del w
        return out.reshape(*g.shape[:-1], self._n_in)

    # ---- streaming matmuls (no autograd) --------------------------------------------------------------------
    def _stream_forward(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        """`x·Wᵀ` for x `[..., n_in]`: each block of rows of W multiplies into its column slice of the output.
        `exact`: fp32 operands over W decoded from the bytes, whatever the compute dtype and cache."""
        if self._on_device_path():
            return self._device_forward(x, exact)
        xc, out = self._operands(x, self._n_in, self._n_out, "input", exact)
        for a, b, w in self._blocks(xc.dtype, exact=exact):
            if xc.dtype == out.dtype:
                torch.mm(xc, w.t(), out=out[:, a:b])  # BLAS writes the column slice in place (ldc = n_out)
            else:
                out[:, a:b] = torch.mm(xc, w.t())  # bf16 products, widened to fp32
            del w
        # no view where the shape is already right: the loss overwrites its logits in place, which autograd
        # forbids on a view made inside a custom Function
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self._n_out)

    def _stream_transpose(self, g: torch.Tensor) -> torch.Tensor:
        """`g·W` for g `[..., n_out]` (the adjoint of `_stream_forward`), accumulated block by block in fp32."""
        if self._on_device_path():
            return self._device_transpose(g)
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
        """`x·Wᵀ` without the bias (autograd: input gradient only)."""
        return self._apply_fn(x, None)

    def matmul_exact(self, x: torch.Tensor) -> torch.Tensor:
        """`x·Wᵀ` to fp32 accuracy (fp64 for fp64 x) over W decoded exactly from the bytes, no autograd: DoRA's
        factored norm takes `U = W·Aᵀ = layer.matmul_exact(A).T` for its r rows of A. Streaming on the CPU: fp32
        operands; on the device path: both operands split into two bf16 parts (`_device_split_exact`, about 2⁻¹⁷
        relative). Plain bf16 operands would put errors of about 1e-3 relative into U, and so about 3e-5 into a
        norm that an adapter moves by 1e-3."""
        with torch.no_grad():
            return self._stream_forward(x, exact=True)

    def matmul_with_exact(self, x: torch.Tensor, A: torch.Tensor, A_split: Optional[torch.Tensor] = None,
                          return_split: bool = False):
        """`(x·Wᵀ, A·Wᵀ)`, no bias, no autograd: the base product as `matmul` gives it and A's rows to fp32 accuracy as
        `matmul_exact` gives them. DoRA's training step needs both every step (U = W·Aᵀ for the norm); on the device
        path with bf16 compute each tile of W is decoded once for both (`_device_forward_with_exact`: the base
        product bit-identical to `matmul`'s, U about 2⁻¹⁷ relative), elsewhere the two run one after the other.
        `A_split`: `split_bf16(A)` when the caller has it already (the device path uses it instead of splitting A).
        `return_split`: also return `split_bf16(A)` (A_split if given), computed after the base product is issued
        (DoRA's step needs it for its Gram matrix and bf16(A); the GPU starts on the big GEMM first)."""
        with torch.no_grad():
            if self._fuses_exact(x, A):
                y, u, As = self._device_forward_with_exact(x, A, A_split)
            else:
                y, u, As = self._stream_forward(x), self._stream_forward(A, exact=True), A_split
                if return_split and As is None:
                    As = split_bf16(A)
            return (y, u, As) if return_split else (y, u)

    def matmul_with_update(self, x: torch.Tensor, A: torch.Tensor, A_ref: torch.Tensor, ut: torch.Tensor,
                           return_split: bool = False):
        """x·Wᵀ as `matmul` gives it, and a running U moved to A: `ut` `[n_out, r]` (fp32, contiguous) holds
        W·A_refᵀ for `A_ref` (fp32 `[r, n_in]`) and afterwards holds W·Aᵀ's update by D = bf16(A − A_ref), with
        A_ref moved by D (`kernels.split_track`): to fp32 accuracy over the exact W, within W·(A − A_ref)ᵀ of
        W·Aᵀ, where A − A_ref is what D's rounding left (at most 2⁻⁹ of the step's change of A, carried into the next
        update). No autograd. DoRA's training step calls it where A moved by an optimizer step: on the device path
        (where `matmul_with_exact` fuses) one split decode per tile gives both, with two products of W's size per
        row of A instead of `matmul_with_exact`'s three; elsewhere U is recomputed (`ut` = (A·Wᵀ)ᵀ by
        `matmul_exact`, A_ref = A). `return_split`: also return `split_bf16(A)`, as `matmul_with_exact` does."""
        with torch.no_grad():
            if ut.shape != (self._n_out, A.shape[0]) or ut.dtype != torch.float32 or not ut.is_contiguous():
                raise ValueError(f"{self.name or 'frozen linear'}: running U {tuple(ut.shape)} {ut.dtype}: expected "
                                 f"a contiguous fp32 [{self._n_out}, {A.shape[0]}]")
            if self._fuses_exact(x, A):
                y, As = self._device_forward_with_update(x, A, A_ref, ut, return_split)
            else:
                y = self._stream_forward(x)
                ut.copy_(self._stream_forward(A, exact=True).t())
                A_ref.copy_(A)
                As = split_bf16(A) if return_split else None
            return (y, As) if return_split else y

    def _apply_fn(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return StreamingLinearFn.apply(x, self, bias)
        # no graph to record (inference, or an input that needs no gradient): skip the Function's overhead
        y = self._stream_forward(x)
        return y if bias is None else y.add_(bias.to(y.dtype))

    def matmul_transposed(self, g: torch.Tensor) -> torch.Tensor:
        """`g·W` for g `[..., n_out]` → `[..., n_in]` (what backward runs; no autograd)."""
        return self._stream_transpose(g)

    def row_norms_sq(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Squared L2 norms of the exact dequantized rows `[n_out]`, computed once and kept (returned as `dtype`).
        CPU: fp64 arithmetic. Device path: fp32 sums of the exact fp32 rows, decoded a tile at a time."""
        if self._row_norms_sq is None and self._on_device_path():
            out = torch.empty(self._n_out, dtype=torch.float32, device=self.raw.device)
            step = self._device_step(self._n_in, 4)
            for a in range(0, self._n_out, step):
                b = min(a + step, self._n_out)
                w = self.dequantize_rows(a, b, torch.float32)
                out[a:b] = torch.linalg.vecdot(w, w, dim=1)
                del w
            self._row_norms_sq = out
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
                f"compute_dtype={str(self.compute_dtype).removeprefix('torch.')}, chunk_rows={self.chunk_rows}"
                + (f", dequant={self.dequant}" if self.dequant != "auto" else ""))

    def __reduce_ex__(self, protocol):
        raise TypeError(f"FrozenQuantLinear {self.name!r} views a memory-mapped GGUF file and is never pickled or "
                        f"copied: save the adapters (their state_dict), and reload the base from its GGUF")


def _aligned_step(step: int, n: int) -> int:
    """A tile's rows (or columns) rounded down to a multiple of 256 when it is larger and does not cover all `n`: whole
    blocks of every type (a K-quant super-block is 256 wide), and tile widths cuBLAS multiplies at full speed (an
    odd width such as 1170, from 64 MiB over 28672 columns, made a 28672-wide layer 3× slower)."""
    return step - step % 256 if 256 < step < n else step


def scratch_bytes_for(layer: FrozenQuantLinear) -> int:
    """fp32 bytes one dequantized chunk of `layer` occupies: the unit the memory bound is stated in."""
    return 4 * min(layer.chunk_rows, layer.out_features) * layer.in_features


__all__ = ["FrozenQuantLinear", "StreamingLinearFn", "DEFAULT_SCRATCH_BYTES", "BF16_MIN_TOKENS",
           "DEFAULT_DEVICE_SCRATCH_BYTES", "MATVEC_MAX_TOKENS", "default_chunk_rows", "scratch_bytes_for", "mm_out"]
