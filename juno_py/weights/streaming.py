"""CPU streaming backend of `FrozenQuantLinear`: W decoded a bounded block of rows at a time inside each product.

The forward multiplies each block of `chunk_rows` rows into its slice of the output, the transpose accumulates the
blocks' products in fp32, and neither keeps a block once it is used, so no `[n_out, n_in]` float weight exists
unless a resident cache (`cache="bf16"|"fp32"`) is asked for. Decoding runs in the torch codecs.

Up to MATVEC_MAX_TOKENS tokens in fp32 (decoding one token at a time) multiply straight from the quantized bytes
instead, through the native fused dequantize-dot (`juno_py.gguf.quants.native.matvec`): each weight byte is read
once and no float W is written, not even a block of it; the products are the decoded W's within float32 rounding.
Where the native library is unavailable the blocks stream as above.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Optional

import torch

from juno_py import threads
from juno_py.gguf.quants import native
from juno_py.weights.base import ExactProducts, FrozenBase
from juno_py.weights.frozen import FrozenQuantLinear

# below this many tokens, streaming bf16 compute runs in fp32 instead: casting each decoded block to bf16 is
# one more pass over it, which the faster bf16 matmul repays only from about 16 tokens on (SmolLM2 shapes,
# AVX-512 BF16; at 1 token the bf16 product is no faster at all). A bf16 cache needs no cast and always
# computes in bf16.
BF16_MIN_TOKENS = 16
# up to this many tokens an fp32 product runs through the native matvec from the bytes: each token reads the
# quantized W once (under a byte per weight for the 4- to 8-bit types), against 4 bytes per weight for one pass
# over an fp32 cache or a decoded block
MATVEC_MAX_TOKENS = 4


class StreamingQuantLinear(FrozenQuantLinear, resident=False):
    """A FrozenQuantLinear whose bytes are on the CPU: products stream blocks of rows through the torch codecs."""

    def _blocks(self, dtype: torch.dtype, exact: bool = False) -> Iterator[tuple[int, int, torch.Tensor]]:
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
            w = (
                cache[a:b]
                if cache is not None
                else self.dequantize_rows(a, b, dtype if dtype == torch.bfloat16 else torch.float32)
            )
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

    def _operands(
        self, t: torch.Tensor, n_from: int, n_to: int, what: str, exact: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`t [..., n_from]` as a matrix in the matmul dtype, and the empty output `[tokens, n_to]` (fp32, or
        fp64 for fp64 inputs)."""
        if t.shape[-1] != n_from:
            raise ValueError(f"{self.name or 'frozen linear'}: {what} has {t.shape[-1]} features, expected {n_from}")
        t2 = t.reshape(-1, n_from)
        dtype = self._matmul_dtype(t, t2.shape[0], exact)
        out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        return t2.to(dtype), torch.empty(t2.shape[0], n_to, dtype=out_dtype, device=t.device)

    def _dequantize_all(self, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(self._n_out, self._n_in, dtype=dtype, device=self.raw.device)
        for a, b, w in self._blocks(torch.float32, exact=True):
            out[a:b] = w
            del w
        return out

    def _native_product(self, x: torch.Tensor, exact: bool) -> Optional[torch.Tensor]:
        """`x·Wᵀ` `[tokens, n_out]` from the bytes by the native matvec, or None where it does not apply: more than
        MATVEC_MAX_TOKENS tokens, an input or matmul dtype other than fp32 (a bf16 product, or one over a bf16
        cache's rounded W), a type without a kernel, no native library."""
        if x.dtype != torch.float32 or x.shape[-1] != self._n_in or self._ggml_type not in native.MATVEC_TYPES:
            return None
        tokens = x.numel() // self._n_in
        if not 0 < tokens <= MATVEC_MAX_TOKENS or self._matmul_dtype(x, tokens, exact) != torch.float32:
            return None
        if not exact and self.weight_cache is not None and self.weight_cache.dtype != torch.float32:
            return None
        out = torch.empty(tokens, self._n_out, dtype=torch.float32)
        return native.matvec(
            self._ggml_type, self.raw, x.detach().reshape(tokens, self._n_in), out, threads.native_threads()
        )

    def _forward_product(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        """`x·Wᵀ` for x `[..., n_in]`: each block of rows of W multiplies into its column slice of the output (a few
        fp32 tokens: the native matvec from the bytes). `exact`: fp32 operands over W decoded from the bytes,
        whatever the compute dtype and cache."""
        fast = self._native_product(x, exact)
        if fast is not None:
            return fast if x.dim() == 2 else fast.reshape(*x.shape[:-1], self._n_out)
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

    def _transpose_product(self, g: torch.Tensor) -> torch.Tensor:
        """`g·W` for g `[..., n_out]`, accumulated block by block in fp32."""
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

    def _row_norms_sq_exact(self) -> torch.Tensor:
        """fp64 sums of squares of the exact rows, a block at a time."""
        out = torch.empty(self._n_out, dtype=torch.float64, device=self.raw.device)
        for a, b, w in self._blocks(torch.float32, exact=True):
            out[a:b] = w.to(torch.float64).square().sum(dim=1)
            del w
        return out


if TYPE_CHECKING:  # mypy checks that the backend provides both Protocols
    _frozen_base: type[FrozenBase] = StreamingQuantLinear
    _exact_products: type[ExactProducts] = StreamingQuantLinear


# Declared, not only structural: since Python 3.12 a runtime Protocol check looks attributes up statically
# (inspect.getattr_static), which misses nn.Module buffers (`raw`, `bias`, `weight_cache`); mypy checks the
# structure.
FrozenBase.register(StreamingQuantLinear)
ExactProducts.register(StreamingQuantLinear)

__all__ = ["StreamingQuantLinear", "BF16_MIN_TOKENS", "MATVEC_MAX_TOKENS"]
