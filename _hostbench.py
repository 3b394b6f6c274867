import time, statistics, torch, sys
sys.path.insert(0, ".")
from juno_py import kernels
from juno_py.kernels.gemm import mm_out, addmm_out_
dev = "cuda"
torch.backends.cuda.matmul.allow_tf32 = False
a = torch.randn(4096, 8192, device=dev, dtype=torch.bfloat16)
b = torch.randn(8192, 768, device=dev, dtype=torch.bfloat16)
C = torch.zeros(4096, 768, device=dev)
A32 = torch.randn(768, 8192, device=dev)
R32 = A32.clone()
s1 = torch.randn(16, 16, device=dev)
def host_us(fn, n=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n): fn()
        out.append((time.perf_counter() - t0) / n * 1e6)
    torch.cuda.synchronize()
    return statistics.median(out)
cases = {
  "torch.mm bf16->bf16": lambda: torch.mm(a, b),
  "torch.mm bf16->fp32 (out_dtype)": lambda: torch.mm(a, b, torch.float32),
  "mm_out bf16->fp32": lambda: mm_out(a, b, torch.float32),
  "addmm out_dtype fp32 in place": lambda: addmm_out_(C, a, b),
  "torch.addmm bf16 beta0 alpha": lambda: torch.addmm(torch.empty((), dtype=a.dtype, device=dev), a, b, beta=0, alpha=0.5),
  "F.linear bf16": lambda: torch.nn.functional.linear(a, b.T),
  "split_track launch": lambda: kernels.split_track(A32, R32),
  "split_bf16 launch": lambda: kernels.split_bf16(A32),
  "torch.empty": lambda: torch.empty(4096, 768, device=dev),
  "torch.div small": lambda: torch.div(s1, s1),
  "tensor.to bf16 (768x8192)": lambda: A32.to(torch.bfloat16),
  "detach": lambda: A32.detach(),
}
for k, f in cases.items():
    print(f"{k:40s} {host_us(f):8.1f} us host per call")
