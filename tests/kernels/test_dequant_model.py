"""Whole models on the device path: tiny GGUF models (our writer) whose frozen linears decode with Triton, against
the eager CPU model. On the CPU (interpreter) every frozen linear is switched to dequant="triton"; on a GPU the
model is loaded with `device="cuda"` (quantized bytes resident there), and the GPU-only tests also train DoRA
through `juno-py lora --device cuda`, play it back with `local` and `eval`, and check the issue's acceptance:
‖logits_fused − logits_eager‖ ≤ 1e-2 · ‖logits_eager − logits_base‖ for a trained DoRA adapter.
"""

import pytest
import torch

pytest.importorskip("triton")

from juno_py.gguf import GGMLType  # noqa: E402
from juno_py.lora import Mode, attach  # noqa: E402
from juno_py.models import load_model  # noqa: E402
from tests.kernels.conftest import DEVICE  # noqa: E402

CUDA = DEVICE == "cuda"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
# hidden 256 and MLP 512: rows of 256·k columns, so the K-quant kernels run inside a whole model
KQ_CONFIG = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
)
IDS = [1, 5, 9, 200, 17, 42, 3, 77, 150, 8, 64, 99, 12, 250, 31]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def device_model(path, compute="fp32"):
    if CUDA:
        return load_model(path, device="cuda", compute_dtype=compute)
    model = load_model(path, compute_dtype=compute)
    for lin in model.frozen_linears():
        lin.dequant = "triton"  # the device path, run by Triton's interpreter on the CPU
    return model


def random_dora(model, seed=0):
    """DoRA on every target with B and m moved off their initial values, as training leaves them."""
    adapters = attach(model, "all", rank=4, alpha=8, mode=Mode.DORA, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for ad in adapters.adapters.values():
            ad.lora_B.copy_(torch.randn(ad.lora_B.shape, generator=gen) * 0.05)
            ad.magnitude.mul_(1 + 0.05 * torch.randn(ad.magnitude.shape, generator=gen).to(ad.magnitude.device))
    return adapters


# the interpreter needs about two minutes for the K-quant model on two cores: the GPU runs both, CI the Q8_0 one
@pytest.mark.parametrize("ggml_type", [GGMLType.Q8_0] + ([GGMLType.Q4_K] if CUDA else []), ids=lambda t: t.name)
def test_device_model_logits_match_eager_cpu(tiny_gguf, ggml_type):
    path = (
        tiny_gguf("llama", ggml_type, config=KQ_CONFIG) if ggml_type == GGMLType.Q4_K else tiny_gguf("llama", ggml_type)
    )
    eager = load_model(path)
    dev = device_model(path)
    with torch.no_grad():
        ref, got = eager.logits(IDS), dev.logits(IDS)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert float((got.cpu() - ref).abs().max()) <= 1e-3  # the forward-parity target (fp32)
    assert rel(got.cpu(), ref) <= 1e-5

    # a DoRA adapter: the device path's factored norms and compose agree with eager relative to its effect
    base = ref
    for m in (eager, dev):
        random_dora(m)
    with torch.no_grad():
        ref, got = eager.logits(IDS), dev.logits(IDS)
    assert rel(ref, base) > 1e-3  # the adapter changes the logits
    assert float((got.cpu() - ref).norm()) <= 1e-3 * float((ref - base).norm())


@needs_cuda
def test_bf16_activations_on_gpu(tiny_gguf):
    path = tiny_gguf("llama", GGMLType.Q4_K, config=KQ_CONFIG)
    model = load_model(path, device="cuda", compute_dtype="bf16")
    assert model.act_dtype == torch.bfloat16 and all(lin.raw.is_cuda for lin in model.frozen_linears())
    assert all(lin.weight_cache is None for lin in model.frozen_linears())  # quantized bytes, no copy
    with torch.no_grad():
        got = model.logits(IDS)
    ref = load_model(path).logits(IDS)
    assert got.dtype == torch.float32
    assert rel(got.cpu(), ref) <= 3e-2  # bf16 activations through two blocks


@needs_cuda
def test_trained_dora_fused_matches_eager_relative_to_adapter(tiny_gguf, monkeypatch):
    """The issue's GPU acceptance: train DoRA (all targets, bf16 compute, quantized base on the GPU), then play it
    with the fused kernels and with eager torch."""
    from juno_py.train.data import Example
    from juno_py.train.loop import TrainConfig, train

    path = tiny_gguf("llama", GGMLType.Q4_K, config=KQ_CONFIG)
    model = load_model(path, device="cuda", compute_dtype="bf16")
    with torch.no_grad():
        base = model.logits(IDS)
    adapters = attach(model, "all", rank=8, alpha=16, mode=Mode.DORA)
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 256, (16, 32), generator=gen)
    examples = [Example(r.tolist(), [True] * 32) for r in rows]
    cfg = TrainConfig(lr=5e-3, batch_size=4, max_steps=24, epochs=None, schedule="constant", max_seq_len=32)
    result = train(model, adapters, examples, cfg, progress=False, log=lambda s: None)
    assert result.last_loss < result.first_loss
    model.eval()
    logits = {}
    for mode in ("eager", "fused"):
        monkeypatch.setenv("JUNO_PY_KERNELS", mode)
        with torch.no_grad():
            logits[mode] = model.logits(IDS)
    effect = float((logits["eager"] - base).norm())
    assert effect > 1e-2 * float(base.norm())  # training moved the model
    assert float((logits["fused"] - logits["eager"]).norm()) <= 1e-2 * effect


@needs_cuda
def test_cli_lora_local_eval_on_cuda(tiny_gguf, tmp_path):
    from click.testing import CliRunner

    from juno_py.cli.main import cli

    path = tiny_gguf("llama", GGMLType.Q8_0)
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "the river flows on and on through the old town"}\n{"Q": "Who sings?", "A": "Juno."}\n')
    out = tmp_path / "a.bin"
    run = CliRunner().invoke
    r = run(
        cli,
        [
            "lora",
            "--model-path",
            str(path),
            "--data",
            str(data),
            "--lora-path",
            str(out),
            "--max-steps",
            "3",
            "--lora-mode",
            "dora",
            "--device",
            "cuda",
            "--no-progress",
        ],
        catch_exceptions=False,
    )
    assert r.exit_code == 0, r.stderr
    assert r.stdout == f"{out}\n" and "compute bfloat16" in r.stderr
    r = run(
        cli,
        ["eval", "--model-path", str(path), "--lora-play", str(out), "--data", str(data), "--device", "cuda", "--json"],
        catch_exceptions=False,
    )
    assert r.exit_code == 0, r.stderr
    assert '"loss"' in r.stdout
    r = run(
        cli,
        [
            "local",
            "--model-path",
            str(path),
            "--lora-play",
            str(out),
            "--prompt",
            "hi",
            "--max-tokens",
            "4",
            "--temperature",
            "0",
            "--device",
            "cuda",
        ],
        catch_exceptions=False,
    )
    assert r.exit_code == 0, r.stderr
