"""Frozen quantized linear: a GGUF weight, or a row range of one, that stays quantized.

`FrozenQuantLinear` owns a view of the tensor's bytes in the file's memory map and an optional frozen bias, and is
the entry point for both backends: constructing one gives the backend that fits where the bytes are, and moving it
(`.to(device)`, `.cuda()`, a parent module's `.to`) switches it to the backend of the new device.

- `juno_py.weights.streaming.StreamingQuantLinear` (bytes on the CPU): matmuls dequantize a bounded block of rows at
  a time and multiply each block into its slice of the output, so no `[n_out, n_in]` float weight exists unless a
  resident cache is asked for.
- `juno_py.weights.resident.ResidentQuantLinear` (bytes on a GPU, still quantized, or the Triton kernels forced with
  `dequant="triton"`): tiles decoded by Triton and multiplied with cuBLAS, a fused dequantize-matvec for a few
  tokens, and DoRA's base product and U = W·Aᵀ from one decode of each tile.

Backward computes only the input gradient; the weight is not a Parameter and has no gradient. What every backend
provides, and the exact products DoRA asks for, are the Protocols of `juno_py.weights.base`.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, ClassVar, Iterator, Optional, Self, Union

import numpy as np
import torch
from torch import nn
from torch.autograd.function import once_differentiable

from juno_py.errors import GGUFFormatError, UnsupportedQuantType
from juno_py.gguf import quants
from juno_py.kernels import split_bf16

# fp32 bytes of dequantized rows per streaming chunk. 8 MiB holds every SmolLM2 projection in one chunk (one codec
# call, one BLAS call: best at every token count on those shapes) and keeps an 8192-wide layer at 256 rows a chunk.
DEFAULT_SCRATCH_BYTES = 8 << 20

# Device path. Bytes of one dequantized tile (in the compute dtype): 128 MiB decodes an 8192 × 8192 bf16 W in one
# tile (a 28672-wide one in four), so a step issues few decodes and GEMMs (each launch costs the H200's host 10 to
# 50 µs of CPU). On the H200 a Q4_K DoRA step at 8192→8192, r 384 took 1.36× and 1.14× the dense step's time in two
# runs, against 1.43× with 64 MiB; llama8b-4l's graphed step 59.1 against 61.2 ms. A DoRA step holds two such tiles
# (W's bf16 halves), 256 MiB, beside its activations.
DEFAULT_DEVICE_SCRATCH_BYTES = 128 << 20

CACHE_DTYPES: dict[str, Optional[torch.dtype]] = {"none": None, "bf16": torch.bfloat16, "fp32": torch.float32}
COMPUTE_DTYPES = (torch.float32, torch.bfloat16)
# where the decoding runs: "auto" (Triton on CUDA for the types it has, else the torch codecs), "torch" (the
# torch codecs only), "triton" (the Triton kernels on any device: CPU tests run them under TRITON_INTERPRET=1)
DEQUANT_BACKENDS = ("auto", "torch", "triton")

# the backend classes by `resident`, filled as they are defined (`juno_py.weights` imports both)
_BACKENDS: dict[bool, type[FrozenQuantLinear]] = {}


def default_chunk_rows(n_in: int, n_out: int, scratch_bytes: int = DEFAULT_SCRATCH_BYTES) -> int:
    """Rows of fp32 dequantized weight that fit in `scratch_bytes` (at least one row, at most the layer)."""
    return max(1, min(n_out, scratch_bytes // (4 * max(n_in, 1))))


def _byte_rows(raw: Union[torch.Tensor, np.ndarray[Any, Any]], row_bytes: int, what: str) -> torch.Tensor:
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
        raise GGUFFormatError(
            f"{what or 'frozen linear'}: {t.numel()} bytes are not a whole number of {row_bytes}-byte rows"
        )
    return t.reshape(-1, row_bytes)


class StreamingLinearFn(torch.autograd.Function):
    """`y = x·Wᵀ (+ b)` through a FrozenQuantLinear; backward gives `dx = dy·W` only.

    Saved for backward: nothing but a reference to the layer (its bytes are the weight). Neither x nor
    any dequantized block is kept, so a training step holds no per-layer weight memory.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: FrozenQuantLinear, bias: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.layer = layer
        ctx.x_dtype = x.dtype
        y = layer._forward_product(x)
        if bias is not None:
            y += bias.to(y.dtype)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None]:
        dx = None
        if ctx.needs_input_grad[0]:
            dx = ctx.layer._transpose_product(dy).to(ctx.x_dtype)
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

    The instance is always one of the backend subclasses (`resident` says which), chosen at construction and again
    after every device move. The raw bytes, bias and cache are non-persistent buffers (never in a state_dict); the
    module refuses to be pickled or deep-copied, which would copy the mapped weight.
    """

    # whether this backend keeps the arithmetic on the device (GPU resident) rather than streaming on the CPU
    resident: ClassVar[bool]
    raw: torch.Tensor
    bias: Optional[torch.Tensor]
    weight_cache: Optional[torch.Tensor]

    def __init_subclass__(cls, *, resident: bool, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls.resident = resident
        _BACKENDS[resident] = cls

    def __init__(
        self,
        raw: Union[torch.Tensor, np.ndarray[Any, Any]],
        ggml_type: int,
        n_in: int,
        bias: Optional[torch.Tensor] = None,
        *,
        chunk_rows: Optional[int] = None,
        scratch_bytes: int = DEFAULT_SCRATCH_BYTES,
        cache: str = "none",
        compute_dtype: torch.dtype = torch.float32,
        name: str = "",
        dequant: str = "auto",
        device_scratch_bytes: int = DEFAULT_DEVICE_SCRATCH_BYTES,
    ) -> None:
        super().__init__()
        codec = quants.get_codec(ggml_type, name)
        if n_in <= 0 or n_in % codec.block_size:
            raise UnsupportedQuantType(
                f"{name or codec.name}: row length {n_in} is not a positive multiple of "
                f"the {codec.name} block size {codec.block_size}"
            )
        if cache not in CACHE_DTYPES:
            raise ValueError(f"{name or 'frozen linear'}: cache {cache!r}, expected one of {', '.join(CACHE_DTYPES)}")
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"{name or 'frozen linear'}: compute_dtype {compute_dtype}, expected torch.float32 or torch.bfloat16"
            )
        if dequant not in DEQUANT_BACKENDS:
            raise ValueError(
                f"{name or 'frozen linear'}: dequant {dequant!r}, expected one of {', '.join(DEQUANT_BACKENDS)}"
            )
        self.name = name
        self._dequant = dequant
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
        self._bind_backend()
        cache_dtype = CACHE_DTYPES[cache]
        if cache_dtype is not None:
            self.weight_cache = self._dequantize_all(cache_dtype)

    @classmethod
    def from_gguf(
        cls,
        gguf_file: Any,
        tensor_name: str,
        rows: Optional[slice] = None,
        bias: Union[torch.Tensor, str, None] = None,
        **kw: Any,
    ) -> FrozenQuantLinear:
        """The 2-D tensor `tensor_name` of an open GGUFFile, or the row range `rows` of it (a fused
        `attn_qkv` or gate/up tensor split into logical targets). `bias` is a tensor (the whole tensor's
        bias or the range's) or the name of a bias tensor in the file; it is sliced to `rows` as needed."""
        info = gguf_file.tensor(tensor_name)
        if len(info.shape) != 2:
            raise GGUFFormatError(
                f"{gguf_file.path}: tensor {tensor_name!r} has shape {info.shape}, expected a 2-D weight (n_out, n_in)"
            )
        n_rows = info.shape[0]
        start, stop, step = (rows or slice(0, n_rows)).indices(n_rows)
        if step != 1 or stop <= start:
            raise ValueError(f"tensor {tensor_name!r}: row range {rows} of {n_rows} rows is empty or not contiguous")
        values: Optional[torch.Tensor] = gguf_file.dequantize(bias) if isinstance(bias, str) else bias
        if values is not None:
            values = values.reshape(-1)
            if values.numel() == n_rows and stop - start != n_rows:
                values = values[start:stop]
            elif values.numel() != stop - start:
                raise ValueError(
                    f"tensor {tensor_name!r}: bias has {values.numel()} values, expected {n_rows} (whole "
                    f"tensor) or {stop - start} (rows {start}:{stop})"
                )
        if "name" not in kw:
            kw["name"] = tensor_name if stop - start == n_rows else f"{tensor_name}[{start}:{stop}]"
        return cls(gguf_file.raw_rows(tensor_name, slice(start, stop)), info.ggml_type, info.shape[1], values, **kw)

    # ---- backend --------------------------------------------------------------------------------------------
    def _bind_backend(self) -> None:
        """Make this module the backend for where its bytes are now: GPU resident for bytes on an accelerator or the
        Triton kernels forced (interpreter tests), CPU streaming otherwise."""
        resident = self.raw.device.type != "cpu" or self.dequant == "triton"
        cls = _BACKENDS.get(resident)
        if cls is None:
            raise RuntimeError(
                f"{self.name or 'frozen linear'}: the {'resident' if resident else 'streaming'} "
                f"backend is not loaded (import juno_py.weights)"
            )
        if type(self) is not cls:
            self.__class__ = cls

    @property
    def dequant(self) -> str:
        """Where the decoding runs (one of DEQUANT_BACKENDS); setting it rebinds the backend ("triton": resident)."""
        return self._dequant

    @dequant.setter
    def dequant(self, value: str) -> None:
        if value not in DEQUANT_BACKENDS:
            raise ValueError(
                f"{self.name or 'frozen linear'}: dequant {value!r}, expected one of {', '.join(DEQUANT_BACKENDS)}"
            )
        self._dequant = value
        self._bind_backend()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Self:
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]  # torch leaves _apply unannotated
        self._bind_backend()
        return self

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

    def dequantize_tile(
        self, rows: tuple[int, int], cols: tuple[int, int], dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """W[r0:r1, c0:c1] decoded from the bytes, on the device of the bytes, by the torch codecs (on the CPU; whole
        rows decoded, the columns cut from them). The resident backend decodes with Triton where it runs."""
        (r0, r1), (c0, c1) = rows, cols
        return self._codec_rows(self.raw[r0:r1], dtype, (c0, c1))

    def dequantize_gather(self, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `index` of W (a 1-D integer tensor of row numbers, each in `[0, n_out)`) decoded exactly from the
        bytes, `[len(index), n_in]`, on the device of the bytes: the rows' bytes gathered, then decoded as a tile."""
        return self._codec_rows(self.raw[index.to(self.raw.device)], dtype, (0, self._n_in))

    def _codec_rows(self, raw: torch.Tensor, dtype: torch.dtype, cols: tuple[int, int]) -> torch.Tensor:
        """Whole rows of bytes `raw` decoded by the torch codecs on the CPU, columns `cols` of them in `dtype`, on the
        device of the bytes."""
        c0, c1 = cols
        # whole rows in bf16: the codec rounds on its last pass instead of a separate conversion over memory
        direct = dtype if dtype == torch.bfloat16 and (c0, c1) == (0, self._n_in) else torch.float32
        w = quants.dequantize(
            self._ggml_type, raw.cpu() if raw.device.type != "cpu" else raw, self._n_in, what=self.name, dtype=direct
        )
        if (c0, c1) != (0, self._n_in):
            w = w[:, c0:c1]
        return w.to(self.raw.device, dtype) if (w.device, w.dtype) != (self.raw.device, dtype) else w

    def set_weights_cache(self, cache: str) -> Self:
        """Keep ("bf16", "fp32") or drop ("none") a dequantized copy of W, decoded where the bytes are now (on a
        GPU: by the Triton kernels, after the move, so the copy is never built on the CPU)."""
        if cache not in CACHE_DTYPES:
            raise ValueError(
                f"{self.name or 'frozen linear'}: cache {cache!r}, expected one of {', '.join(CACHE_DTYPES)}"
            )
        self.cache = cache
        self.weight_cache = None
        cache_dtype = CACHE_DTYPES[cache]
        if cache_dtype is not None:
            self.weight_cache = self._dequantize_all(cache_dtype)
        return self

    @contextlib.contextmanager
    def decoded(self) -> Iterator[Self]:
        """Inside the block W is decoded once and every product multiplies that copy instead of decoding per call
        (the chunked loss runs the output projection forward and backward once per chunk of positions). The
        resident backend does so (`ResidentQuantLinear.decoded`); a streaming layer, or one that already keeps a
        cache, is left as it is."""
        yield self

    # ---- what each backend implements -----------------------------------------------------------------------
    def _dequantize_all(self, dtype: torch.dtype) -> torch.Tensor:
        """All of W, exact, in `dtype` on the device of the bytes (a resident cache)."""
        raise NotImplementedError

    def _forward_product(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        """`x·Wᵀ` for x `[..., n_in]`, no autograd. `exact`: fp32 accuracy over W decoded from the bytes, whatever
        the compute dtype and cache."""
        raise NotImplementedError

    def _transpose_product(self, g: torch.Tensor) -> torch.Tensor:
        """`g·W` for g `[..., n_out]` (the adjoint of `_forward_product`), no autograd."""
        raise NotImplementedError

    def _row_norms_sq_exact(self) -> torch.Tensor:
        """Squared L2 norms of the exact dequantized rows `[n_out]`."""
        raise NotImplementedError

    def _fuses_exact(self, x: torch.Tensor, A: torch.Tensor) -> bool:
        """Whether `matmul_with_exact` and `matmul_with_update` take both products from one decode of each tile
        (`_fused_with_exact`, `_fused_with_update`). Elsewhere the two products run as `matmul` and `matmul_exact`
        run them."""
        return False

    def _fused_with_exact(
        self, x: torch.Tensor, A: torch.Tensor, A_split: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x·Wᵀ, A·Wᵀ, split_bf16(A)) from one decode per tile, where `_fuses_exact`."""
        raise NotImplementedError

    def _fused_with_update(
        self, x: torch.Tensor, A: torch.Tensor, A_ref: torch.Tensor, ut: torch.Tensor, return_split: bool
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(x·Wᵀ, split_bf16(A) or None), moving the running U `ut` to A, from one decode per tile, where
        `_fuses_exact`."""
        raise NotImplementedError

    # ---- public matmuls -------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._apply_fn(x, self.bias)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`x·Wᵀ` without the bias (autograd: input gradient only)."""
        return self._apply_fn(x, None)

    def matmul_transposed(self, g: torch.Tensor) -> torch.Tensor:
        """`g·W` for g `[..., n_out]` → `[..., n_in]` (what backward runs; no autograd)."""
        return self._transpose_product(g)

    def _apply_fn(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            y: torch.Tensor = StreamingLinearFn.apply(x, self, bias)  # type: ignore[no-untyped-call]  # unannotated
            return y
        # no graph to record (inference, or an input that needs no gradient): skip the Function's overhead
        y = self._forward_product(x)
        return y if bias is None else y.add_(bias.to(y.dtype))

    # ---- exact products (DoRA) ------------------------------------------------------------------------------
    def matmul_exact(self, x: torch.Tensor) -> torch.Tensor:
        """`x·Wᵀ` to fp32 accuracy (fp64 for fp64 x) over W decoded exactly from the bytes, no autograd: DoRA's
        factored norm takes `U = W·Aᵀ = layer.matmul_exact(A).T` for its r rows of A. Streaming on the CPU: fp32
        operands; resident: both operands split into two bf16 parts (about 2⁻¹⁷ relative). Plain bf16 operands
        would put errors of about 1e-3 relative into U, and so about 3e-5 into a norm that an adapter moves by
        1e-3."""
        with torch.no_grad():
            return self._forward_product(x, exact=True)

    def matmul_with_exact(
        self, x: torch.Tensor, A: torch.Tensor, A_split: Optional[torch.Tensor] = None, return_split: bool = False
    ) -> tuple[torch.Tensor, ...]:
        """`(x·Wᵀ, A·Wᵀ)`, no bias, no autograd: the base product as `matmul` gives it and A's rows to fp32 accuracy as
        `matmul_exact` gives them. DoRA's training step needs both every step (U = W·Aᵀ for the norm); on the device
        path with bf16 compute each tile of W is decoded once for both (`_fused_with_exact`: the base product
        bit-identical to `matmul`'s, U about 2⁻¹⁷ relative), elsewhere the two run one after the other.
        `A_split`: `split_bf16(A)` when the caller has it already (the device path uses it instead of splitting A).
        `return_split`: also return `split_bf16(A)` (A_split if given), computed after the base product is issued
        (DoRA's step needs it for its Gram matrix and bf16(A); the GPU starts on the big GEMM first)."""
        with torch.no_grad():
            As: Optional[torch.Tensor]
            if self._fuses_exact(x, A):
                y, u, As = self._fused_with_exact(x, A, A_split)
            else:
                y, u, As = self._forward_product(x), self._forward_product(A, exact=True), A_split
            if not return_split:
                return y, u
            if As is None:  # the fused products return it: only the separate ones split A here
                As = split_bf16(A)
            return y, u, As

    def matmul_with_update(
        self, x: torch.Tensor, A: torch.Tensor, A_ref: torch.Tensor, ut: torch.Tensor, return_split: bool = False
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
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
                raise ValueError(
                    f"{self.name or 'frozen linear'}: running U {tuple(ut.shape)} {ut.dtype}: expected "
                    f"a contiguous fp32 [{self._n_out}, {A.shape[0]}]"
                )
            if self._fuses_exact(x, A):
                y, As = self._fused_with_update(x, A, A_ref, ut, return_split)
            else:
                y = self._forward_product(x)
                ut.copy_(self._forward_product(A, exact=True).t())
                A_ref.copy_(A)
                As = None
            if not return_split:
                return y
            if As is None:  # the fused products return it: only the separate ones split A here
                As = split_bf16(A)
            return y, As

    def row_norms_sq(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Squared L2 norms of the exact dequantized rows `[n_out]`, computed once and kept (returned as `dtype`).
        CPU streaming: fp64 arithmetic. Resident: fp32 sums of the exact fp32 rows, decoded a tile at a time."""
        if self._row_norms_sq is None:
            self._row_norms_sq = self._row_norms_sq_exact()
        return self._row_norms_sq.to(dtype)

    # ---- housekeeping ---------------------------------------------------------------------------------------
    def _get_name(self) -> str:
        return "FrozenQuantLinear"  # the module's repr names the entry point, whichever backend it is now

    def extra_repr(self) -> str:
        name = f"{self.name}, " if self.name else ""
        return (
            f"{name}in_features={self.in_features}, out_features={self.out_features}, "
            f"type={quants.get_codec(self._ggml_type).name}, bias={self.bias is not None}, cache={self.cache}, "
            f"compute_dtype={str(self.compute_dtype).removeprefix('torch.')}, chunk_rows={self.chunk_rows}"
            + (f", dequant={self.dequant}" if self.dequant != "auto" else "")
        )

    def __getattr__(self, name: str) -> Any:
        # `raw` reads uint8 whatever one-byte dtype holds the bytes: sharded training may keep them as a frozen
        # parameter of a one-byte float dtype (train/sharded.py), the same bits
        value = super().__getattr__(name)
        if name == "raw" and isinstance(value, torch.Tensor) and value.dtype != torch.uint8:
            return value.view(torch.uint8)
        return value

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            f"FrozenQuantLinear {self.name!r} views a memory-mapped GGUF file and is never pickled or "
            f"copied: save the adapters (their state_dict), and reload the base from its GGUF"
        )


def scratch_bytes_for(layer: FrozenQuantLinear) -> int:
    """fp32 bytes one dequantized chunk of `layer` occupies: the unit the memory bound is stated in."""
    return 4 * min(layer.chunk_rows, layer.out_features) * layer.in_features


__all__ = [
    "FrozenQuantLinear",
    "StreamingLinearFn",
    "DEFAULT_SCRATCH_BYTES",
    "DEFAULT_DEVICE_SCRATCH_BYTES",
    "CACHE_DTYPES",
    "COMPUTE_DTYPES",
    "DEQUANT_BACKENDS",
    "default_chunk_rows",
    "scratch_bytes_for",
]
