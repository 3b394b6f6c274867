"""The decode step with its fused kernels (`kernels.decode_triton`: each residual addition with the norm after it
and the x·Aᵀ of the LoRAs that read it, RoPE with the cache writes) gives the logits of the same step through the
blocks' own modules bit for bit: llama (adjacent-pair RoPE, grouped queries), qwen2 (halves RoPE, q/k/v biases) and
gemma3 (sandwich norms, sliding windows shorter than the sequence; its q/k norms keep RoPE unfused), with a LoRA on
every linear and without adapters, in bf16 and fp32 activations. On the GPU the linears that read one input run as
grouped GEMVs there (gate and up with the activation), and the comparison covers them too. With the fused attention
the logits are SDPA's within its rounding. Interpreted on the CPU under JUNO_PY_KERNELS=fused, compiled on the
GPU."""

import pytest
import torch

pytest.importorskip("triton")

from juno_py.gguf import GGMLType  # noqa: E402
from juno_py.kernels import elementwise  # noqa: E402
from juno_py.lora import attach, load_adapters  # noqa: E402
from juno_py.models import load_model  # noqa: E402
from juno_py.models.decode_cuda import CudaGraphDecoder  # noqa: E402
from juno_py.models.generate import prefill  # noqa: E402
from juno_py.testing.tiny_models import sample_ids  # noqa: E402
from tests.kernels.conftest import DEVICE  # noqa: E402
from tests.models.decode_checks import WIDE, randomize  # noqa: E402


def _steps(model, prompt, tokens, fused, attend=True):
    with torch.no_grad():
        cache = model.new_cache(batch=1, max_len=len(prompt) + len(tokens))
        prefill(model, torch.tensor([prompt]), cache)
        decoder = CudaGraphDecoder.build(model, cache, graph=False, fused=fused)
        assert decoder is not None
        decoder.fused_attn = decoder.fused_attn and attend
        logits = torch.stack([decoder.step(t).clone() for t in tokens])
        return logits, decoder


@pytest.mark.parametrize(
    "arch,dtype,adapter",
    [
        ("llama", torch.bfloat16, True),
        ("llama", torch.float32, True),
        ("llama", torch.bfloat16, False),
        ("qwen2", torch.bfloat16, True),
        ("qwen2", torch.float32, True),
        ("gemma3", torch.bfloat16, True),
        ("gemma3", torch.float32, True),
    ],
)
def test_fused_step_kernels_give_the_unfused_steps_bits(tiny_gguf, tmp_path, monkeypatch, arch, dtype, adapter):
    monkeypatch.setenv("JUNO_PY_KERNELS", "fused")
    monkeypatch.setattr(elementwise, "INTERPRET_CPU", True)
    knobs = {"metadata": {"gemma3.attention.sliding_window": 4}} if arch == "gemma3" else {"config": WIDE}
    path = tiny_gguf(arch, GGMLType.Q8_0, **knobs)
    model = load_model(path, device=DEVICE, compute_dtype=dtype)
    if adapter:
        aset = attach(load_model(path), "all", rank=3, alpha=6.0, seed=4)
        randomize(aset, seed=5)
        load_adapters(model, [str(aset.save(tmp_path / "a.bin"))])
    prompt, tokens = sample_ids(3, seed=7), sample_ids(5, seed=8)
    got, decoder = _steps(model, prompt, tokens, fused=None, attend=False)
    assert decoder.fused_norms and decoder.fused_rope == (arch != "gemma3")
    # on the GPU the linears that read one input run as grouped GEMVs (gate and up with the activation)
    assert len(decoder.shared) == (2 * model.args.n_layer if adapter else 0)
    assert all(len(p.groups) == (DEVICE == "cuda") for p in decoder.shared.values())
    assert (len(decoder.plain) > 0) == (DEVICE == "cuda" and not adapter)
    want, plain = _steps(model, prompt, tokens, fused=False)
    assert not plain.fused_norms and not plain.fused_rope and not plain.fused_attn and not plain.plain
    assert not any(p.groups for p in plain.shared.values())
    assert torch.equal(got, want), f"max |Δ| {(got - want).abs().max().item():.3g}"
    # the fused attention (fp32 softmax and sums, where SDPA's bf16 kernels round their products) is close, not equal
    attended, fused = _steps(model, prompt, tokens, fused=None)
    assert fused.fused_attn
    err, scale = (attended - want).abs().max().item(), want.abs().max().item()
    assert err <= (1e-2 if dtype == torch.bfloat16 else 2e-6) * scale, f"max |Δ| {err:.3g} of {scale:.3g}"
