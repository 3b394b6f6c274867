"""`juno-py lora --shard` on one GPU (torchrun, NCCL, 1 rank) against a plain one-process run on the same GPU, on the
tiny test model with Q8_0 bytes; prints the torch version, each run's exit status and log tail, and the largest
relative difference of the adapters' A and B. On torch before 2.13 this runs the path where FSDP2 holds the
quantized bytes as float8_e5m2 parameters (juno_py/train/sharded.py: frozen_bytes_dtype).

    python benchmarks/shard_gpu_check.py [OUT]      (repository root; OUT default ./shard-gpu-out)

Exit status 0 when both runs succeed and the adapters agree to 1e-5 (fp32 sums in another order on one rank).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

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
    runs = {
        "sharded": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
        + ["-m", "juno_py", "lora", "--shard", *common, "--output", str(out / "sharded.bin")],
        "single": [sys.executable, "-m", "juno_py", "lora", *common, "--output", str(out / "single.bin")],
    }
    ok = True
    for name, cmd in runs.items():
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        print(f"--- {name}: exit {r.returncode}\n$ {' '.join(cmd)}\n{r.stderr[-3000:]}{r.stdout[-500:]}")
        ok = ok and r.returncode == 0
    if not ok:
        return 1
    want = {e.key: e for e in read_adapter(out / "single.bin")[1]}
    worst = 0.0
    for e in read_adapter(out / "sharded.bin")[1]:
        for field in ("A", "B"):
            a, b = (torch.from_numpy(getattr(x, field)).double() for x in (e, want[e.key]))
            worst = max(worst, ((a - b).norm() / b.norm().clamp_min(1e-30)).item())
    print(f"largest relative difference of A, B (sharded vs single): {worst:.3g} (bound {REL:g})")
    return 0 if worst <= REL else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
