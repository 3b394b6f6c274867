"""GPU device-resident backend of `FrozenQuantLinear`: the quantized blocks stay on the device, decoded by Triton.

Tiles of `device_scratch_bytes` are decoded by Triton (`juno_py.kernels.dequant_triton`) into bf16 (or fp32) and
multiplied with cuBLAS: forward by blocks of rows, transpose by blocks of columns, each product reducing over the
whole inner dimension in fp32. For a few tokens (playback decode) a fused dequantize-matvec kernel reads the bytes
once instead. DoRA's training step gets the base product and U = W·Aᵀ from one decode of each tile
(`matmul_with_exact`). Types without a kernel, and `dequant="torch"`, decode through the torch codecs on the CPU,
block by block. `dequant="triton"` runs this backend on CPU bytes too (the Triton interpreter, in tests).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Self, Sequence

import torch

from juno_py.kernels import dequant as device_dequant
from juno_py.kernels import split_bf16, split_track
from juno_py.kernels.gemm import addmm_out_, mm_out
from juno_py.weights.base import ExactProducts, FrozenBase
from juno_py.weights.frozen import FrozenQuantLinear

# up to this many tokens the fused dequantize-matvec kernel replaces decode-then-multiply (playback decode); measured
# on the H200 by benchmarks/dequant_gpu.py: the matvec is 2-3x faster at 1 token, even at 4, 1.4-2x slower at 8
MATVEC_MAX_TOKENS = 4


def _aligned_step(step: int, n: int) -> int:
    """A tile's rows (or columns) rounded down to a multiple of 256 when it is larger and does not cover all `n`: whole
    blocks of every type (a K-quant super-block is 256 wide), and tile widths cuBLAS multiplies at full speed (an
    odd width such as 1170, from 64 MiB over 28672 columns, made a 28672-wide layer 3× slower)."""
    return step - step % 256 if 256 < step < n else step


class ResidentQuantLinear(FrozenQuantLinear, resident=True):
    """A FrozenQuantLinear whose arithmetic stays on the device of its bytes: Triton-decoded tiles and cuBLAS."""

    # ---- decoding -------------------------------------------------------------------------------------------
    def dequantize_tile(
        self, rows: tuple[int, int], cols: tuple[int, int], dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """W[r0:r1, c0:c1] decoded from the bytes, on the device of the bytes: Triton where it runs, else the
        torch codecs (on the CPU; whole rows decoded, the columns cut from them)."""
        if self._use_triton():
            if dtype in device_dequant.OUT_DTYPES:
                return device_dequant.dequantize_tile(self.raw, self._ggml_type, self._n_in, rows, cols, dtype)
            return device_dequant.dequantize_tile(self.raw, self._ggml_type, self._n_in, rows, cols).to(dtype)
        return super().dequantize_tile(rows, cols, dtype)

    def dequantize_gather(self, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `index` of W decoded exactly, on the device of the bytes: Triton where it runs (the rows' bytes
        gathered into a tile of their own), else the torch codecs."""
        if self._use_triton() and dtype in device_dequant.OUT_DTYPES:
            raw = self.raw[index.to(self.raw.device)]
            return device_dequant.dequantize_tile(raw, self._ggml_type, self._n_in, dtype=dtype)
        return super().dequantize_gather(index, dtype)

    def _use_triton(self) -> bool:
        """Decode with the Triton kernels: on CUDA (auto) or when forced, for the types they cover."""
        if self.dequant == "torch" or not device_dequant.has_kernel(self._ggml_type):
            return False
        if self.dequant == "auto" and self.raw.device.type != "cuda":
            return False
        if not device_dequant.triton_ready(self.raw.device):
            if self.dequant == "triton":
                raise RuntimeError(
                    f"{self.name or 'frozen linear'}: dequant='triton' needs Triton and a CUDA device "
                    f"(or TRITON_INTERPRET=1 on the CPU)"
                )
            return False
        return True

    def _dequantize_all(self, dtype: torch.dtype) -> torch.Tensor:
        return self.dequantize_rows(0, self._n_out, dtype)

    @contextlib.contextmanager
    def decoded(self) -> Iterator[Self]:
        """Inside the block W is decoded once, in the operands' dtype (`compute_dtype`), and every
        product (forward and transpose) multiplies that copy instead of decoding tiles per call: the chunked loss
        runs the output projection forward and backward once per chunk of positions, which would otherwise
        decode the whole vocabulary's weight twice a chunk. Costs `n_out·n_in` values of memory while it lasts
        (bf16: 1 GiB for a 128256×4096 output). The products are those of the tile path (each reduces over the
        whole inner dimension in fp32). A layer that already keeps a cache is left as it is."""
        if self.weight_cache is not None:
            yield self
            return
        self.weight_cache = self.dequantize_rows(0, self._n_out, self.compute_dtype)
        try:
            yield self
        finally:
            self.weight_cache = None

    # ---- products (no autograd) -----------------------------------------------------------------------------
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

    def _forward_product(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
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
            y = device_dequant.dequant_matvec(
                self.raw, self._ggml_type, self._n_in, x2.to(op), round_bf16=op == torch.bfloat16, out_dtype=res
            )
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
        assert y is not None  # n_out ≥ 1: the loop ran
        # 2-D x: y itself, not a view of it, so a caller may write over it (the loss's gradient does)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self._n_out)

    def matmul_lora(self, x: torch.Tensor, xa: torch.Tensor, B: torch.Tensor, alpha: float) -> Optional[torch.Tensor]:
        """x·Wᵀ + alpha·xa·Bᵀ (no bias, no autograd) in one launch where the GEMV takes the product (1 to 4 tokens of
        its types, no resident cache, not float64): the LoRA term xa·Bᵀ (xa = x·Aᵀ `[..., r]`, B `[n_out, r]`) is
        added to the frozen product's fp32 sums before they are rounded to the result's dtype. None elsewhere: the
        caller adds the term itself."""
        if torch.is_grad_enabled() and (x.requires_grad or xa.requires_grad or B.requires_grad):
            return None
        tokens = x.numel() // max(x.shape[-1], 1)
        op, res = self._device_dtypes(x)
        if (
            op == torch.float64
            or self.weight_cache is not None
            or x.shape[-1] != self._n_in
            or B.shape[0] != self._n_out
            or not device_dequant.gemv_takes(self._ggml_type, tokens)
            or not self._use_triton()
        ):
            return None
        xa2 = xa.reshape(tokens, xa.shape[-1])
        y = device_dequant.dequant_matvec(
            self.raw,
            self._ggml_type,
            self._n_in,
            x.reshape(tokens, self._n_in).to(op),
            round_bf16=op == torch.bfloat16,
            out_dtype=res,
            lora=(xa2 if xa2.stride(-1) == 1 else xa2.contiguous(), B if B.stride(-1) == 1 else B.contiguous(), alpha),
        )
        return y.reshape(*x.shape[:-1], self._n_out)

    @staticmethod
    def matmul_group(
        linears: Sequence[FrozenQuantLinear],
        x: torch.Tensor,
        loras: Sequence[Optional[tuple[torch.Tensor, torch.Tensor, float]]],
        act: Optional[str] = None,
    ) -> Optional[torch.Tensor]:
        """x·W_iᵀ (+ alpha_i·xa_i·B_iᵀ where loras[i] = (xa_i, B_i, alpha_i) is given) of 2 or 3 linears that read
        x, in one launch (`dequant_matvec_group`; no bias, no autograd): `[..., Σ n_out]`, linear i's columns after
        those of the linears before it, each bit for bit what `matmul_lora` (or `matmul`) gives wherever their GEMV
        runs unsplit. `act` ("silu" or "gelu_tanh"; gate and up, of equal n_out and without
        biases): `[..., n_out]` holding act(gate)·up, the unfused `elementwise_triton.gated_forward` of those two
        products bit for bit. None where the grouped GEMV does not apply (as for `matmul_lora`: 1 to 4 tokens of
        one GEMV type and one n_in, no resident cache, not float64, on the GPU or under the interpreter; and LoRA
        factors of one dtype pair): the caller then runs the linears one by one."""
        if len(loras) != len(linears) or not all(isinstance(m, ResidentQuantLinear) for m in linears):
            return None
        lins = [m for m in linears if isinstance(m, ResidentQuantLinear)]
        terms = [t for t in loras if t is not None]
        if torch.is_grad_enabled() and (
            x.requires_grad or any(t[0].requires_grad or t[1].requires_grad for t in terms)
        ):
            return None
        n_in = x.shape[-1]
        tokens = x.numel() // max(n_in, 1)
        op, res = lins[0]._device_dtypes(x)
        if (
            op == torch.float64
            or any(m._device_dtypes(x) != (op, res) or m.weight_cache is not None or m._n_in != n_in for m in lins)
            or not device_dequant.gemv_group_takes([m._ggml_type for m in lins], [m._n_in for m in lins], tokens)
            or any(t is not None and t[1].shape[0] != m._n_out for m, t in zip(lins, loras))
            or (act is not None and act not in device_dequant.GEMV_GROUP_ACTS)
            or (act is not None and (len(lins) != 2 or lins[0]._n_out != lins[1]._n_out))
            or (act is not None and any(m.bias is not None for m in lins))
            or len({m.raw.device for m in lins} | {x.device}) != 1
            or len({(t[0].dtype, t[1].dtype) for t in terms}) > 1
            or not all(m._use_triton() for m in lins)
        ):
            return None
        parts: list[device_dequant.GroupPart] = []
        for m, term in zip(lins, loras):
            if term is not None:
                xa, B, alpha = term
                xa = xa.reshape(tokens, xa.shape[-1])
                term = (
                    xa if xa.stride(-1) == 1 else xa.contiguous(),
                    B if B.stride(-1) == 1 else B.contiguous(),
                    alpha,
                )
            parts.append((m.raw, m._ggml_type, n_in, term))
        y = device_dequant.dequant_matvec_group(
            parts, x.reshape(tokens, n_in).to(op), round_bf16=op == torch.bfloat16, out_dtype=res, act=act
        )
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def _forward_step(self, xc: torch.Tensor) -> int:
        """Rows of W a forward tile decodes: `device_scratch_bytes` of W in the operands' dtype, in whole 256 rows."""
        return _aligned_step(self._device_step(self._n_in, xc.element_size()), self._n_out)

    def _rows_product(
        self, xc: torch.Tensor, w: torch.Tensor, y: Optional[torch.Tensor], a: int, b: int, res: torch.dtype
    ) -> torch.Tensor:
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
        return (
            x.dtype != torch.float64
            and A.dtype == torch.float32
            and A.dim() == 2
            and A.shape[0] > 0
            and self.weight_cache is None
            and self.compute_dtype == torch.bfloat16
            and x.numel() // max(x.shape[-1], 1) > MATVEC_MAX_TOKENS
            and self._use_triton()
        )

    def _fused_with_exact(
        self, x: torch.Tensor, A: torch.Tensor, A_split: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x·Wᵀ (bf16 operands, as `_forward_product`) and A·Wᵀ to fp32 accuracy from one split decode per tile:
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
        parts: dict[str, torch.Tensor] = {}

        def tile_u(a: int, b: int, hi: torch.Tensor, both: torch.Tensor) -> None:
            if not parts:
                parts["As"] = As = split_bf16(A) if A_split is None else A_split
                parts["A_hi2"] = As[:r].repeat(1, 2)  # [A_hi | A_hi]
            addmm_out_(ut[a:b], both, parts["A_hi2"].t(), beta=0)
            addmm_out_(ut[a:b], hi, parts["As"][r:].t())

        y = self._device_split_tiles(x, A, tile_u)
        return y, ut.t(), parts["As"]

    def _fused_with_update(
        self, x: torch.Tensor, A: torch.Tensor, A_ref: torch.Tensor, ut: torch.Tensor, return_split: bool
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """`_fused_with_exact` for a running U: the same split decode and base product per tile, and
        ut[a:b] += [W_hi | W_lo]·[D | D]ᵀ (one GEMM, cuBLAS's beta = 1) with D = bf16(A − A_ref) (`split_track`,
        which moves A_ref by D). W_hi·D + W_lo·D is W·D to fp32 accuracy (W_lo·D's own rounding is 2⁻⁹ of a term
        2⁻⁹ the size of W·D), so U stays W·A_refᵀ over the exact W; against `_fused_with_exact` this is
        two products per tile instead of three, one GEMM instead of two. Returns (x·Wᵀ, `split_bf16(A)` or None)."""
        parts: dict[str, torch.Tensor] = {}

        def tile_u(a: int, b: int, hi: torch.Tensor, both: torch.Tensor) -> None:
            if not parts:
                parts["As"], parts["D2"] = split_track(A, A_ref, copies=2)  # A's bf16 parts, [D | D]
            addmm_out_(ut[a:b], both, parts["D2"].t())

        y = self._device_split_tiles(x, A, tile_u)
        return y, parts["As"] if return_split else None

    def _device_split_tiles(
        self, x: torch.Tensor, A: torch.Tensor, tile_u: Callable[[int, int, torch.Tensor, torch.Tensor], None]
    ) -> torch.Tensor:
        """x·Wᵀ (bf16 operands, as `_forward_product`) from one split decode per forward tile into a `[rows, 2·n_in]`
        buffer (W_hi and W_lo side by side in each row), calling `tile_u(a, b, W_hi, [W_hi | W_lo])` for rows a:b
        after the tile's base product is issued (the first call, after the first big GEMM: the place to split A)."""
        n_in = self._n_in
        if x.shape[-1] != n_in or A.shape[-1] != n_in:
            raise ValueError(
                f"{self.name or 'frozen linear'}: inputs have {x.shape[-1]} and {A.shape[-1]} features, expected {n_in}"
            )
        op, res = self._device_dtypes(x)
        xc = x.reshape(-1, n_in).to(op)
        step = self._forward_step(xc)
        pair = torch.empty(min(step, self._n_out), 2, n_in, dtype=torch.bfloat16, device=x.device)  # [hi | lo] rows
        y = None
        for a in range(0, self._n_out, step):
            b = min(a + step, self._n_out)
            hi, lo = device_dequant.dequantize_split_tile(
                self.raw, self._ggml_type, n_in, (a, b), out=pair.transpose(0, 1)
            )
            y = self._rows_product(xc, hi, y, a, b, res)
            tile_u(a, b, hi, pair[: b - a].view(b - a, 2 * n_in))
            del hi, lo
        assert y is not None  # n_out ≥ 1: the loop ran
        # 2-D x: y itself, not a view of it, so a caller may write over it (the loss's gradient does)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self._n_out)

    def _transpose_product(self, g: torch.Tensor) -> torch.Tensor:
        """`g·W` by blocks of columns of W: every product reduces over all n_out rows at once (fp32 accumulation)."""
        if g.shape[-1] != self._n_out:
            raise ValueError(
                f"{self.name or 'frozen linear'}: gradient has {g.shape[-1]} features, expected {self._n_out}"
            )
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
        assert out is not None  # n_in ≥ 1: the loop ran
        return out.reshape(*g.shape[:-1], self._n_in)

    def _row_norms_sq_exact(self) -> torch.Tensor:
        """fp32 sums of the exact fp32 rows, decoded a tile at a time."""
        out = torch.empty(self._n_out, dtype=torch.float32, device=self.raw.device)
        step = self._device_step(self._n_in, 4)
        for a in range(0, self._n_out, step):
            b = min(a + step, self._n_out)
            w = self.dequantize_rows(a, b, torch.float32)
            out[a:b] = torch.linalg.vecdot(w, w, dim=1)
            del w
        return out


if TYPE_CHECKING:  # mypy checks that the backend provides both Protocols
    _frozen_base: type[FrozenBase] = ResidentQuantLinear
    _exact_products: type[ExactProducts] = ResidentQuantLinear


# Declared, not only structural: since Python 3.12 a runtime Protocol check looks attributes up statically
# (inspect.getattr_static), which misses nn.Module buffers (`raw`, `bias`, `weight_cache`); mypy checks the
# structure.
FrozenBase.register(ResidentQuantLinear)
ExactProducts.register(ResidentQuantLinear)

__all__ = ["ResidentQuantLinear", "MATVEC_MAX_TOKENS"]
