"""One DoRA layer on the GPU: juno-py against PEFT (plain LoRA, DoRA with bf16 adapters, DoRA with its default
fp32 adapters), plus the composition kernel's bandwidth against a copy and the factored norm's memory and error.

    python -m benchmarks.dora_layer                  # the layer tables; targets in benchmarks/results/dora-layer.json
    python -m benchmarks.dora_layer --crossover      # eager vs fused composition by size (docs/kernels.md)
    python -m benchmarks.dora_layer --tiles          # tile configurations of the kernels, by bandwidth
    python -m benchmarks.dora_layer --graphed        # also each fwd+bwd and inference call replayed as a CUDA graph
    python -m benchmarks.dora_layer --quick --out /tmp/dora.json   # tiny shapes on the CPU: a smoke test

Every layer sees the same bf16 x, W, A, B and m: W ~ N(0, 0.02²), A kaiming-uniform, B ≠ 0 (‖sBA‖ ≈ 0.3‖W‖ per
row), m = ‖W + sBA‖_row·(1 + 1.5e-3·N(0, 1)) so g ≈ 1 with a spread of about 1.5e-3, s = alpha/r with alpha = r.
juno-py computes base = x·Wᵀ (dense bf16 W, or the quantized frozen linear), lora = (x·Aᵀ)·Bᵀ in bf16 from fp32
adapters, then the fused composition (a training step is one autograd Function, `DoraLinearFn`); at inference g
is cached (frozen adapter). Training steps recompute the norm every call for both (after an optimizer step it
would be stale), and take the base product and U = W·Aᵀ from one `matmul_with_exact` call: fp32-accurate U on the
dense stand-in (`DenseBase`: A split into two bf16 parts) as on the quantized frozen linear (W decoded once per
tile into both bf16 halves). PEFT's layer is called directly (no
PeftModel wrapper), in train() for training and eval() for inference, lora_dropout 0. Timings: CUDA events around
each call, started on an idle GPU (so a call's time is its GPU time or, where launching is slower than the GPU,
its launch time), implementations interleaved call by call, median of --reps calls after warm-up; TF32 off. Memory:
peak allocated during one call above what was allocated before it (weights, adapters, x), and resident bytes.
Quantized W are random valid blocks (timing does not depend on the values); PEFT always gets the dense W.
The last table checks every layer target at every shape run, eager and (with --graphed: every implementation's
call replayed as a CUDA graph, PEFT's too) graphed, and counts the misses.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import harness
from benchmarks.harness import capture, interleaved
from juno_py import kernels
from juno_py.kernels.gemm import addmm_out_, mm_out
from juno_py.kernels.reference import compose_eager
from juno_py.lora.adapters import AdaptedLinear, AdapterConfig, LoraAdapter
from juno_py.lora.format import Mode

# (tokens, d_in, d_out, rank): the layer shapes of DESIGN.md §6
SHAPES = [
    (4096, 8192, 8192, 384),
    (4096, 28672, 8192, 384),
    (8192, 4096, 4096, 16),
    (8192, 4096, 4096, 64),
    (8192, 4096, 4096, 384),
    (4096, 8192, 8192, 768),
]
QUICK_SHAPES = [(64, 256, 128, 8), (33, 512, 256, 16)]
QUANT_TYPES = ("Q4_K", "Q6_K", "Q8_0")
DEVICE_SCRATCH_BYTES = None  # the quantized layers' decode tile (`--device-scratch-mib`); None: the product default
G_SPREAD = 1.5e-3
U_TILE_ROWS = 2048  # rows of W per GEMM of the dense stand-in's U alone (`DenseBase.matmul_exact`)


class DenseBase(nn.Module):
    """A frozen dense bf16 W with the frozen-linear interface AdaptedLinear uses (matmul, matmul_exact,
    matmul_with_exact, matmul_transposed, row_norms_sq).

    `matmul_with_exact(x, A)` is the stand-in for the quantized frozen linear's method of that name, which a DoRA
    training step calls when its norm must be recomputed: the base product x·Wᵀ and U = A·Wᵀ to fp32 accuracy,
    the same numbers by the same kind of products, so that dense against quantized stays a fair comparison. W is
    exactly bf16 here (its W_lo is 0), so U = [A_hi; A_lo]·Wᵀ (halves added) is the quantized layer's
    [A_hi; A_lo]·W_hiᵀ + A_hi·W_loᵀ without the term a bf16 W does not have: 2r rows of products instead of 3r, and
    no decode. `stacked` picks how: False, the base GEMM (as `matmul`) and one GEMM of the 2r rows of A; True, one
    GEMM of [x; A_hi; A_lo]·Wᵀ with an fp32 result (x copied into the stack, the base rows rounded to bf16 after).
    `bench_shape` times both and keeps the faster for the layer's rows.
    """

    def __init__(self, W: torch.Tensor, stacked: bool = False):
        super().__init__()
        self.register_buffer("W", W, persistent=False)
        self.bias = None
        self.stacked = stacked
        self._row_norms_sq = W.double().square().sum(1)  # frozen: once, at load
        self._row_norms_sq32 = self._row_norms_sq.float()

    in_features = property(lambda self: self.W.shape[1])
    out_features = property(lambda self: self.W.shape[0])

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16:
            return F.linear(x, self.W)
        return mm_out(x.to(torch.bfloat16), self.W.t(), torch.float32)  # fp32 rows: bf16 operands, fp32 result

    def matmul_exact(self, x: torch.Tensor, x_split: torch.Tensor | None = None) -> torch.Tensor:
        """x·Wᵀ for fp32 rows (DoRA's U = W·Aᵀ) as the frozen linear's `matmul_exact` gives it: to fp32 accuracy
        over the exact W. W is exactly bf16, so x = x_hi + x_lo in two bf16 parts (`kernels.split_bf16`, within
        about 2⁻¹⁷ of x) and U = [x_hi; x_lo]·Wᵀ, bf16 GEMMs of 2r rows with fp32 accumulation, halves added: one
        GEMM when the split is given (the training step), by tiles of W's rows otherwise."""
        r = x.shape[0]
        if x_split is not None:  # the training step's (`matmul_with_exact`): one GEMM of the 2r rows
            both = mm_out(x_split, self.W.t(), torch.float32)
            return both[:r].add_(both[r:])
        # alone (a norm refresh): by tiles of W's rows into one [r, d_out] result, as the frozen linear's
        # `_device_split_exact` runs through W's tiles: a [2r, tile] scratch instead of a [2r, d_out] one
        xs = kernels.split_bf16(x)
        out = torch.empty(r, self.W.shape[0], dtype=torch.float32, device=x.device)
        for a in range(0, self.W.shape[0], U_TILE_ROWS):
            b = min(a + U_TILE_ROWS, self.W.shape[0])
            both = mm_out(xs, self.W[a:b].t(), torch.float32)
            torch.add(both[:r], both[r:], out=out[:, a:b])
        return out

    def matmul_with_exact(
        self, x: torch.Tensor, A: torch.Tensor, A_split: torch.Tensor | None = None, return_split: bool = False
    ):
        """(x·Wᵀ, A·Wᵀ) as `matmul` and `matmul_exact` give them (see the class docstring for `stacked`); `A_split`:
        A's two bf16 parts when the caller has them (as the frozen linear's method takes them); `return_split`: A
        split here (after the base GEMM is issued, unless stacked) and returned third, as the frozen linear does."""
        if not self.stacked:
            base = self.matmul(x)
            if return_split and A_split is None:
                A_split = kernels.split_bf16(A)
            U = self.matmul_exact(A, A_split)
            return (base, U, A_split) if return_split else (base, U)
        t, r = x.shape[0], A.shape[0]
        A_split = kernels.split_bf16(A) if A_split is None else A_split
        X = torch.cat([x.to(torch.bfloat16), A_split])
        out = mm_out(X, self.W.t(), torch.float32)
        base = out[:t].to(torch.bfloat16) if x.dtype == torch.bfloat16 else out[:t]
        U = out[t : t + r].add_(out[t + r :])
        return (base, U, A_split) if return_split else (base, U)

    def matmul_with_update(
        self, x: torch.Tensor, A: torch.Tensor, A_ref: torch.Tensor, ut: torch.Tensor, return_split: bool = False
    ):
        """x·Wᵀ as `matmul`, and the running U `ut` `[d_out, r]` moved from A_ref to A as the frozen linear's method
        of that name moves it: ut += W·Dᵀ with D = bf16(A − A_ref) (`kernels.split_track`, A_ref moved by D), one
        GEMM of r rows accumulating into ut in fp32. W is exactly bf16, so that is the quantized layer's
        [W_hi | W_lo]·[D | D]ᵀ without W_lo: r rows of products instead of 2r."""
        base = self.matmul(x)
        A_split, D = kernels.split_track(A, A_ref)  # one kernel on CUDA
        addmm_out_(ut, self.W, D.t())
        return (base, A_split) if return_split else base

    def matmul_transposed(self, g: torch.Tensor) -> torch.Tensor:
        """g·W (the input gradient, no autograd)."""
        return g @ self.W if g.dtype == self.W.dtype else g @ self.W.to(g.dtype)

    def row_norms_sq(self, dtype=torch.float32):
        return self._row_norms_sq32 if dtype == torch.float32 else self._row_norms_sq.to(dtype)


# ---------------------------------------------------------------------------------------------------- data
def layer_data(T, d_in, d_out, r, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    W = (torch.randn(d_out, d_in, generator=gen, device=device) * 0.02).to(torch.bfloat16)
    x = torch.randn(T, d_in, generator=gen, device=device).to(torch.bfloat16)
    dy = (torch.randn(T, d_out, generator=gen, device=device) * 0.01).to(torch.bfloat16)
    bound = 1 / math.sqrt(d_in)
    A = torch.rand(r, d_in, generator=gen, device=device) * (2 * bound) - bound
    s = 1.0  # alpha = r
    # ‖(BA)_row‖² ≈ r·σ_B²·d_in·σ_A² = r·σ_B²/3; aim at 0.3·‖W_row‖ = 0.3·0.02·√d_in
    sigma_b = 0.3 * 0.02 * math.sqrt(d_in) * math.sqrt(3 / r)
    B = torch.randn(d_out, r, generator=gen, device=device) * sigma_b
    norm = row_norm_fp64(W, A, B, s)
    m = (norm * (1 + G_SPREAD * torch.randn(d_out, generator=gen, device=device, dtype=torch.float64))).float()
    return dict(W=W, x=x, dy=dy, A=A, B=B, m=m, s=s, r=r, alpha=float(r))


def row_norm_fp64(W, A, B, s, chunk=2048):
    out = torch.empty(W.shape[0], dtype=torch.float64, device=W.device)
    A64 = A.double()
    for a in range(0, W.shape[0], chunk):
        out[a : a + chunk] = (W[a : a + chunk].double() + s * B[a : a + chunk].double() @ A64).norm(dim=1)
    return out


# ---------------------------------------------------------------------------------------------------- layers
class FreshULayer(AdaptedLinear):
    """The product's DoRA layer without a running U: every stale norm computes U = W·Aᵀ afresh."""

    def tracks_running_u(self, A):
        return False


def juno_layer(base, d, fresh_u=False):
    """The product's DoRA layer on `base` (a running U on CUDA); `fresh_u`: without one (`FreshULayer`)."""
    cfg = AdapterConfig(rank=d["r"], alpha=d["alpha"], mode=Mode.DORA)
    ad = LoraAdapter(base.in_features, base.out_features, cfg, magnitude=d["m"].cpu())
    with torch.no_grad():
        ad.lora_A.copy_(d["A"].cpu())
        ad.lora_B.copy_(d["B"].cpu())
    return (FreshULayer if fresh_u else AdaptedLinear)(base, [ad]).to(d["W"].device)


class _One(nn.Module):
    def __init__(self, lin):
        super().__init__()
        self.proj = lin


def peft_layer(d, dora: bool, adapter_dtype: torch.dtype):
    """PEFT's LoRA/DoRA Linear around an nn.Linear holding the shared W (returned: the adapted layer itself)."""
    from peft import LoraConfig, get_peft_model

    W = d["W"]
    lin = nn.Linear(W.shape[1], W.shape[0], bias=False, device="meta")
    lin.weight = nn.Parameter(W, requires_grad=False)
    cfg = LoraConfig(r=d["r"], lora_alpha=d["alpha"], target_modules=["proj"], lora_dropout=0.0, use_dora=dora)
    model = get_peft_model(_One(lin), cfg, autocast_adapter_dtype=adapter_dtype == torch.float32)
    layer = model.base_model.model.proj
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(d["A"])
        layer.lora_B["default"].weight.copy_(d["B"])
        if dora:
            layer.lora_magnitude_vector["default"].weight.copy_(d["m"])
    got = layer.lora_A["default"].weight.dtype
    if got != adapter_dtype:
        raise RuntimeError(f"PEFT built {got} adapters, expected {adapter_dtype}")
    return layer


def quant_layer(type_name, d_in, d_out, device):
    """juno-py's frozen quantized linear on the device (random valid blocks), or the reason it cannot run."""
    from juno_py.gguf import GGMLType
    from juno_py.testing.blocks import random_rows
    from juno_py.weights import FrozenQuantLinear

    ggml_type = GGMLType[type_name]
    raw = torch.from_numpy(random_rows(ggml_type, d_out, d_in, seed=7)).to(device)
    kw = {} if DEVICE_SCRATCH_BYTES is None else {"device_scratch_bytes": DEVICE_SCRATCH_BYTES}
    layer = FrozenQuantLinear(raw, ggml_type, d_in, compute_dtype=torch.bfloat16, **kw)
    layer.row_norms_sq()  # frozen: once, at load
    return layer


# ---------------------------------------------------------------------------------------------------- timing
def graphed_calls(calls: dict, label: str, notes: dict, reps: int, warmup: int, device) -> dict:
    """Median ms of each call captured once in a CUDA graph and replayed (GPU only; {} elsewhere), the replays
    interleaved in random order as the eager calls, so that drift of the machine's speed reaches every implementation
    alike. A call that cannot be captured gets a note `f"{name} ({label})"` instead of a number."""
    if device.type != "cuda":
        return {}
    graphs = {}
    for n, f in calls.items():
        try:
            graphs[n] = capture(f)
        except Exception as e:  # noqa: BLE001 - a step that cannot be captured: say so instead of a number
            notes[f"{n} ({label})"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    times = interleaved({n: g.replay for n, g in graphs.items()}, reps, warmup, device)
    graphs = None  # freed
    return times


def peak_mib(fn, device) -> float:
    """Peak bytes allocated during `fn()` above what was allocated before it, in MiB (GPU only)."""
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def train_call(layer, x, dy, params, fresh_norm=None):
    def step():
        if fresh_norm is not None:
            fresh_norm()
        x.grad = None
        for p in params:
            p.grad = None
        layer(x).backward(dy)

    return step


def infer_call(layer, x):
    def step():
        with torch.no_grad():
            layer(x)

    return step


# ---------------------------------------------------------------------------------------------------- layer table
def optimizer_nudge(layer):
    """What a training step sees of an optimizer step, for a juno-py layer: A moved (by ±2⁻²⁰ of its scale, the sign
    alternating so A stays put over pairs of calls) and the norm stale. The DoRA step then recomputes the norm, and
    its running U (`AdaptedLinear.running_u`) updates by a D that is not zero. PEFT recomputes its norm every
    call anyway."""
    A = layer.dora.lora_A
    step = (A.detach().abs().mean() * 2.0**-20).item()
    sign = [1.0]

    def nudge():
        with torch.no_grad():
            A.add_(sign[0] * step)
        sign[0] = -sign[0]
        layer._g_cache = None

    return nudge


def bench_shape(T, d_in, d_out, r, device, reps, warmup, with_quant, peers=True, graphed=False, u_ab=False):
    d = layer_data(T, d_in, d_out, r, device)
    x = d["x"].clone().requires_grad_(True)
    layers, resident, notes = {}, {}, {}

    def build(name, make):
        before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        try:
            layer = make()
            on_gpu = device.type == "cuda"
            resident[name] = (torch.cuda.memory_allocated() - before) / 2**20 if on_gpu else float("nan")
            params = [p for p in layer.parameters() if p.requires_grad]
            train_call(layer, x, d["dy"], params)()  # does it run at all?
            infer_call(layer, d["x"])()
            x.grad = None
            for p in params:
                p.grad = None
            layers[name] = layer
        except Exception as e:  # a peer or a part that cannot run here: report it instead of a number
            notes[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            resident.pop(name, None)

    dense_choice = {}
    if with_quant:  # the dense stand-in's combined product: whichever of its two forms is faster here
        probe = DenseBase(d["W"])
        A32 = d["A"].float()
        forms = {
            f"stacked={v}": (lambda v=v: (setattr(probe, "stacked", v), probe.matmul_with_exact(d["x"], A32)))
            for v in (False, True)
        }
        dense_choice = interleaved(forms, reps, warmup, device)
        probe = forms = None  # freed
    stacked = bool(dense_choice) and dense_choice["stacked=True"] < dense_choice["stacked=False"]
    build("juno-py dense", lambda: juno_layer(DenseBase(d["W"], stacked=stacked), d))
    if u_ab:  # the same layer recomputing U = W·Aᵀ at every stale norm (no running U)
        build("juno-py dense, U afresh", lambda: juno_layer(DenseBase(d["W"], stacked=stacked), d, fresh_u=True))
    if peers:
        build("PEFT LoRA bf16", lambda: peft_layer(d, False, torch.bfloat16))
        build("PEFT DoRA bf16", lambda: peft_layer(d, True, torch.bfloat16))
        build("PEFT DoRA fp32", lambda: peft_layer(d, True, torch.float32))
    if with_quant:
        for t in QUANT_TYPES:
            build(f"juno-py {t}", lambda t=t: juno_layer(quant_layer(t, d_in, d_out, device), d))
            if u_ab:
                build(
                    f"juno-py {t}, U afresh",
                    lambda t=t: juno_layer(quant_layer(t, d_in, d_out, device), d, fresh_u=True),
                )

    # the juno layer computes what PEFT's fp32-adapter DoRA computes (both round to bf16 at the end)
    agree = {}
    with torch.no_grad():
        base_out = F.linear(d["x"], d["W"]).float()
        if "juno-py dense" in layers and "PEFT DoRA fp32" in layers:
            ref = layers["PEFT DoRA fp32"].eval()(d["x"]).float()
            got = layers["juno-py dense"](d["x"]).float()
            agree["juno-py dense vs PEFT DoRA fp32"] = ((got - ref).norm() / (ref - base_out).norm()).item()
            layers["PEFT DoRA fp32"].train()

    train, infer = {}, {}
    for name, layer in layers.items():
        params = [p for p in layer.parameters() if p.requires_grad]
        fresh = optimizer_nudge(layer) if isinstance(layer, AdaptedLinear) else None
        train[name] = train_call(layer, x, d["dy"], params, fresh)
        infer[name] = infer_call(layer, d["x"])
    for layer in layers.values():
        layer.train()
    t_train = interleaved(train, reps, warmup, device)
    mem_train = {n: peak_mib(f, device) for n, f in train.items()}
    # the same steps, each captured in a CUDA graph: GPU time alone
    t_graphed = graphed_calls(train, "graphed", notes, reps, warmup, device) if graphed else {}
    for layer in layers.values():
        layer.eval()
    for name, layer in layers.items():
        if isinstance(layer, AdaptedLinear):
            layer.dora_scale()  # frozen adapter: the norm is computed once and cached
    t_infer = interleaved(infer, reps, warmup, device)
    mem_infer = {n: peak_mib(f, device) for n, f in infer.items()}
    # inference calls as CUDA graphs too: without the host's time to reach the first kernel, which a single layer
    # called from an idle GPU exposes (and a model's later layers hide)
    t_graphed_infer = graphed_calls(infer, "graphed inference", notes, reps, warmup, device) if graphed else {}
    rows = [
        dict(
            impl=n,
            train_ms=t_train[n],
            infer_ms=t_infer[n],
            train_peak_mib=mem_train[n],
            infer_peak_mib=mem_infer[n],
            resident_mib=resident[n],
            graphed_train_ms=t_graphed.get(n),
            graphed_infer_ms=t_graphed_infer.get(n),
        )
        for n in layers
    ]
    if with_quant:  # the norm's U = W·Aᵀ alone (`matmul_exact`), and with the base product (`matmul_with_exact`,
        # what a training step with a fresh norm calls): fp32-accurate U from split bf16 products on both
        A = d["A"].float()
        bases = {n: lay.base for n, lay in layers.items() if isinstance(lay, AdaptedLinear)}
        t_u = interleaved({n: (lambda b=b: b.matmul_exact(A)) for n, b in bases.items()}, reps, warmup, device)
        t_both = interleaved(
            {n: (lambda b=b: b.matmul_with_exact(d["x"], A)) for n, b in bases.items()}, reps, warmup, device
        )
        t_base = interleaved({n: (lambda b=b: b.matmul(d["x"])) for n, b in bases.items()}, reps, warmup, device)
        for row in rows:
            if row["impl"] in t_u:
                row.update(norm_U_ms=t_u[row["impl"]], base_and_U_ms=t_both[row["impl"]], base_ms=t_base[row["impl"]])
    layers = train = infer = None  # freed
    return dict(T=T, d_in=d_in, d_out=d_out, r=r, rows=rows, notes=notes, agree=agree, dense_forms=dense_choice)


def print_layer_table(res):
    T, d_in, d_out, r = res["T"], res["d_in"], res["d_out"], res["r"]
    by = {row["impl"]: row for row in res["rows"]}
    print(f"\n### T={T}, {d_in}→{d_out}, r={r}\n")
    print("| implementation | inference ms | fwd+bwd ms | peak MiB (fwd+bwd) | peak MiB (inference) | resident MiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in res["rows"]:
        print(
            f"| {row['impl']} | {row['infer_ms']:.3f} | {row['train_ms']:.3f} | {row['train_peak_mib']:.0f} | "
            f"{row['infer_peak_mib']:.0f} | {row['resident_mib']:.0f} |"
        )
    for name, why in res["notes"].items():
        print(f"| {name} | not run: {why} | | | | |")
    j = by.get("juno-py dense")
    if j:
        lines = []
        for peer in ("PEFT DoRA bf16", "PEFT DoRA fp32", "PEFT LoRA bf16"):
            if peer in by:
                p = by[peer]
                lines.append(
                    f"{peer}: fwd+bwd {p['train_ms'] / j['train_ms']:.2f}×, inference "
                    f"{p['infer_ms'] / j['infer_ms']:.2f}×, "
                    f"peak fwd+bwd {p['train_peak_mib'] / j['train_peak_mib']:.2f}×"
                )
        print("\njuno-py dense speedup over " + "; ".join(lines))
        if "PEFT LoRA bf16" in by:
            lora_ms = by["PEFT LoRA bf16"]["infer_ms"]
            print(f"juno-py dense inference / PEFT LoRA inference: {j['infer_ms'] / lora_ms:.3f}")
        quant = [
            f"{t}: fwd+bwd {by[f'juno-py {t}']['train_ms'] / j['train_ms']:.2f}×, inference "
            f"{by[f'juno-py {t}']['infer_ms'] / j['infer_ms']:.2f}×"
            for t in QUANT_TYPES
            if f"juno-py {t}" in by
        ]
        if quant:
            print("juno-py quantized time / juno-py dense: " + "; ".join(quant))
        ab = [(n, n + ", U afresh") for n in by if n.startswith("juno-py") and n + ", U afresh" in by]
        if ab:
            print(
                "running U against U afresh at every step (fwd+bwd ms, then graphed): "
                + "; ".join(
                    f"{n}: {by[n]['train_ms']:.3f} / {by[m]['train_ms']:.3f} ({by[n]['train_ms'] / by[m]['train_ms']:.3f}×)"
                    + (
                        f", graphed {by[n]['graphed_train_ms']:.3f} / {by[m]['graphed_train_ms']:.3f} "
                        f"({by[n]['graphed_train_ms'] / by[m]['graphed_train_ms']:.3f}×)"
                        if by[n].get("graphed_train_ms") and by[m].get("graphed_train_ms")
                        else ""
                    )
                    for n, m in ab
                )
            )
        g = {n: row["graphed_train_ms"] for n, row in by.items() if row.get("graphed_train_ms")}
        if "juno-py dense" in g:
            print(
                "fwd+bwd as CUDA graphs (GPU time alone), ms: "
                + ", ".join(f"{n} {v:.3f}" for n, v in g.items())
                + "; juno-py dense speedup: "
                + ", ".join(f"{n} {v / g['juno-py dense']:.2f}×" for n, v in g.items() if n.startswith("PEFT"))
            )
        gi = {n: row["graphed_infer_ms"] for n, row in by.items() if row.get("graphed_infer_ms")}
        if "juno-py dense" in gi:
            dense = gi["juno-py dense"]
            print(
                "inference as CUDA graphs (GPU time alone), ms: "
                + ", ".join(f"{n} {v:.3f}" for n, v in gi.items())
                + "; juno-py dense speedup: "
                + ", ".join(f"{n} {v / dense:.2f}×" for n, v in gi.items() if n.startswith("PEFT"))
                + "; quantized / dense: "
                + ", ".join(f"{t} {gi[f'juno-py {t}'] / dense:.2f}×" for t in QUANT_TYPES if f"juno-py {t}" in gi)
            )
        u = [
            f"{n}: {row['norm_U_ms']:.3f} / {row['base_ms']:.3f} / {row['base_and_U_ms']:.3f}"
            for n, row in by.items()
            if "norm_U_ms" in row
        ]
        if u:
            print(
                "ms of U = W·Aᵀ alone (matmul_exact) / the base product alone (matmul) / both in one call "
                "(matmul_with_exact, what a step with a fresh norm runs): " + "; ".join(u)
            )
    forms = res.get("dense_forms")
    if forms:
        print(
            f"dense stand-in's matmul_with_exact: base GEMM + one GEMM of [A_hi; A_lo] "
            f"{forms['stacked=False']:.3f} ms, one GEMM of [x; A_hi; A_lo] {forms['stacked=True']:.3f} ms "
            f"(the layer rows use the faster)"
        )
    for k, v in res["agree"].items():
        print(f"check: ‖{k}‖ / ‖adapter effect‖ = {v:.2e} (both outputs bf16)")


# the layer targets of DESIGN.md §6: (what, numerator impl, denominator impl, field, bound, at least?,
# the shapes it applies to or None for every shape), as ratios of times: "≥ 1.5" reads "the peer takes at least 1.5
# times juno-py's time". The ≥ 4× against PEFT's fp32 adapters is DESIGN.md's, at its two shapes only.
DESIGN_SHAPES = ((4096, 8192, 8192, 384), (4096, 28672, 8192, 384))
TARGETS = [
    ("fwd+bwd, PEFT DoRA bf16 / juno-py dense", "PEFT DoRA bf16", "juno-py dense", "train", 1.5, True, None),
    ("fwd+bwd, PEFT DoRA fp32 / juno-py dense", "PEFT DoRA fp32", "juno-py dense", "train", 4.0, True, DESIGN_SHAPES),
    ("inference, PEFT DoRA bf16 / juno-py dense", "PEFT DoRA bf16", "juno-py dense", "infer", 1.9, True, None),
    ("inference, juno-py dense / PEFT LoRA bf16", "juno-py dense", "PEFT LoRA bf16", "infer", 1.15, False, None),
]
TARGETS += [
    (f"{what}, juno-py {t} / juno-py dense", f"juno-py {t}", "juno-py dense", field, 1.25, False, None)
    for t in QUANT_TYPES
    for what, field in (("fwd+bwd", "train"), ("inference", "infer"))
]


def target_rows(res):
    """Each layer target on this shape, as (what, bound, at least?, eager ratio, graphed ratio); None where a side did
    not run. Graphed: every implementation's call captured in a CUDA graph and replayed, so each ratio compares
    the GPU's time alone; eager: each call launched from Python, so a call whose launches outrun its GPU work
    reports the host's time."""
    by = {row["impl"]: row for row in res["rows"]}
    out = []
    shape = (res["T"], res["d_in"], res["d_out"], res["r"])
    for what, num, den, field, bound, at_least, shapes in TARGETS:
        if num not in by or den not in by or (shapes is not None and shape not in shapes):
            continue
        ratios = []
        for key in (f"{field}_ms", f"graphed_{field}_ms"):
            a, b = by[num].get(key), by[den].get(key)
            ratios.append(a / b if a and b else None)
        out.append((what, bound, at_least, *ratios))
    return out


TARGET_COLUMNS = ["T, d_in→d_out, r", "ratio", "target", "eager", "graphed", "met, graphed", "met, eager"]


def print_targets(results) -> tuple[list[list], str]:
    """One table of every layer target at every shape run, with eager and graphed ratios side by side; returns its
    rows and the count of misses."""
    rows = [(res, t) for res in results for t in target_rows(res)]
    if not rows:
        return [], ""
    print("\n### Layer targets (DESIGN.md §6)\n")
    print(
        "Graphed: each implementation's call (PEFT's too) replayed as a CUDA graph, the GPU's time alone, which is "
        "how juno-py's trainer runs its steps. Eager: each call launched from Python; where the launches take "
        "longer than the GPU's work, the ratio measures the host.\n"
    )
    print(harness.markdown_table(TARGET_COLUMNS, []))
    table = []
    missed = {"graphed": 0, "eager": 0}
    checked = {"graphed": 0, "eager": 0}

    def verdict(v, bound, at_least, col):
        if v is None:
            return "-"
        ok = v >= bound if at_least else v <= bound
        missed[col] += not ok
        checked[col] += 1
        return "yes" if ok else "**no**"

    def fmt(v):
        return "-" if v is None else f"{v:.2f}"

    for res, (what, bound, at_least, eager, graphed) in rows:
        sign = "≥" if at_least else "≤"
        table.append(
            [
                f"{res['T']}, {res['d_in']}→{res['d_out']}, {res['r']}",
                what,
                f"{sign} {bound}",
                fmt(eager),
                fmt(graphed),
                verdict(graphed, bound, at_least, "graphed"),
                verdict(eager, bound, at_least, "eager"),
            ]
        )
        print("| " + " | ".join(table[-1]) + " |")
    summary = "targets missed: " + ", ".join(
        f"{missed[c]} of {checked[c]} {c}" if checked[c] else f"{c} not timed" for c in ("graphed", "eager")
    )
    print("\n" + summary)
    return table, summary


# ---------------------------------------------------------------------------------------------------- kernels alone
BANDWIDTH_BATCH = 10  # calls timed back to back per sample in the bandwidth tables


def bandwidth(n_elems, dtype, device, reps, warmup):
    """GB/s of the composition kernels (inference; training forward; backward with and without d_lora) and of a
    copy, interleaved, from `BANDWIDTH_BATCH` calls back to back (the kernels' time; each call's own time from an
    idle GPU, which adds its launch, is reported beside it)."""
    tk = kernels.triton_kernels()
    N = 8192
    M = n_elems // N
    gen = torch.Generator(device=device).manual_seed(0)
    base = torch.randn(M, N, generator=gen, device=device).to(dtype)
    lora = torch.randn(M, N, generator=gen, device=device).to(dtype)
    g = 1 + 1e-3 * torch.randn(N, generator=gen, device=device)
    es = base.element_size()
    calls = {
        "copy (clone)": (lambda: base.clone(), 2),
        "compose inference": (lambda: tk.compose_forward(base, lora, g, 0.5), 3),
        "compose training forward (y, inner)": (lambda: tk.compose_forward(base, lora, g, 0.5, write_inner=True), 4),
        "compose backward (d_base, d_lora, d_g)": (
            lambda: tk.compose_backward(base, g, lora, 0.5, dtype, dtype),
            4,
        ),  # dy = base, inner = lora
        "compose backward (d_base, d_g): the layer step's": (
            lambda: tk.compose_backward(base, g, lora, 0.5, dtype, None),
            3,
        ),
    }
    fns = {k: v[0] for k, v in calls.items()}
    ms = interleaved(fns, reps, warmup, device, batch=BANDWIDTH_BATCH)
    alone = interleaved(fns, reps, warmup, device)
    out = {
        k: dict(ms=ms[k], gbps=v[1] * M * N * es / ms[k] / 1e6, ms_alone=alone[k], arrays=v[1])
        for k, v in calls.items()
    }
    base = lora = None  # freed
    return out


def print_bandwidth(bw, n, dtype):
    copy = bw["copy (clone)"]["gbps"]
    print(f"\n### Composition kernels, {n / 1e6:.0f} M elements, {str(dtype).removeprefix('torch.')}\n")
    print(
        f"| kernel | arrays moved | ms ({BANDWIDTH_BATCH} back to back) | GB/s | of copy bandwidth | ms, one call "
        f"from an idle GPU |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for k, v in bw.items():
        print(
            f"| {k} | {v['arrays']} | {v['ms']:.3f} | {v['gbps']:.0f} | {v['gbps'] / copy:.1%} | {v['ms_alone']:.3f} |"
        )


def factored_norm(device, d_out=8192, d_in=8192, r=512):
    """‖W + sBA‖_row: juno-py's factored norm (no d_out×d_in matrix) vs PEFT's (builds B·A and W + sBA):
    transient memory and error against fp64."""
    d = layer_data(16, d_in, d_out, r, device, seed=1)
    layer = juno_layer(DenseBase(d["W"]), d)
    ref = row_norm_fp64(d["W"], d["A"], d["B"], d["s"])
    out = {}
    got = {}
    out["juno-py factored"] = peak_mib(lambda: got.__setitem__("juno", layer.weight_row_norm()), device)
    peft = peft_layer(d, True, torch.float32)
    dora = peft.lora_magnitude_vector["default"]
    A, B = peft.lora_A["default"], peft.lora_B["default"]
    scaling = peft.scaling["default"]

    def peft_norm():  # what PEFT's DoRA forward runs for the norm, with bf16 activations
        lora_weight = dora.get_lora_weight(lora_A=A, lora_B=B).to(torch.bfloat16)
        weight = peft.get_base_layer().weight.to(torch.bfloat16)
        got["peft"] = dora.get_weight_norm(weight=weight, lora_weight=lora_weight.detach(), scaling=scaling)

    with torch.no_grad():
        out["PEFT DoRA (fp32 adapters)"] = peak_mib(peft_norm, device)
    err = {k: ((v.double() - ref).abs() / ref).max().item() for k, v in got.items()}
    return dict(mem=out, err=err, shape=(d_out, d_in, r))


def print_norm(res):
    d_out, d_in, r = res["shape"]
    j, p = res["mem"]["juno-py factored"], res["mem"]["PEFT DoRA (fp32 adapters)"]
    print(f"\n### DoRA row norm ‖W + sBA‖, {d_out}×{d_in}, r={r}\n")
    print("| implementation | transient MiB | max relative error vs fp64 |")
    print("|---|---:|---:|")
    print(f"| juno-py factored | {j:.1f} | {res['err']['juno']:.2e} |")
    print(f"| PEFT DoRA (fp32 adapters, bf16 activations) | {p:.1f} | {res['err']['peft']:.2e} |")
    print(f"\nPEFT transient / juno-py transient: {p / j:.1f}×")


# ---------------------------------------------------------------------------------------------------- crossover
def crossover(device, dtypes=(torch.bfloat16, torch.float32), reps=7, batch=20):
    """Eager vs fused composition by size (fwd+bwd with every gradient, and inference), wall time per call in a
    loop of `batch` calls (the cost a training loop sees: launch overhead below, bandwidth above)."""
    tk = kernels.triton_kernels()
    rows = []
    for dtype in dtypes:
        for N in (576, 4096):
            for M in (1, 4, 16, 64, 256, 1024, 4096, 16384):
                gen = torch.Generator(device=device).manual_seed(0)
                base = torch.randn(M, N, generator=gen, device=device).to(dtype).requires_grad_(True)
                lora = torch.randn(M, N, generator=gen, device=device).to(dtype).requires_grad_(True)
                g = (1 + 1e-3 * torch.randn(N, generator=gen, device=device)).requires_grad_(True)
                dy = torch.randn(M, N, generator=gen, device=device).to(dtype)

                def eager_train():
                    base.grad = lora.grad = g.grad = None
                    compose_eager(base, lora, g, 0.5).backward(dy)

                def fused_train():
                    base.grad = lora.grad = g.grad = None
                    tk.DoraComposeFn.apply(base, lora, g, 0.5).backward(dy)

                def eager_infer():
                    with torch.no_grad():
                        compose_eager(base, lora, g, 0.5)

                def fused_infer():
                    with torch.no_grad():
                        tk.compose_forward(base.detach(), lora.detach(), g.detach(), 0.5)

                fns = dict(
                    eager_train=eager_train, fused_train=fused_train, eager_infer=eager_infer, fused_infer=fused_infer
                )
                res = {k: [] for k in fns}
                for f in fns.values():
                    f()
                torch.cuda.synchronize()
                for _ in range(reps):
                    for k, f in fns.items():
                        t0 = time.perf_counter()
                        for _ in range(batch):
                            f()
                        torch.cuda.synchronize()
                        res[k].append((time.perf_counter() - t0) / batch * 1e6)
                med = {k: statistics.median(v) for k, v in res.items()}
                rows.append(dict(dtype=str(dtype).removeprefix("torch."), M=M, N=N, elements=M * N, **med))
    return rows


def print_crossover(rows):
    print("\n### Composition: eager vs fused, µs per call (wall, loop of 20)\n")
    print("| dtype | tokens × d_out | elements | eager fwd+bwd | fused fwd+bwd | eager inference | fused inference |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['dtype']} | {r['M']}×{r['N']} | {r['elements']} | {r['eager_train']:.1f} | "
            f"{r['fused_train']:.1f} | {r['eager_infer']:.1f} | {r['fused_infer']:.1f} |"
        )


def tiles(device, reps, warmup):
    """Bandwidth of a few tile configurations, forward and backward, bf16, 134 M elements."""
    tk = kernels.triton_kernels()
    N, M = 8192, (1 << 27) // 8192
    gen = torch.Generator(device=device).manual_seed(0)
    base = torch.randn(M, N, generator=gen, device=device).to(torch.bfloat16)
    lora = torch.randn(M, N, generator=gen, device=device).to(torch.bfloat16)
    g = 1 + 1e-3 * torch.randn(N, generator=gen, device=device)
    configs = [
        tk.TileConfig(16, 256, 4),
        tk.TileConfig(32, 256, 8),
        tk.TileConfig(8, 512, 4),
        tk.TileConfig(16, 512, 8),
        tk.TileConfig(32, 128, 4),
        tk.TileConfig(64, 256, 8),
        tk.TileConfig(16, 256, 4, 2048),
        tk.TileConfig(16, 256, 4, 512),
        tk.TileConfig(32, 256, 8, 4096),
        # more programs in the backward (fewer row tiles each: more bytes in flight per SM)
        tk.TileConfig(32, 128, 4, 4096),
        tk.TileConfig(32, 128, 8, 4096),
        tk.TileConfig(64, 128, 8, 4096),
        tk.TileConfig(16, 128, 4, 4096),
        tk.TileConfig(32, 128, 4, 8192),
        tk.TileConfig(64, 64, 4, 8192),
        # one row tile per program (as the forward): d_g's partial sums get a row per row tile
        tk.TileConfig(32, 128, 4, 1 << 20),
        tk.TileConfig(16, 256, 4, 1 << 20),
        tk.TileConfig(64, 128, 8, 1 << 20),
        tk.TileConfig(16, 128, 4, 1 << 20),
        tk.TileConfig(64, 256, 8, 1 << 20),
        tk.TileConfig(32, 256, 8, 1 << 20),
    ]
    calls = {"copy": lambda: base.clone()}
    for c in configs:
        calls[f"fwd {c}"] = lambda c=c: tk.compose_forward(base, lora, g, 0.5, cfg=c)
        calls[f"bwd {c}"] = lambda c=c: tk.compose_backward(base, g, lora, 0.5, torch.bfloat16, torch.bfloat16, cfg=c)
        calls[f"bwd-step {c}"] = lambda c=c: tk.compose_backward(base, g, lora, 0.5, torch.bfloat16, None, cfg=c)
    ms = interleaved(calls, reps, warmup, device, batch=BANDWIDTH_BATCH)
    bytes_per = {"copy": 2, "fwd": 3, "bwd": 4, "bwd-step": 3}  # bwd-step: the layer step's, without d_lora
    copy = 2 * M * N * 2 / ms["copy"] / 1e6
    print("\n### Tile configurations (bf16, 134 M elements)\n")
    print("| kernel, config | ms | GB/s | of copy |")
    print("|---|---:|---:|---:|")
    for k, v in ms.items():
        gbps = bytes_per[k.split()[0]] * M * N * 2 / v / 1e6
        print(f"| {k} | {v:.3f} | {gbps:.0f} | {100 * gbps / copy:.1f} % |")


# ---------------------------------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (smoke test of this script)")
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--crossover", action="store_true", help="only the eager/fused size sweep")
    ap.add_argument("--tiles", action="store_true", help="only the tile-configuration sweep")
    ap.add_argument("--no-quant", action="store_true", help="skip the quantized juno-py layers")
    ap.add_argument("--no-norm", action="store_true", help="skip the factored-norm memory and error table")
    ap.add_argument(
        "--quant-only",
        action="store_true",
        help="only juno-py dense and quantized (no PEFT layers): the quantized-W ratios",
    )
    ap.add_argument("--shape-index", type=int, nargs="*", help="run only these entries of SHAPES (0-based)")
    ap.add_argument(
        "--bandwidth-elements",
        type=int,
        nargs="*",
        default=[1 << 27, 1 << 28],
        help="sizes of the kernel bandwidth tables (none: skip them)",
    )
    ap.add_argument(
        "--graphed",
        action="store_true",
        help="also time each fwd+bwd and inference call captured in a CUDA graph (GPU time alone)",
    )
    ap.add_argument("--json", type=Path, help="also write every number here")
    ap.add_argument(
        "--u-ab",
        action="store_true",
        help="also juno-py layers that recompute U = W·Aᵀ at every step (no running U), interleaved",
    )
    ap.add_argument(
        "--device-scratch-mib",
        type=int,
        default=None,
        help="the quantized layers' decode tile in MiB (default: FrozenQuantLinear's)",
    )
    harness.add_output_args(ap)
    args = ap.parse_args()
    global DEVICE_SCRATCH_BYTES
    if args.device_scratch_mib is not None:
        DEVICE_SCRATCH_BYTES = args.device_scratch_mib << 20

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    env = harness.environment(device.type)
    print(env["hardware"], env["software"])
    if device.type != "cuda":
        print("smoke test, no GPU numbers (eager composition on the CPU)")
    out = {}
    if args.crossover:
        out["crossover"] = crossover(device)
        print_crossover(out["crossover"])
    elif args.tiles:
        tiles(device, args.reps, args.warmup)
    else:
        shapes = QUICK_SHAPES if args.quick else SHAPES
        if args.shape_index is not None and not args.quick:
            shapes = [SHAPES[i] for i in args.shape_index]
        reps = min(args.reps, 5) if args.quick else args.reps
        if device.type == "cuda":
            out["bandwidth"] = {}
            for n in args.bandwidth_elements:
                for dtype in (torch.bfloat16, torch.float32):
                    bw = bandwidth(n, dtype, device, args.reps, args.warmup)
                    print_bandwidth(bw, n, dtype)
                    out["bandwidth"][f"{n}-{dtype}"] = bw
                    torch.cuda.empty_cache()
        out["layers"] = []
        for T, d_in, d_out, r in shapes:
            res = bench_shape(
                T,
                d_in,
                d_out,
                r,
                device,
                reps,
                1 if args.quick else args.warmup,
                with_quant=not args.no_quant and device.type == "cuda",
                peers=not args.quant_only,
                graphed=args.graphed,
                u_ab=args.u_ab,
            )
            print_layer_table(res)
            out["layers"].append(res)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        targets, summary = print_targets(out["layers"])
        if targets:
            harness.write_results(
                args,
                harness.results(
                    "dora-layer",
                    "One DoRA layer on one GPU against PEFT",
                    harness.command_line("benchmarks.dora_layer"),
                    TARGET_COLUMNS,
                    targets,
                    [
                        "Ratios of times: \"PEFT / juno-py\" reads the peer's time over juno-py's. CUDA events, "
                        "implementations interleaved, median of the calls after warm-up, TF32 off. Graphed: each call "
                        "captured in a CUDA graph and replayed (the GPU's time alone, how the trainer runs its steps); "
                        "eager: each call launched from Python.",
                        summary,
                    ],
                    env=env,
                ),
            )
        if device.type == "cuda" and not args.no_norm:
            out["norm"] = factored_norm(device)
            print_norm(out["norm"])
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
