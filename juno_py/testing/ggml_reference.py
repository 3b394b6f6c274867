"""llama.cpp's reference k-quant and IQ4 quantizers (`ggml_quantize_chunk`, no importance matrix) through ctypes: the
independent encoder the golden data and the quantization benchmark compare against."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np

KQUANT_TYPES = {"Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
IQ4_TYPES = {"IQ4_NL": 20, "IQ4_XS": 23}
# the other types llama.cpp's quantizer writes without an importance matrix (IQ1_S, IQ2_XXS, IQ2_XS and IQ2_S assert
# one): their blocks, decoded, are checked against the `gguf` package's decoder
WRITABLE_NEW_TYPES = {"IQ3_XXS": 18, "IQ3_S": 21, "IQ1_M": 29, "TQ1_0": 34, "TQ2_0": 35, "MXFP4": 39}


def load_ggml():
    """libggml-base from the installed llama-cpp-python (or the file named by $GGML_BASE_LIB, for a llama.cpp
    built elsewhere), with `ggml_quantize_chunk` typed."""
    if os.environ.get("GGML_BASE_LIB"):
        names = [Path(os.environ["GGML_BASE_LIB"])]
    else:
        import llama_cpp  # noqa: F401  (only to locate its shared libraries)

        lib_dir = Path(llama_cpp.__file__).resolve().parent / "lib"
        names = sorted(lib_dir.glob("libggml-base.so*")) + sorted(lib_dir.glob("libggml.so*"))
        if not names:
            raise SystemExit(f"no libggml-base.so under {lib_dir}")
    lib = ctypes.CDLL(str(names[0]))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
    ]
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    return lib


def ggml_quantize(lib, ggml_type: int, x: np.ndarray) -> np.ndarray:
    """llama.cpp's reference quantizer (no importance matrix) on rows x [rows, n_per_row] → uint8 rows."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, n_per_row = x.shape
    lib.ggml_quantize_init(ggml_type)
    out = np.zeros((rows, lib.ggml_row_size(ggml_type, n_per_row)), np.uint8)
    written = lib.ggml_quantize_chunk(ggml_type, x.ctypes.data, out.ctypes.data, 0, rows, n_per_row, None)
    assert written == out.nbytes, (written, out.nbytes)
    return out
