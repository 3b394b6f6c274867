#!/usr/bin/env bash
# Data parallel on GPUs, in one go (logs and results under $OUT, default ./dist-gpu-out):
#  1. smoke: `juno-py lora --nproc 1 --device cuda` (torchrun, NCCL, one rank) on the tiny test model, and the same
#     with 2 ranks when 2 GPUs are visible; the adapters must equal a plain one-process run's to float tolerance;
#  2. scaling: benchmarks.distributed, one plain process against torchrun 1 and 2 (and 4, 8 if visible) on a
#     synthetic SmolLM2-shaped model, the same global batches.
# Usage (repository root): bash benchmarks/distributed_gpu.sh [scaling args...]
set -u
OUT=${OUT:-./dist-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu rehearses the script on a CPU (as if 2 devices)
GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
[ "$DEVICE" = cpu ] && GPUS=2
echo "GPUs visible: $GPUS; torch $(python -c 'import torch; print(torch.__version__)')" | tee "$OUT/summary.txt"

python - "$OUT" <<'EOF' > "$OUT/setup.log" 2>&1
import sys
from pathlib import Path
from juno_py.testing.records import MIXED_RECORDS, write_jsonl
from juno_py.testing.tiny_models import write_tiny_gguf
out = Path(sys.argv[1])
write_tiny_gguf(out / "tiny.gguf", "llama", seed=3)
write_jsonl(out / "mixed.jsonl", MIXED_RECORDS)
EOF

COMMON=(--device "$DEVICE" --model-path "$OUT/tiny.gguf" --data "$OUT/mixed.jsonl" --max-steps 4 --batch-size 4
        --lora-rank 4 --validation-split 0.2 --compute-dtype fp32 --no-progress)
python -m juno_py lora "${COMMON[@]}" --lora-path "$OUT/single.bin" > "$OUT/single.out" 2> "$OUT/single.err"
echo "single process: exit $?" | tee -a "$OUT/summary.txt"
for N in 1 2; do
  if [ "$GPUS" -ge "$N" ]; then
    timeout 180 python -m juno_py lora --nproc "$N" "${COMMON[@]}" --lora-path "$OUT/nproc$N.bin" \
      --events-out "$OUT/nproc$N.events.jsonl" > "$OUT/nproc$N.out" 2> "$OUT/nproc$N.err"
    echo "--nproc $N: exit $?; stdout: $(cat "$OUT/nproc$N.out")" | tee -a "$OUT/summary.txt"
    python - "$OUT/single.bin" "$OUT/nproc$N.bin" <<'EOF' 2>&1 | tee -a "$OUT/summary.txt"
import sys
import numpy as np
from juno_py.lora import read_adapter
one = {e.key: e for e in read_adapter(sys.argv[1])[1]}
worst = 0.0
for e in read_adapter(sys.argv[2])[1]:
    for a, b in ((e.A, one[e.key].A), (e.B, one[e.key].B)):
        worst = max(worst, float(np.max(np.abs(a - b)) / max(1e-12, float(np.max(np.abs(b))))))
print(f"  {sys.argv[2]} vs one process: largest difference {worst:.2e} of the tensor's largest value")
EOF
  fi
done

PROCS=single,1
for N in 2 4 8; do [ "$GPUS" -ge "$N" ] && PROCS="$PROCS,$N"; done
timeout 360 python -m benchmarks.distributed --device "$DEVICE" --procs "$PROCS" --shape smollm2 --batch 32 --seq 256 \
  --steps 12 --warmup 2 --targets all --rank 16 --json "$OUT/scaling.json" --out "$OUT/distributed.json" "$@" > "$OUT/scaling.md" \
  2> "$OUT/scaling.err"
echo "scaling: exit $?" | tee -a "$OUT/summary.txt"
cat "$OUT/scaling.md" | tee -a "$OUT/summary.txt"
