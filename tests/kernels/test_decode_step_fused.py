"""The decode step with its fused kernels (`kernels.decode_triton`: each residual addition with the norm after it,
RoPE with the cache writes) gives the logits of the same step through the blocks' own modules bit for bit: llama
(adjacent-pair RoPE, grouped queries), qwen2 (halves RoPE, q/k/v biases) and gemma3 (sandwich norms; its q/k norms
keep RoPE unfused), played with a LoRA on every linear, in bf16 and fp32 activations. Interpreted on the CPU under
JUNO_PY_KERNELS=fused, compiled on the GPU."""

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


def _steps(model, prompt, tokens, fused):
    with torch.no_grad():
        cache = model.new_cache(batch=1, max_len=len(prompt) + len(tokens))
        prefill(model, torch.tensor([prompt]), cache)
        decoder = CudaGraphDecoder.build(model, cache, graph=False, fused=fused)
        assert decoder is not None
        logits = torch.stack([decoder.step(t).clone() for t in tokens])
        return logits, decoder


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_fused_step_kernels_give_the_unfused_steps_bits(tiny_gguf, tmp_path, monkeypatch, arch, dtype):
    monkeypatch.setenv("JUNO_PY_KERNELS", "fused")
    monkeypatch.setattr(elementwise, "INTERPRET_CPU", True)
    knobs = {"metadata": {"gemma3.attention.sliding_window": 4}} if arch == "gemma3" else {"config": WIDE}
    path = tiny_gguf(arch, GGMLType.Q8_0, **knobs)
    aset = attach(load_model(path), "all", rank=3, alpha=6.0, seed=4)
    randomize(aset, seed=5)
    model = load_model(path, device=DEVICE, compute_dtype=dtype)
    load_adapters(model, [str(aset.save(tmp_path / "a.bin"))])
    prompt, tokens = sample_ids(3, seed=7), sample_ids(5, seed=8)
    got, decoder = _steps(model, prompt, tokens, fused=None)
    assert decoder.fused_norms and decoder.fused_rope == (arch != "gemma3")
    want, plain = _steps(model, prompt, tokens, fused=False)
    assert not plain.fused_norms and not plain.fused_rope
    assert torch.equal(got, want), f"max |Δ| {(got - want).abs().max().item():.3g}"
