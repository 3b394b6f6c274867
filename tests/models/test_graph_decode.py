"""Static-cache decode steps (`CudaGraphDecoder`): run eagerly on the CPU, their logits equal the model's forward
within float32 rounding on every architecture (gemma3 with sliding windows shorter than the sequence, GQA models),
with several LoRAs at their scales and with DoRA; mixture-of-experts models say why they cannot take the path and
generation decodes them through the forward. On CUDA: a replayed graph gives the eager step's logits exactly, and
greedy generation gives the forward path's tokens."""

import pytest
import torch

from juno_py.gguf import GGMLType
from juno_py.lora import Mode, attach, load_adapters
from juno_py.models import load_model
from juno_py.models.decode_cuda import CudaGraphDecoder
from juno_py.models.generate import generate, prefill
from juno_py.testing.tiny_models import sample_ids
from tests.models.decode_checks import (
    WIDE,
    assert_logits_close,
    decoder_steps,
    forward_steps,
    randomize,
    two_loras_played,
)

ARCHS = ["llama", "qwen2", "qwen3", "phi3", "gemma3"]
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")


def static_steps(model, prompt, tokens, graph=None):
    return decoder_steps(CudaGraphDecoder, model, prompt, tokens, graph=graph)


@pytest.mark.parametrize("arch", ARCHS)
def test_static_steps_equal_the_forward_for_every_architecture(tiny_gguf, arch):
    # gemma3: sandwich norms, q/k norms, embedding scale and sliding windows shorter than the sequence;
    # llama, qwen2, phi3: 4 query heads over 2 key/value heads; qwen3: 2 over 1
    knobs = {"metadata": {"gemma3.attention.sliding_window": 4}} if arch == "gemma3" else {}
    model = load_model(tiny_gguf(arch, GGMLType.Q8_0, **knobs))
    prompt, tokens = sample_ids(3, seed=3), sample_ids(9, seed=4)
    got = static_steps(model, prompt, tokens, graph=False)
    assert_logits_close(got, forward_steps(model, prompt, tokens))


def test_static_steps_play_several_loras_at_their_scales(tiny_gguf, tmp_path):
    path = tiny_gguf("qwen2", GGMLType.Q4_K, config=WIDE)  # biases on q, k and v
    model = two_loras_played(path, tmp_path)
    prompt, tokens = sample_ids(4, seed=5), sample_ids(6, seed=6)
    got, ref = static_steps(model, prompt, tokens, graph=False), forward_steps(model, prompt, tokens)
    assert_logits_close(got, ref)
    base = forward_steps(load_model(path), prompt, tokens)
    assert (base - ref).abs().max().item() > 100 * (got - ref).abs().max().item()


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_one_lora_on_every_linear_plays_each_input_s_products_as_one(tiny_gguf, tmp_path, arch):
    # qwen2: biases on q, k and v; gemma3: gelu, sandwich norms
    knobs = {"config": WIDE} if arch == "qwen2" else {}
    path = tiny_gguf(arch, GGMLType.Q4_K if arch == "qwen2" else GGMLType.Q8_0, **knobs)
    trainee = load_model(path)
    aset = attach(trainee, "all", rank=3, alpha=6.0, seed=4)
    randomize(aset, seed=5)
    model = load_model(path)
    load_adapters(model, [str(aset.save(tmp_path / "one.bin"))])
    with torch.no_grad():
        cache = model.new_cache(batch=1, max_len=4)
        prefill(model, torch.tensor([sample_ids(2, seed=1)]), cache)
        decoder = CudaGraphDecoder.build(model, cache, graph=False)
    assert decoder is not None
    assert sorted(decoder.shared) == sorted((b, g) for b in range(model.args.n_layer) for g in ("qkv", "gate_up"))
    assert decoder.shared[(0, "qkv")].A.shape[0] == 3 * 3
    prompt, tokens = sample_ids(4, seed=11), sample_ids(6, seed=12)
    got, ref = static_steps(model, prompt, tokens, graph=False), forward_steps(model, prompt, tokens)
    assert_logits_close(got, ref)
    base = forward_steps(load_model(path), prompt, tokens)
    assert (base - ref).abs().max().item() > 100 * (got - ref).abs().max().item()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_static_steps_play_dora(tiny_gguf, tmp_path, arch):
    knobs = {"metadata": {"gemma3.attention.sliding_window": 4}} if arch == "gemma3" else {"config": WIDE}
    path = tiny_gguf(arch, GGMLType.Q6_K if arch == "llama" else GGMLType.Q8_0, **knobs)
    trainee = load_model(path)
    aset = attach(trainee, "all", rank=4, alpha=8.0, mode=Mode.DORA, seed=2)
    randomize(aset, seed=3)
    model = load_model(path)
    load_adapters(model, [str(aset.save(tmp_path / "d.bin"))])
    prompt, tokens = sample_ids(4, seed=7), sample_ids(6, seed=8)
    got, ref = static_steps(model, prompt, tokens, graph=False), forward_steps(model, prompt, tokens)
    assert_logits_close(got, ref)
    base = forward_steps(load_model(path), prompt, tokens)
    assert (base - ref).abs().max().item() > 100 * (got - ref).abs().max().item()


def test_the_cache_full_is_an_error(tiny_gguf):
    model = load_model(tiny_gguf("llama", GGMLType.Q8_0))
    with torch.no_grad():
        cache = model.new_cache(batch=1, max_len=3)
        prefill(model, torch.tensor([sample_ids(2, seed=1)]), cache)
        decoder = CudaGraphDecoder.build(model, cache, graph=False)
        assert decoder is not None
        decoder.step(5)
        with pytest.raises(ValueError, match="KV cache holds 3 tokens; 3 used, 1 more requested"):
            decoder.step(6)


def test_models_the_static_steps_do_not_cover_say_why(tiny_gguf):
    model = load_model(tiny_gguf("llama", GGMLType.Q8_0))
    aset = attach(model, "qv", rank=2, dropout=0.1, seed=0)
    aset.train()
    assert "dropout" in CudaGraphDecoder.unsupported(model)
    cache = model.new_cache(batch=2, max_len=4)
    assert "batch 1" in CudaGraphDecoder.unsupported(load_model(tiny_gguf("llama", GGMLType.Q8_0)), cache)


def test_mixture_of_experts_models_decode_through_the_forward(tiny_gguf):
    model = load_model(tiny_gguf("qwen3moe", GGMLType.Q8_0))
    cache = model.new_cache(batch=1, max_len=8)
    assert "mixture of experts" in CudaGraphDecoder.unsupported(model, cache)
    assert CudaGraphDecoder.build(model, cache) is None


# ---- on CUDA --------------------------------------------------------------------------------------------------


def _cuda_model(path, adapters=None, compute=torch.bfloat16):
    model = load_model(path, device="cuda", compute_dtype=compute)
    if adapters:
        load_adapters(model, adapters)
    return model


@needs_cuda
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_graph_replay_equals_the_eager_step(tiny_gguf, tmp_path, arch):
    knobs = {"metadata": {"gemma3.attention.sliding_window": 4}} if arch == "gemma3" else {"config": WIDE}
    path = tiny_gguf(arch, GGMLType.Q4_K if arch == "llama" else GGMLType.Q8_0, **knobs)
    trainee = load_model(path)
    aset = attach(trainee, "all", rank=4, alpha=8.0, seed=1)
    randomize(aset, seed=2)
    saved = str(aset.save(tmp_path / "a.bin"))
    prompt, tokens = sample_ids(4, seed=9), sample_ids(10, seed=10)
    model = _cuda_model(path, [saved])
    eager = static_steps(model, prompt, tokens, graph=False)
    with torch.no_grad():
        cache = model.new_cache(batch=1, max_len=len(prompt) + len(tokens))
        prefill(model, torch.tensor([prompt]), cache)
        decoder = CudaGraphDecoder.build(model, cache)
        assert decoder is not None and decoder.use_graph
        graphed, picks = [], []
        for t in tokens:
            graphed.append(decoder.step(t).clone())
            picks.append(decoder.pick())
        assert decoder.graph is not None, decoder.graph_error
    for i, (g, e) in enumerate(zip(graphed, eager[1:])):
        assert torch.equal(g, e), f"step {i}: max |Δ| {(g - e).abs().max().item():.3g}"
    # the eager steps', the capturing step's and the replays' picks are each their own logits'
    assert picks == [(int(torch.argmax(g)), True) for g in graphed]


@needs_cuda
def test_greedy_generation_through_the_graph_gives_the_forwards_tokens(tiny_gguf, tmp_path, monkeypatch):
    path = tiny_gguf("llama", GGMLType.Q4_K, config=WIDE)
    trainee = load_model(path)
    aset = attach(trainee, "all", rank=4, alpha=8.0, seed=3)
    randomize(aset, seed=4)
    # fp32 activations: the forward path's attention over the used part of the cache and the step's over the whole
    # masked cache differ by float32 rounding only (a token differs only where the top two logits tie that closely)
    model = _cuda_model(path, [str(aset.save(tmp_path / "a.bin"))], torch.float32)
    ids = sample_ids(5, seed=11)
    steps = []
    real_step = CudaGraphDecoder.step
    monkeypatch.setattr(CudaGraphDecoder, "step", lambda self, t: steps.append(t) or real_step(self, t))
    fast = generate(model, ids, 16)
    assert steps == fast[:-1]  # every token after the first came from a static step
    assert generate(model, ids, 16, native=False) == fast


@needs_cuda
def test_mixture_of_experts_generation_on_cuda_uses_the_forward(tiny_gguf):
    model = _cuda_model(tiny_gguf("qwen3moe", GGMLType.Q8_0))
    ids = sample_ids(4, seed=12)
    assert generate(model, ids, 6) == generate(model, ids, 6, native=False)


def _memory_model(path):
    """The model of a GGUF file built from its tensors' bytes as torch tensors (no memory map): the embedding
    table's bytes are then on the model's device, and the step looks the token up itself."""
    import numpy as np

    from juno_py.gguf import GGUFFile
    from juno_py.models.model import Transformer

    f = GGUFFile(path)
    tensors = {
        name: (info.ggml_type, info.shape, torch.from_numpy(np.array(info.raw)).view(info.shape[0], -1))
        for name, info in f.tensors.items()
    }
    return Transformer.from_tensors(f.metadata, tensors)


def test_the_step_looks_up_a_table_on_its_device_and_picks_the_greedy_token(tiny_gguf):
    path = tiny_gguf("gemma3", GGMLType.Q8_0, metadata={"gemma3.attention.sliding_window": 4})  # embedding scale
    model = _memory_model(path)
    prompt, tokens = sample_ids(3, seed=13), sample_ids(6, seed=14)
    with torch.no_grad():
        cache = model.new_cache(batch=1, max_len=len(prompt) + len(tokens) + 1)
        prefill(model, torch.tensor([prompt]), cache)
        decoder = CudaGraphDecoder.build(model, cache, graph=False)
        assert decoder is not None and decoder.table is not None
        picks, got = [], []
        for t in tokens:
            got.append(decoder.step(t).clone())
            picks.append(decoder.pick())
        with pytest.raises(IndexError, match="outside the vocabulary"):
            decoder.step(model.embed.n_vocab)
    ref = forward_steps(load_model(path), prompt, tokens)[1:]
    assert_logits_close(torch.stack(got), ref)
    assert picks == [(int(torch.argmax(r)), True) for r in got]
