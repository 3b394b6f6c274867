"""`juno-py lora --shard` and `juno-py full --shard --optimizer galore` on one GPU (torchrun, NCCL, 1 rank) against
plain one-process runs on the same GPU, on the tiny test model with Q8_0 bytes; prints the torch version, each run's
exit status and log tail, the largest relative difference of the adapters' A and B, and of the trained tensors of
the two GGUFs (full: three targets dense, the rest quantized and sharded; GaLore rank 4 updated after backward,
each matrix clipped by its norm).
On torch before 2.13 this runs the path where FSDP2 holds the quantized bytes as float8_e5m2 parameters
(juno_py/train/sharded.py: frozen_bytes_dtype).

    python benchmarks/shard_gpu_check.py [OUT]      (repository root; OUT default ./shard-gpu-out)

Prints PASS or FAIL per check; exit status 0 when every run succeeds and both agree to 1e-5 (fp32 sums in another
order on one rank).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from juno_py.gguf import GGUFFile
from juno_py.gguf.constants import GGMLType
from juno_py.lora import read_adapter
from juno_py.testing.records import MIXED_RECORDS, write_jsonl
from juno_py.testing.tiny_models import write_tiny_gguf
from juno_py.train.sharded import frozen_bytes_dtype

REL = 1e-5


def main(argv: list[str]) -> int:
    out = Path(argv[0] if argv else "shard-gpu-out")
    out.mkdir(parents=True, exist_ok=True)
    tiny = write_tiny_gguf(out / "tiny-q8.gguf", "llama", GGMLType.Q8_0, seed=3)
    data = write_jsonl(out / "mixed.jsonl", MIXED_RECORDS)
    common = ["--model-path", str(tiny), "--data", str(data), "--max-steps", "4", "--batch-size", "4"]
    common += ["--lora-rank", "4", "--validation-split", "0.2", "--compute-dtype", "fp32", "--no-progress"]
    common += ["--device", "cuda"]
    print(
        f"torch {torch.__version__}, CUDA devices: {torch.cuda.device_count()}; quantized bytes sharded as {frozen_bytes_dtype()}"
    )
    full = ["--model-path", str(tiny), "--data", str(data), "--max-steps", "4", "--batch-size", "4"]
    full += ["--optimizer", "galore", "--galore-rank", "4", "--galore-update-gap", "2", "--no-galore-per-layer"]
    full += ["--targets", "q,v,down", "--requant", "f32", "--validation-split", "0.2", "--compute-dtype", "fp32"]
    full += ["--grad-clip", "per-matrix", "--max-grad-norm", "0.05"]  # the sharded norms' all-reduce, on NCCL
    full += ["--weights-cache", "none", "--no-progress", "--device", "cuda"]  # both: the frozen layers' own kernels
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    runs = {
        "lora sharded": torchrun + ["-m", "juno_py", "lora", "--shard", *common, "--output", str(out / "sharded.bin")],
        "lora single": [sys.executable, "-m", "juno_py", "lora", *common, "--output", str(out / "single.bin")],
        "full sharded": torchrun + ["-m", "juno_py", "full", "--shard", *full, "--output", str(out / "sharded.gguf")],
        "full single": [sys.executable, "-m", "juno_py", "full", *full, "--output", str(out / "single.gguf")],
    }
    ok = True
    for name, cmd in runs.items():
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        print(f"--- {name}: exit {r.returncode}\n$ {' '.join(cmd)}\n{r.stderr[-3000:]}{r.stdout[-500:]}")
        ok = ok and r.returncode == 0
    if not ok:
        print("FAIL: a run failed (its log is above)")
        return 1
    want = {e.key: e for e in read_adapter(out / "single.bin")[1]}
    worst = 0.0
    for e in read_adapter(out / "sharded.bin")[1]:
        for field in ("A", "B"):
            a, b = (torch.from_numpy(getattr(x, field)).double() for x in (e, want[e.key]))
            worst = max(worst, ((a - b).norm() / b.norm().clamp_min(1e-30)).item())
    lora_ok = worst <= REL
    print(f"{'PASS' if lora_ok else 'FAIL'} lora: largest relative difference of A, B (sharded vs single): {worst:.3g}")
    sharded, single, base = (GGUFFile(p) for p in (out / "sharded.gguf", out / "single.gguf", tiny))
    worst, trained = 0.0, 0
    for name in single.tensors:
        a, b, b0 = (f.dequantize(name).double() for f in (sharded, single, base))
        if not torch.equal(b, b0):
            trained += 1
            worst = max(worst, ((a - b).norm() / b.norm().clamp_min(1e-30)).item())
    full_ok = worst <= REL and trained == 6
    print(
        f"{'PASS' if full_ok else 'FAIL'} full galore: {trained} trained tensors (6 expected), largest relative "
        f"difference (sharded vs single): {worst:.3g}"
    )
    print(f"bound {REL:g}: {'PASS' if lora_ok and full_ok else 'FAIL'}")
    return 0 if lora_ok and full_ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
