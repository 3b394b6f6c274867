"""The grouped expert path on a GPU (bf16 activations, Triton-decoded bf16 experts, `torch._grouped_mm`, which needs
compute capability 9.0) against the per-expert loop on the same device: logits and every adapter's gradient within
bf16 rounding, per-expert and shared LoRA, and gpt-oss's biased experts; the grouped path is the default there."""

import pytest
import torch

from juno_py.gguf import GGMLType
from juno_py.lora import attach
from juno_py.models import load_model
from juno_py.models import moe as moe_mod
from tests.kernels.conftest import DEVICE

SM90 = DEVICE == "cuda" and hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability() >= (9, 0)
needs_sm90 = pytest.mark.skipif(not SM90, reason="needs a CUDA GPU of compute capability 9.0+ (grouped GEMM)")

IDS = torch.randint(3, 200, (4, 32), generator=torch.Generator().manual_seed(7))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _run(path, expert_path, experts):
    model = load_model(path, device="cuda", compute_dtype="bf16")
    aset = attach(model, "all,router", rank=8, alpha=16, seed=0, experts=experts)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for ad in aset.adapters.values():
            ad.lora_B.copy_(torch.randn(ad.lora_B.shape, generator=g) * 0.1)
    for blk in model.blocks:
        blk.moe.expert_path = expert_path
    tokens = IDS.cuda()
    with torch.no_grad():
        logits = model.logits(tokens[0].tolist()).float().cpu()
    model.loss(tokens, tokens.roll(-1, 1)).backward()
    grads = torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).float().reshape(-1).cpu()
            for _, p in sorted(aset.named_parameters())
        ]
    )
    return logits, grads


CASES = [("qwen3moe", "per-expert"), ("qwen3moe", "shared"), ("gpt-oss", "per-expert")]


@needs_sm90
@pytest.mark.parametrize("arch,experts", CASES, ids=[f"{a}-{e}" for a, e in CASES])
def test_cuda_grouped_matches_the_loop(tiny_gguf, arch, experts, monkeypatch):
    path = tiny_gguf(arch, GGMLType.Q8_0)
    want_logits, want_grads = _run(path, "loop", experts)
    calls = []
    real = moe_mod.grouped_matmul
    monkeypatch.setattr(moe_mod, "grouped_matmul", lambda *a: calls.append(1) or real(*a))
    got_logits, got_grads = _run(path, "auto", experts)
    assert calls, "the grouped path is not the default on this GPU"
    assert want_grads.abs().max() > 0
    assert rel(got_logits, want_logits) <= 1e-2
    assert rel(got_grads, want_grads) <= 3e-2


def _synthetic_step(expert_path, device, shape, dtype):
    """One layer of the benchmark's Q4_K qwen3moe at `shape`, per-expert LoRA on attention and experts (B moved off
    zero): logits and the adapters' gradients of one loss."""
    import argparse

    from benchmarks.moe_gpu import qwen3moe_tensors
    from juno_py.models import Transformer

    a = argparse.Namespace(**shape)
    meta, tensors = qwen3moe_tensors(a, device)
    model = Transformer.from_tensors(meta, tensors, compute_dtype=dtype, label="synthetic-qwen3moe")
    model.place(device)
    aset = attach(model, "attn,experts", rank=8, alpha=16, seed=0, experts="per-expert")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for ad in aset.adapters.values():
            ad.lora_B.copy_(torch.randn(ad.lora_B.shape, generator=g) * 0.05)
    for blk in model.blocks:
        blk.moe.expert_path = expert_path
    ids = torch.randint(0, a.vocab, (2, 256), generator=torch.Generator().manual_seed(3)).to(device)
    loss = model.loss(ids, ids.roll(-1, 1))
    loss.backward()
    grads = torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).float().reshape(-1).cpu()
            for _, p in sorted(aset.named_parameters())
        ]
    )
    return loss.detach().float().cpu(), grads


QWEN3_30B_LAYER = dict(layers=1, experts=128, top_k=8, n_embd=2048, n_ff_exp=768, heads=32, kv_heads=4, vocab=4096)


@needs_sm90
def test_cuda_grouped_matches_the_loop_at_qwen3_30b_shape():
    """A Qwen3-30B-A3B layer (128 Q4_K experts of 768, top 8, 512 tokens): the whole-projection decode and the
    grouped products at the real shapes."""
    want_loss, want_grads = _synthetic_step("loop", "cuda", QWEN3_30B_LAYER, torch.bfloat16)
    got_loss, got_grads = _synthetic_step("auto", "cuda", QWEN3_30B_LAYER, torch.bfloat16)
    assert want_grads.abs().max() > 0
    assert abs(float(got_loss - want_loss)) <= 1e-2 * abs(float(want_loss))
    assert rel(got_grads, want_grads) <= 3e-2


@needs_sm90
def test_cuda_grouped_block_never_waits_on_the_host(tiny_gguf):
    """Forward and backward of an MoE block on the grouped path issue no synchronizing call (the loop reads its
    group sizes on the host once per block)."""
    model = load_model(tiny_gguf("gpt-oss", GGMLType.Q8_0), device="cuda", compute_dtype="bf16")
    attach(model, "experts", rank=8, alpha=16, seed=0)
    blk = model.blocks[0]
    x = torch.randn(64, model.args.n_embd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert blk.moe.runs_grouped(x)
    blk.moe(x, blk.linears["wrouter"])  # the first call builds the grouped views (once)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = blk.moe(x, blk.linears["wrouter"])
        y.float().square().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert x.grad is not None and x.grad.abs().max() > 0
