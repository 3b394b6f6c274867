"""Decoding from the quantized bytes: the native fused dequantize-dot products (`native.matvec`) against the decoded
weights in float64, for every type they cover and every vector width this CPU runs; `NativeDecoder` steps against
the model's forward over dequantized weights (JUNO_PY_NATIVE=0: blocks decoded by the torch codecs, then GEMM), on
every architecture, with several LoRAs at their scales and with DoRA; the fallback where the library is missing;
greedy tokens of the real SmolLM2."""

import numpy as np
import pytest
import torch

from juno_py import threads
from juno_py.gguf import GGMLType, GGUFFile, quants
from juno_py.gguf.constants import GGML_BLOCK_SIZES
from juno_py.gguf.quants import native
from juno_py.gguf.quants.simple import F16_SCALE_OFFSETS
from juno_py.lora import Mode, attach, load_adapters
from juno_py.models import Transformer, load_model
from juno_py.models.decode import NativeDecoder
from juno_py.models.generate import generate, prefill
from juno_py.testing.blocks import ALL_TYPES, random_rows
from juno_py.testing.tiny_models import sample_ids
from tests.models.decode_checks import (
    WIDE,
    assert_logits_close,
    decoder_steps,
    forward_steps,
    randomize,
    two_loras_played,
)

MATVEC_TYPES = [GGMLType(t) for t in sorted(native.MATVEC_TYPES)]
# the types the tiny models are written in (what our quantizer encodes among the common ones)
MODEL_TYPES = [
    GGMLType.F32,
    GGMLType.F16,
    GGMLType.BF16,
    GGMLType.Q4_0,
    GGMLType.Q4_1,
    GGMLType.Q5_0,
    GGMLType.Q8_0,
    GGMLType.Q4_K,
    GGMLType.Q5_K,
    GGMLType.Q6_K,
]
ARCHS = ["llama", "qwen2", "qwen3", "phi3", "gemma3"]
# rows of whole k-quant super-blocks (256): the tiny models' widths, scaled up


@pytest.fixture(scope="module")
def lib():
    found = native.library()
    if found is None:
        pytest.skip("the native library is not available here (no C compiler, or JUNO_PY_NATIVE=0)")
    return found


def valid_rows(ggml_type: GGMLType, n_rows: int, n_in: int, seed: int) -> torch.Tensor:
    """uint8 `[n_rows, row_bytes]` of random blocks whose scales are finite and moderate."""
    if ggml_type in ALL_TYPES:
        return torch.from_numpy(random_rows(ggml_type, n_rows, n_in, seed).copy())
    rng = np.random.default_rng(seed)
    block, size = GGML_BLOCK_SIZES[ggml_type]
    blocks = rng.integers(0, 256, size=(n_rows * n_in // block, size), dtype=np.uint8)
    for offset in F16_SCALE_OFFSETS.get(ggml_type, ()):
        scale = rng.uniform(2.0**-8, 2.0**-3, len(blocks)) * rng.choice([-1.0, 1.0], len(blocks))
        blocks[:, offset : offset + 2] = scale.astype("<f2").view(np.uint8).reshape(-1, 2)
    if ggml_type == GGMLType.MXFP4:
        blocks[:, 0] = rng.integers(118, 128, len(blocks))  # e8m0 scales 2^-10 .. 2^-1
    if ggml_type == GGMLType.IQ1_M:  # the float16 scale is the top nibbles of the uint16s at byte 48
        words = blocks[:, 48:56].copy().view("<u2")
        words &= 0x0FFF
        words |= np.array([0x0000, 0x2000, 0x0000, 0x2000], dtype="<u2")  # 0x2000: 2^-7
        blocks[:, 48:56] = words.view(np.uint8)
    return torch.from_numpy(blocks.reshape(n_rows, -1))


def assert_products_close(got: torch.Tensor, W: torch.Tensor, x: torch.Tensor, what: str) -> None:
    """`got` equals W·x (float64 over the decoded W) within float32 rounding of the row's sum of |w·x|: a sum of
    n float32 products is within n·2^-24 of it, relative to that sum."""
    exact = W.double() @ x.double()
    scale = W.double().abs() @ x.double().abs()
    bound = W.shape[1] * 2.0**-24 * scale + 1e-30
    err = (got.double() - exact).abs()
    assert bool((err <= bound).all()), f"{what}: worst error {float((err / bound).max()):.2f} of the bound"


@pytest.mark.parametrize("ggml_type", MATVEC_TYPES, ids=lambda t: t.name)
def test_matvec_equals_the_decoded_weights_product(lib, ggml_type):
    n_in = 512 if GGML_BLOCK_SIZES[ggml_type][0] > 1 else 515  # float rows: a tail beyond the vector width
    raw = valid_rows(ggml_type, 37, n_in, seed=int(ggml_type))
    W = quants.dequantize(ggml_type, raw, n_in)
    assert torch.isfinite(W).all()
    x = torch.randn(3, n_in, generator=torch.Generator().manual_seed(1))
    got = native.matvec(ggml_type, raw, x, threads=1)
    assert got is not None and got.shape == (3, 37)
    for i in range(3):
        assert_products_close(got[i], W, x[i], ggml_type.name)
    # the rows split in chunks over threads: each row is still one thread's sum, the same bits
    for n in (2, 3):
        assert torch.equal(native.matvec(ggml_type, raw, x, threads=n), got)


def test_matvec_tasks_share_one_call_and_rows_of_a_view(lib):
    raw = valid_rows(GGMLType.Q4_K, 300, 1024, seed=3)  # several chunks per task
    x = torch.randn(1024)
    W = quants.dequantize(GGMLType.Q4_K, raw, 1024)
    ys = [torch.empty(100), torch.empty(200)]
    tasks = [
        native.task_for(GGMLType.Q4_K, raw[:100], x, ys[0]),
        native.task_for(GGMLType.Q4_K, raw[100:], x, ys[1]),
    ]
    native.MatvecPlan(lib, tasks).run(2)
    assert_products_close(torch.cat(ys), W, x, "two tasks")
    with pytest.raises(ValueError, match="expected uint8"):
        native.task_for(GGMLType.Q4_K, raw, x[:512], torch.empty(300))


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64-v2"], ids=["8 lanes (AVX2)", "4 lanes (SSE)"])
def test_narrower_vector_builds_give_the_same_products(lib, march, tmp_path):
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 builds")
    compiler = native.find_compiler()
    path = tmp_path / f"native_decode-{march}.so"
    native.build(compiler, path, tuple(f if f != "-march=native" else f"-march={march}" for f in native.FLAGS))
    other = native.open_library(path)
    for t in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.Q3_K, GGMLType.Q4_K):
        raw = valid_rows(t, 9, 512, seed=5)
        W = quants.dequantize(t, raw, 512)
        x = torch.randn(512)
        y = torch.empty(9)
        native.MatvecPlan(other, [native.task_for(t, raw, x, y)]).run(2)
        assert_products_close(y, W, x, f"{t.name} at {march}")
    for t in (GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.F16, GGMLType.BF16, GGMLType.IQ2_XS):
        raw = valid_rows(t, 9, 512, seed=5)
        W = quants.dequantize(t, raw, 512)
        x = torch.randn(512)
        y = torch.empty(9)
        native.MatvecPlan(other, [native.task_for(t, raw, x, y)]).run(1)
        assert_products_close(y, W, x, f"{t.name} at {march}")


# ---- the decoder against the model's forward ----------------------------------------------------------------


def reference_steps(model, prompt, tokens, monkeypatch):
    """Logits after the prompt and after each token, by the forward over dequantized blocks (no native code)."""
    with monkeypatch.context() as m:
        m.setenv("JUNO_PY_NATIVE", "0")
        return forward_steps(model, prompt, tokens)


def native_steps(model, prompt, tokens):
    return decoder_steps(NativeDecoder, model, prompt, tokens)


@pytest.mark.parametrize("ggml_type", MODEL_TYPES, ids=lambda t: t.name)
def test_decoder_logits_equal_the_forward_for_every_type(lib, tiny_gguf, ggml_type, monkeypatch):
    model = load_model(tiny_gguf("llama", ggml_type, config=WIDE))
    prompt, tokens = sample_ids(5, seed=1), sample_ids(7, seed=2)
    assert_logits_close(native_steps(model, prompt, tokens), reference_steps(model, prompt, tokens, monkeypatch))


@pytest.mark.parametrize("arch", ARCHS)
def test_decoder_logits_equal_the_forward_for_every_architecture(lib, tiny_gguf, arch, monkeypatch):
    # gemma3: sandwich norms, q/k norms, embedding scale and sliding windows shorter than the sequence
    knobs = {"metadata": {"gemma3.attention.sliding_window": 4}} if arch == "gemma3" else {}
    model = load_model(tiny_gguf(arch, GGMLType.Q8_0, **knobs))
    prompt, tokens = sample_ids(3, seed=3), sample_ids(9, seed=4)
    assert_logits_close(native_steps(model, prompt, tokens), reference_steps(model, prompt, tokens, monkeypatch))


def test_decoder_plays_several_loras_at_their_scales(lib, tiny_gguf, tmp_path, monkeypatch):
    path = tiny_gguf("qwen2", GGMLType.Q4_K, config=WIDE)  # biases on q, k and v
    model = two_loras_played(path, tmp_path)
    prompt, tokens = sample_ids(4, seed=5), sample_ids(6, seed=6)
    got, ref = native_steps(model, prompt, tokens), reference_steps(model, prompt, tokens, monkeypatch)
    assert_logits_close(got, ref)
    # the adapters are played: the base alone gives other logits
    base = reference_steps(load_model(path), prompt, tokens, monkeypatch)
    assert (base - ref).abs().max().item() > 100 * (got - ref).abs().max().item()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decoder_plays_dora(lib, tiny_gguf, tmp_path, arch, monkeypatch):
    path = tiny_gguf(arch, GGMLType.Q6_K, config=WIDE)
    trainee = load_model(path)
    aset = attach(trainee, "all", rank=4, alpha=8.0, mode=Mode.DORA, seed=2)
    randomize(aset, seed=3)
    model = load_model(path)
    load_adapters(model, [str(aset.save(tmp_path / "d.bin"))])
    prompt, tokens = sample_ids(4, seed=7), sample_ids(6, seed=8)
    got, ref = native_steps(model, prompt, tokens), reference_steps(model, prompt, tokens, monkeypatch)
    assert_logits_close(got, ref)
    base = reference_steps(load_model(path), prompt, tokens, monkeypatch)
    assert (base - ref).abs().max().item() > 100 * (got - ref).abs().max().item()


def test_generate_takes_the_decoder_and_its_tokens_are_the_forwards(lib, tiny_gguf, monkeypatch):
    model = load_model(tiny_gguf("llama", GGMLType.Q4_1))
    ids = sample_ids(4, seed=9)
    steps = []
    real_step = NativeDecoder.step
    monkeypatch.setattr(NativeDecoder, "step", lambda self, t: steps.append(t) or real_step(self, t))
    fast = generate(model, ids, 12)
    assert steps == fast[:-1]  # every token after the first came from a native step
    with monkeypatch.context() as m:
        m.setenv("JUNO_PY_NATIVE", "0")
        assert generate(model, ids, 12) == fast


def test_without_the_native_library_generation_uses_the_forward(tiny_gguf, monkeypatch):
    model = load_model(tiny_gguf("llama", GGMLType.Q8_0))
    ids = sample_ids(4, seed=12)
    expect = generate(model, ids, 6, native=False)
    monkeypatch.setenv("JUNO_PY_NATIVE", "0")
    cache = model.new_cache(batch=1, max_len=8)
    assert NativeDecoder.unsupported(model, cache) == "the native library is unavailable"
    assert NativeDecoder.build(model, cache) is None
    assert generate(model, ids, 6) == expect


def test_models_the_decoder_does_not_cover_say_why(lib, tiny_gguf):
    model = load_model(tiny_gguf("llama", GGMLType.Q8_0)).set_activation_dtype(torch.float64)
    assert NativeDecoder.unsupported(model) == "the activations run in torch.float64"
    model = load_model(tiny_gguf("llama", GGMLType.Q8_0))
    aset = attach(model, "qv", rank=2, dropout=0.1, seed=0)
    aset.train()
    assert "dropout" in NativeDecoder.unsupported(model)


def test_prefill_in_blocks_equals_one_pass(tiny_gguf):
    model = load_model(tiny_gguf("gemma3", GGMLType.Q8_0, metadata={"gemma3.attention.sliding_window": 4}))
    ids = torch.tensor([sample_ids(11, seed=13)])
    with torch.no_grad():
        one = prefill(model, ids, model.new_cache(1, 11))
        blocks = prefill(model, ids, model.new_cache(1, 11), block=3)
    assert (one - blocks).abs().max().item() <= 1e-5 * one.abs().max().item()


@pytest.mark.slow
def test_smollm2_greedy_tokens_are_the_forwards(lib, smollm2_path, monkeypatch):
    threads.apply(2)
    model = Transformer.from_gguf(GGUFFile(smollm2_path))
    ids = model.tokenizer.encode("The three primary colours are")
    fast = generate(model, ids, 32)
    with monkeypatch.context() as m:
        m.setenv("JUNO_PY_NATIVE", "0")
        slow = generate(model, ids, 32)
    assert fast == slow


def test_generate_tells_the_thread_guard_every_decode_step(lib, tiny_gguf):
    seen = []

    class Recording(threads.StallGuard):
        def observe(self, seconds, work=1.0):
            seen.append((seconds, work))
            return self.threads

    model = load_model(tiny_gguf("llama", GGMLType.Q8_0))
    out = generate(model, sample_ids(3, seed=14), 7, thread_guard=Recording(1, fixed=True))
    assert len(out) == 7 and len(seen) == 6 and all(s > 0 and w == 1 for s, w in seen)
