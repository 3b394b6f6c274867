"""What a frozen base linear provides: `FrozenBase` (every backend) and `ExactProducts` (DoRA's exact products).

Both are structural (`typing.Protocol`, checkable with `isinstance`). Every `FrozenQuantLinear` backend
(`StreamingQuantLinear` on the CPU, `ResidentQuantLinear` on a GPU) is both; other bases an adapter may wrap (a
plain `nn.Linear`, say) are neither. `has_exact_products(base)` says whether a base has the exact products, at
the cost of three attribute lookups (an `isinstance` against a Protocol costs far more, in every step).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Optional, Protocol, Self, TypeGuard, Union, runtime_checkable

import torch


@runtime_checkable
class FrozenBase(Protocol):
    """A frozen `y = x·Wᵀ + b`, W `[out_features, in_features]` held quantized (the GGML type `ggml_type`).

    Products run in `compute_dtype` (fp32 or bf16) with fp32 results (fp64 for fp64 inputs); on a GPU bf16 inputs
    give bf16 results. Only the input gradient flows: W is no Parameter. `resident`: the arithmetic stays on the
    device of the bytes (`raw`); otherwise W streams through the CPU a block of `chunk_rows` rows at a time.
    `weight_cache`: a dequantized copy of W kept beside the bytes (`cache` "bf16" or "fp32"), or None.
    """

    name: str
    cache: str
    chunk_rows: int
    weight_cache: Optional[torch.Tensor]

    @property
    def resident(self) -> bool: ...

    @property
    def raw(self) -> torch.Tensor: ...

    @property
    def bias(self) -> Optional[torch.Tensor]: ...

    @property
    def compute_dtype(self) -> torch.dtype: ...

    @property
    def in_features(self) -> int: ...

    @property
    def out_features(self) -> int: ...

    @property
    def ggml_type(self) -> int: ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`x·Wᵀ + b` (autograd: input gradient only)."""
        ...

    def forward(self, x: torch.Tensor) -> torch.Tensor: ...

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`x·Wᵀ` without the bias (autograd: input gradient only)."""
        ...

    def matmul_transposed(self, g: torch.Tensor) -> torch.Tensor:
        """`g·W` for g `[..., out_features]` (what backward runs; no autograd)."""
        ...

    def dequantize_rows(self, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `[start, stop)` of W decoded exactly from the bytes, on their device."""
        ...

    def dequantize_tile(
        self, rows: tuple[int, int], cols: tuple[int, int], dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """W[r0:r1, c0:c1] decoded exactly from the bytes, on their device."""
        ...

    def dequantize_gather(self, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `index` (a 1-D integer tensor) of W decoded exactly from the bytes, on their device."""
        ...

    def row_norms_sq(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Squared L2 norms of the exact rows `[out_features]`, computed once and kept."""
        ...

    def set_weights_cache(self, cache: str) -> Self:
        """Keep ("bf16", "fp32") or drop ("none") a dequantized copy of W where the bytes are."""
        ...

    def decoded(self) -> AbstractContextManager[Self]:
        """A block inside which W is decoded once for every product (resident); streaming leaves it as it is."""
        ...

    def to(
        self,
        device: Union[str, torch.device, int, None] = ...,
        dtype: Optional[torch.dtype] = ...,
        non_blocking: bool = ...,
    ) -> Self:
        """Move the bytes (still quantized), bias and cache; the backend follows the device."""
        ...


@runtime_checkable
class ExactProducts(Protocol):
    """The exact products DoRA's factored norm asks of its base: U = W·Aᵀ to fp32 accuracy over the exact W, alone
    (`matmul_exact`), beside the base product from one pass over W (`matmul_with_exact`), or as a running U moved
    to a new A (`matmul_with_update`). See `FrozenQuantLinear` for the arithmetic."""

    def matmul_exact(self, x: torch.Tensor) -> torch.Tensor: ...

    def matmul_with_exact(
        self, x: torch.Tensor, A: torch.Tensor, A_split: Optional[torch.Tensor] = None, return_split: bool = False
    ) -> tuple[torch.Tensor, ...]: ...

    def matmul_with_update(
        self, x: torch.Tensor, A: torch.Tensor, A_ref: torch.Tensor, ut: torch.Tensor, return_split: bool = False
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]: ...


# the names of ExactProducts' methods: what `has_exact_products` asks for
EXACT_PRODUCTS = ("matmul_exact", "matmul_with_exact", "matmul_with_update")


def has_exact_products(base: Any) -> TypeGuard[ExactProducts]:
    """Whether `base` has the exact products (`isinstance(base, ExactProducts)`, without the Protocol machinery's
    cost on a path that runs every training step)."""
    return all(hasattr(base, name) for name in EXACT_PRODUCTS)


__all__ = ["FrozenBase", "ExactProducts", "EXACT_PRODUCTS", "has_exact_products"]
