import time, statistics, torch, sys, functools
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
import dora_layer as dl
from juno_py.lora import adapters as ad
from juno_py import kernels
torch.backends.cuda.matmul.allow_tf32 = False
acc = {}
def wrap(obj, name, label):
    f = getattr(obj, name)
    @functools.wraps(f)
    def g(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc.setdefault(label, []).append(time.perf_counter() - t0)
    setattr(obj, name, g)
for shape in (dl.SHAPES[2], dl.SHAPES[5]):
    T, d_in, d_out, r = shape
    dev = torch.device("cuda")
    d = dl.layer_data(T, d_in, d_out, r, dev)
    x = d["x"].clone().requires_grad_(True)
    lay = dl.juno_layer(dl.DenseBase(d["W"]), d).train()
    params = [p for p in lay.parameters() if p.requires_grad]
    step = dl.train_call(lay, x, d["dy"], params, dl.optimizer_nudge(lay))
    for _ in range(10): step()
    torch.cuda.synchronize()
    # totals without instrumentation
    def timeit(fn, n=30):
        out = []
        for _ in range(n):
            torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); out.append(time.perf_counter() - t0)
        torch.cuda.synchronize(); return statistics.median(out) * 1e6
    nudge = dl.optimizer_nudge(lay)
    def fwd_only():
        nudge(); x.grad = None
        for p in params: p.grad = None
        return lay(x)
    t_step = timeit(step)
    ys = []
    def fwd(): ys.append(fwd_only())
    t_fwd = timeit(fwd)
    def bwd():
        y = ys.pop(); y.backward(d["dy"])
    for _ in range(40): ys.append(fwd_only())
    torch.cuda.synchronize()
    t_bwd = timeit(bwd)
    ys.clear()
    print(f"\n## {shape}: host us: step {t_step:.0f}, forward {t_fwd:.0f}, backward {t_bwd:.0f}")
    # trivial custom Function backward cost
    class Id(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a): return a * 1
        @staticmethod
        def backward(ctx, g): return g
    z = torch.randn(16, device=dev, requires_grad=True)
    def triv():
        z.grad = None; Id.apply(z).sum().backward()
    def triv_cpp():
        z.grad = None; (z * 1).sum().backward()
    print(f"trivial Python Function fwd+bwd {timeit(triv):.0f} us, C++ only {timeit(triv_cpp):.0f} us")
    acc.clear()
    if shape is dl.SHAPES[2]:
        wrap(ad.DoraLinearFn, "forward", "Fn.forward"); wrap(ad.DoraLinearFn, "backward", "Fn.backward")
        tk = kernels.triton_kernels()
        for n in ("compose_forward_xa", "compose_forward", "compose_backward", "norm_rows_gram", "norm_rows", "split_track"):
            wrap(tk, n, "tk." + n)
        wrap(ad.AdaptedLinear, "dora_norm", "dora_norm"); wrap(ad.AdaptedLinear, "running_u", "running_u")
        wrap(ad.AdaptedLinear, "_fused_step", "_fused_step"); wrap(ad.AdaptedLinear, "forward", "AdaptedLinear.forward")
        wrap(dl.DenseBase, "matmul_with_update", "matmul_with_update"); wrap(dl.DenseBase, "matmul_transposed", "matmul_transposed")
        wrap(ad, "mm_fp32", "mm_fp32"); wrap(ad, "_mm_scaled", "_mm_scaled"); wrap(ad, "factored_row_norm", "factored_row_norm")
    for _ in range(30):
        torch.cuda.synchronize(); step()
    torch.cuda.synchronize()
    for k, v in acc.items():
        print(f"  {k:28s} {statistics.median(v)*1e6:7.1f} us x {len(v)//30}")
