"""Native block decoder: `native_decode.c`, compiled on first use with the system C compiler, cached under
`$JUNO_PY_HOME/native`, called through ctypes (which releases the GIL for the call).

It decodes whole rows of the block types in `TYPES` to float32 or bfloat16, bit for bit as the torch codecs do
(same float32 operations in the same order, the fp16 scales converted through a table built from torch), and
multiplies rows of the types in `MATVEC_TYPES` by a float32 vector straight from their bytes (`matvec`,
`MatvecPlan`: fused dequantize-dot, W never written out, the rows shared by a small pool of threads inside the
library); the products are the decoded W's within float32 rounding, not bit for bit. The small steps of a
one-token decode (RMSNorm with the residual add, RoPE, attention over a cache, gated activation) are there too,
for `juno_py.models.decode`. Without
a compiler, when the build or load fails, or with `JUNO_PY_NATIVE=0`, `decode` returns None and callers use the
torch codecs; the reason is logged once at debug level.

The library is keyed by a hash of the source, the compiler's version, the compile flags and the CPU's flags, so
a changed source, compiler or machine (a shared home folder) builds its own. Builds write a temporary file and
rename it into place: processes that compile at once (distributed ranks) each end with a complete library.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch

from juno_py.gguf.constants import GGML_BLOCK_SIZES, GGMLType

SOURCE = Path(__file__).with_name("native_decode.c")
ABI = 3  # juno_native_abi() of the source this module speaks to
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-ffp-contract=off")
TYPES = frozenset(
    int(t)
    for t in (
        GGMLType.Q4_0,
        GGMLType.Q4_1,
        GGMLType.Q5_0,
        GGMLType.Q5_1,
        GGMLType.Q8_0,
        GGMLType.Q2_K,
        GGMLType.Q3_K,
        GGMLType.Q4_K,
        GGMLType.Q5_K,
        GGMLType.Q6_K,
        GGMLType.IQ2_XXS,
        GGMLType.IQ2_XS,
        GGMLType.IQ2_S,
        GGMLType.IQ3_XXS,
        GGMLType.IQ3_S,
        GGMLType.IQ1_S,
        GGMLType.IQ1_M,
        GGMLType.TQ1_0,
        GGMLType.TQ2_0,
        GGMLType.MXFP4,
    )
)
OUT_DTYPES = (torch.float32, torch.bfloat16)
# the types `matvec` multiplies from their bytes: every block type above and the float rows
MATVEC_TYPES = TYPES | frozenset(int(t) for t in (GGMLType.F32, GGMLType.F16, GGMLType.BF16))
MATVEC_MAX_TASKS = 64  # products of one call (MV_MAX_TASKS in the source)
# threads one decode is split over (pthreads inside the library): one, because a training step ran slower with
# two (measured in the training loop): right after a matmul torch's threads hold the cores
THREADS = 1

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_state: dict = {}  # "lib": the loaded library, or None once loading failed (not retried)


def enabled() -> bool:
    """False when `JUNO_PY_NATIVE=0` (checked on every call, so it can be switched at run time)."""
    return os.environ.get("JUNO_PY_NATIVE", "1").strip() != "0"


def library() -> Optional[ctypes.CDLL]:
    """The loaded decoder, built first if needed; None when disabled or unavailable."""
    if not enabled():
        return None
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"] = _load()
    return _state["lib"]


def decode(ggml_type: int, blocks: torch.Tensor, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """Blocks (CPU uint8 `[n_blocks, type_size]`) decoded to `dtype` `[n_blocks, block_size]`, or None where the
    native path does not apply (type, dtype, device) or is unavailable."""
    if int(ggml_type) not in TYPES or dtype not in OUT_DTYPES or blocks.device.type != "cpu":
        return None
    lib = library()
    return None if lib is None else decode_with(lib, ggml_type, blocks, dtype, THREADS)


class MatvecTask(ctypes.Structure):
    """One product `y[:n_rows] = W · x` of `juno_matvec` (juno_mv_task in the source)."""

    _fields_ = [
        ("ggml_type", ctypes.c_int64),
        ("w", ctypes.c_void_p),
        ("row_bytes", ctypes.c_int64),
        ("n_rows", ctypes.c_int64),
        ("n_in", ctypes.c_int64),
        ("x", ctypes.c_void_p),
        ("y", ctypes.c_void_p),
    ]


def check_matvec_operands(ggml_type: int, raw: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
    """ValueError unless `raw` (uint8 `[n_rows, row_bytes]`, rows of `ggml_type` blocks, each byte next to the
    last) times `x` (float32 `[n_in]`, contiguous) fits `y` (float32 `[n_rows]`, contiguous), all on the CPU."""
    if int(ggml_type) not in MATVEC_TYPES:
        raise ValueError(f"the native matvec has no GGML type {ggml_type}")
    block_size, type_size = GGML_BLOCK_SIZES[int(ggml_type)]
    n_in = x.numel()
    ok = (
        raw.dtype == torch.uint8
        and raw.dim() == 2
        and (raw.shape[0] < 2 or raw.stride(1) == 1)
        and raw.shape[1] * block_size == n_in * type_size
        and x.dtype == y.dtype == torch.float32
        and x.is_contiguous()
        and y.is_contiguous()
        and y.numel() == raw.shape[0]
        and raw.device.type == x.device.type == y.device.type == "cpu"
    )
    if not ok:
        raise ValueError(
            f"native matvec: weight {raw.dtype} {tuple(raw.shape)}, input {x.dtype} {tuple(x.shape)}, output "
            f"{y.dtype} {tuple(y.shape)}: expected uint8 [n, {n_in * type_size // block_size}] rows, contiguous "
            f"float32 [{n_in}] and [n], on the CPU"
        )


def task_for(ggml_type: int, raw: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> MatvecTask:
    """The task `y = W · x` over tensors the caller keeps alive while it runs (checked first)."""
    check_matvec_operands(ggml_type, raw, x, y)
    stride = raw.stride(0) if raw.shape[0] > 1 else raw.shape[1]
    return MatvecTask(int(ggml_type), raw.data_ptr(), stride, raw.shape[0], x.numel(), x.data_ptr(), y.data_ptr())


class MatvecPlan:
    """A fixed list of products run by one `juno_matvec` call: q, k and v of a block read one input, gate and up
    another. Built once over tensors whose memory stays put (the decoder's buffers); `run` then costs one call."""

    def __init__(self, lib: ctypes.CDLL, tasks: list[MatvecTask], keep: tuple = ()):
        if not 0 < len(tasks) <= MATVEC_MAX_TASKS:
            raise ValueError(f"a matvec plan holds 1 to {MATVEC_MAX_TASKS} products, got {len(tasks)}")
        self._lib = lib
        self._array = (MatvecTask * len(tasks))(*tasks)
        self._n = len(tasks)
        self._keep = keep  # the tensors the tasks point into

    def run(self, threads: int) -> None:
        rc = self._lib.juno_matvec(self._array, self._n, int(threads))
        if rc != 0:
            raise RuntimeError(f"native matvec failed with status {rc}")


def matvec(
    ggml_type: int, raw: torch.Tensor, x: torch.Tensor, out: Optional[torch.Tensor] = None, threads: int = 1
) -> Optional[torch.Tensor]:
    """`W · x` for each row of `x` (float32 `[n_in]` or `[k, n_in]`): float32 `[n_rows]` or `[k, n_rows]`, from
    the bytes `raw` (uint8 `[n_rows, row_bytes]` on the CPU). None where the native library is unavailable or has
    no kernel for the type."""
    if int(ggml_type) not in MATVEC_TYPES:
        return None
    lib = library()
    if lib is None:
        return None
    xs = x.reshape(-1, x.shape[-1]).contiguous()
    if out is None:
        out = torch.empty(xs.shape[0], raw.shape[0], dtype=torch.float32)
    ys = out.view(xs.shape[0], raw.shape[0])
    done = 0
    while done < xs.shape[0]:  # at most MATVEC_MAX_TASKS inputs a call
        part = range(done, min(done + MATVEC_MAX_TASKS, xs.shape[0]))
        tasks = [task_for(ggml_type, raw, xs[i], ys[i]) for i in part]
        MatvecPlan(lib, tasks).run(threads)
        done = part.stop
    return out.view(*x.shape[:-1], raw.shape[0])


def cache_dir() -> Path:
    from juno_py.store import home

    return home() / "native"


def library_path(compiler: str) -> Path:
    """Where the library built by `compiler` for this source and this CPU lives."""
    key = hashlib.sha256()
    for part in (
        SOURCE.read_bytes(),
        _compiler_version(compiler).encode(),
        " ".join(FLAGS).encode(),
        _cpu_flags().encode(),
    ):
        key.update(hashlib.sha256(part).digest())
    return cache_dir() / f"native_decode-{key.hexdigest()[:20]}.so"


def find_compiler() -> Optional[str]:
    """`$CC` if set, else `cc`, else `gcc`, as a path; None if there is none."""
    for name in ([os.environ["CC"]] if os.environ.get("CC") else []) + ["cc", "gcc"]:
        path = shutil.which(name)
        if path:
            return path
    return None


def build(compiler: str, path: Path, flags: tuple[str, ...] = FLAGS) -> None:
    """Compile the source to `path`: into a temporary file beside it, renamed into place once complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp.so", dir=path.parent)
    os.close(fd)
    try:
        proc = subprocess.run(
            [compiler, *flags, "-o", tmp, str(SOURCE), "-lpthread", "-lm"], capture_output=True, text=True, timeout=300
        )
        if proc.returncode != 0:
            raise OSError(f"{compiler} exited with {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def open_library(path: Path) -> ctypes.CDLL:
    """Load a built decoder and give it the fp16 table; OSError if it is not one this module speaks to."""
    lib = ctypes.CDLL(str(path))
    if lib.juno_native_abi() != ABI:
        raise OSError(f"{path} speaks ABI {lib.juno_native_abi()}, expected {ABI}")
    lib.juno_decode_blocks.restype = ctypes.c_int
    lib.juno_decode_blocks.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
    ]
    lib.juno_matvec.restype = ctypes.c_int
    lib.juno_matvec.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    P, I64, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    for name, argtypes in (
        ("juno_residual_rmsnorm", [P, P, P, I64, I64, F32, P]),
        ("juno_rope", [P, I64, I64, I64, P, P, ctypes.c_int]),
        ("juno_attend", [P, P, P, I64, I64, I64, I64, I64, I64, I64, I64, F32, P, P]),
        ("juno_gated", [P, P, I64, ctypes.c_int, P]),
    ):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = None, argtypes
    lib.juno_set_f16_table.restype = None
    lib.juno_set_f16_table.argtypes = [ctypes.c_void_p]
    # every float16 bit pattern through torch's own (vectorized) conversion: the scales' NaN, infinity and
    # subnormal values are then those of the torch codecs
    table = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16).float().contiguous()
    lib.juno_set_f16_table(table.data_ptr())
    # the codebook grids and MXFP4's levels: the codecs' own tables (read from the gguf package)
    from juno_py.gguf.quants.codebooks import GRIDS
    from juno_py.gguf.quants.ternary import MXFP4_LEVELS

    lib.juno_set_table.restype = ctypes.c_int
    lib.juno_set_table.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64]
    tables = {int(t): grid.to(torch.int8).contiguous() for t, grid in GRIDS.items()}
    if MXFP4_LEVELS is not None:
        tables[int(GGMLType.MXFP4)] = MXFP4_LEVELS.contiguous()
    for ggml_type, values in tables.items():
        if lib.juno_set_table(ggml_type, values.data_ptr(), values.numel()) != 0:
            raise OSError(f"{path} takes no table of {values.numel()} values for GGML type {ggml_type}")
    return lib


def decode_with(
    lib: ctypes.CDLL, ggml_type: int, blocks: torch.Tensor, dtype: torch.dtype, threads: int = 1
) -> torch.Tensor:
    """`decode` through a given library (tests compare builds for other vector widths)."""
    from juno_py.gguf.quants.simple import new_result

    block_size, type_size = GGML_BLOCK_SIZES[int(ggml_type)]
    blocks = blocks.contiguous()
    n_blocks = blocks.numel() // type_size
    out = new_result((n_blocks, block_size), dtype)
    if (
        n_blocks
        and lib.juno_decode_blocks(
            int(ggml_type), blocks.data_ptr(), 0, n_blocks, out.data_ptr(), int(dtype == torch.bfloat16), threads
        )
        != 0
    ):
        raise ValueError(f"the native decoder has no GGML type {ggml_type}")
    return out


def _load() -> Optional[ctypes.CDLL]:
    try:
        compiler = find_compiler()
        if compiler is None:
            raise OSError("no C compiler (cc, gcc or $CC) on PATH")
        path = library_path(compiler)
        if path.is_file():
            try:
                return open_library(path)
            except OSError:  # a cached file that does not load (damaged, another ABI): build it again
                pass
        build(compiler, path)
        return open_library(path)
    except (OSError, subprocess.SubprocessError) as e:
        _log.debug("native block decoder unavailable, using the torch codecs: %s", e)
        return None


def _compiler_version(compiler: str) -> str:
    proc = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60)
    return f"{compiler}\n{proc.stdout}"


def _cpu_flags() -> str:
    """What -march=native compiles for: the CPU's feature flags (Linux), else the machine and processor names."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"
