"""The forward pass against itself: KV-cache decoding, batches, custom masks and positions (padding, packed
documents), the embedding's row-range dequantization, generation, and the chunked loss."""

import pytest
import torch
import torch.nn.functional as F

import juno_py
from juno_py.gguf import GGMLType, GGUFFile
from juno_py.models import Transformer, chunked_cross_entropy
from juno_py.models.generate import decode_one_token, generate, prefill, sample
from juno_py.testing.tiny_models import sample_ids

ARCHS = ["llama", "qwen2", "qwen3", "phi3", "gemma3"]


def ours(path, **kw) -> Transformer:
    return Transformer.from_gguf(GGUFFile(path), **kw)


@pytest.mark.parametrize("arch", ARCHS)
def test_kv_cache_decode_equals_full_recompute(tiny_gguf, arch):
    model = ours(tiny_gguf(arch, GGMLType.Q8_0))
    ids = sample_ids(13, seed=3)
    with torch.no_grad():
        full = model.logits(ids)
        cache = model.new_cache(batch=1, max_len=len(ids))
        steps = [prefill(model, torch.tensor([ids[:5]]), cache)]
        steps += [decode_one_token(model, t, cache) for t in ids[5:]]
    got = torch.stack(steps)
    assert (got - full[4:]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_batch_rows_are_independent(tiny_gguf, arch):
    model = ours(tiny_gguf(arch))
    a, b = sample_ids(9, seed=4), sample_ids(9, seed=5)
    with torch.no_grad():
        batch = model.logits([a, b])
        assert batch.shape == (2, 9, model.layout.n_vocab)
        assert (batch[0] - model.logits(a)).abs().max().item() <= 1e-4
        assert (batch[1] - model.logits(b)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_packed_documents_with_positions_and_mask_equal_separate_passes(tiny_gguf, arch):
    model = ours(tiny_gguf(arch))
    a, b = sample_ids(5, seed=6), sample_ids(8, seed=7)
    doc = torch.tensor([0] * len(a) + [1] * len(b))
    positions = torch.cat([torch.arange(len(a)), torch.arange(len(b))]).unsqueeze(0)
    mask = (doc[:, None] == doc[None, :]).unsqueeze(0)
    with torch.no_grad():
        packed = model.project(model(torch.tensor([a + b]), positions=positions, mask=mask))[0]
        assert (packed[: len(a)] - model.logits(a)).abs().max().item() <= 1e-4
        assert (packed[len(a) :] - model.logits(b)).abs().max().item() <= 1e-4


def test_padded_batch_with_key_mask_matches_unpadded(tiny_gguf):
    model = ours(tiny_gguf("qwen2"))
    a, b = sample_ids(6, seed=8), sample_ids(10, seed=9)
    tokens = torch.tensor([a + [0] * 4, b])  # right padding
    valid = torch.tensor([[True] * 6 + [False] * 4, [True] * 10])
    mask = valid[:, None, :].expand(2, 10, 10)
    with torch.no_grad():
        out = model.project(model(tokens, mask=mask))
        assert torch.isfinite(out).all()
        assert (out[0, :6] - model.logits(a)).abs().max().item() <= 1e-4
        assert (out[1] - model.logits(b)).abs().max().item() <= 1e-4


def test_embedding_dequantizes_only_the_rows_used(tiny_gguf, monkeypatch):
    from juno_py.gguf import quants

    model = ours(tiny_gguf("llama", GGMLType.Q8_0))
    seen = []
    real = quants.dequantize

    def spy(ggml_type, raw, n_cols, what=""):
        if what == "token_embd.weight":
            seen.append(raw.shape[0])
        return real(ggml_type, raw, n_cols, what)

    monkeypatch.setattr(quants, "dequantize", spy)
    tokens = torch.tensor([[7, 9, 7, 200, 9]])
    rows = model.embed(tokens)
    assert seen == [3]  # the three distinct tokens, nothing else
    full = GGUFFile(model.gguf.path).dequantize("token_embd.weight")
    assert torch.equal(rows[0], full[tokens[0]])


def test_generate_greedy_follows_the_argmax_of_full_recompute(tiny_gguf):
    model = ours(tiny_gguf("gemma3"))
    ids = sample_ids(4, seed=10)
    new = generate(model, ids, 8)
    seq = list(ids)
    with torch.no_grad():
        for _ in range(8):
            seq.append(int(model.logits(seq)[-1].argmax()))
    assert new == seq[len(ids) :]
    # a stop id ends generation before that token is returned
    assert generate(model, ids, 8, stop_ids=[new[3]]) == new[: new.index(new[3])]


def test_sampling_is_seeded_and_top_k_one_is_greedy(tiny_gguf):
    model = ours(tiny_gguf("llama"))
    ids = sample_ids(4, seed=11)
    one = generate(model, ids, 6, temperature=1.0, top_p=0.9, seed=5)
    assert one == generate(model, ids, 6, temperature=1.0, top_p=0.9, seed=5)
    assert generate(model, ids, 6, temperature=0.7, top_k=1, seed=1) == generate(model, ids, 6)
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0])
    g = torch.Generator().manual_seed(0)
    draws = {sample(logits, 1.0, top_p=0.5, generator=g) for _ in range(50)}
    assert draws == {1}  # the top token alone reaches p = 0.5
    draws = {sample(logits, 1.0, top_k=2, generator=g) for _ in range(200)}
    assert draws == {1, 2}


def test_load_model_gives_tokenizer_and_logits(tiny_gguf):
    path = tiny_gguf("llama")
    model = juno_py.load_model(str(path))
    ids = model.tokenizer.encode("the weather")
    assert model.tokenizer.decode(ids) == "the weather"
    logits = model.logits(ids)
    assert logits.shape == (len(ids), model.layout.n_vocab) and logits.dtype == torch.float32


def test_load_model_plays_adapters(tiny_gguf, tmp_path):
    from juno_py.lora import attach

    path = tiny_gguf("llama")
    model = juno_py.load_model(str(path))
    aset = attach(model, "qv", rank=2, seed=1)
    with torch.no_grad():
        for ad in aset.adapters.values():
            ad.lora_B.normal_(0, 0.1)
        expect = model.logits([5, 6, 7])
    aset.save(tmp_path / "a.bin")
    played = juno_py.load_model(str(path), adapters=[f"{tmp_path / 'a.bin'}:1.0"])
    with torch.no_grad():
        assert torch.equal(played.logits([5, 6, 7]), expect)


def test_bf16_compute_stays_close_to_fp32(tiny_gguf):
    path = tiny_gguf("qwen3", GGMLType.Q8_0)
    ids = sample_ids(20, seed=12)  # enough tokens for the bf16 matmul path
    with torch.no_grad():
        exact = ours(path).logits(ids)
        bf16 = ours(path, compute_dtype=torch.bfloat16, weights_cache="bf16").logits(ids)
    assert (bf16 - exact).abs().max().item() <= 0.05 * exact.abs().max().item()


# --- chunked loss --------------------------------------------------------------------------------------------


def _plain_and_chunked(hidden, targets, project, chunk, reduction):
    h1 = hidden.clone().requires_grad_(True)
    h2 = hidden.clone().requires_grad_(True)
    logits = project(h1)
    logits = logits if logits.dtype == torch.float64 else logits.float()
    plain = F.cross_entropy(logits, targets, ignore_index=-100, reduction=reduction)
    chunked = chunked_cross_entropy(h2, targets, project, chunk=chunk, reduction=reduction)
    (plain * 1.7).backward()
    (chunked * 1.7).backward()
    return plain, chunked, h1.grad, h2.grad


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunked_cross_entropy_equals_plain_values_and_gradients(chunk, reduction):
    """In float64 the chunked loss and its gradient equal F.cross_entropy's (the same function, computed in
    another order: the gradient is formed as exp(z − m) / Σ rather than exp(log_softmax)); in float32 both stay
    within float32 rounding of float64."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(50, 16, generator=g) * 2
    hidden = torch.randn(23, 16, generator=g)
    targets = torch.randint(0, 50, (23,), generator=g)
    targets[[0, 5, 6]] = -100
    w64 = w.double()
    plain, chunked, g1, g2 = _plain_and_chunked(hidden.double(), targets, lambda h: h @ w64.t(), chunk, reduction)
    torch.testing.assert_close(chunked, plain, rtol=1e-12, atol=0)
    # each gradient element is a 50-term product whose rounding is relative to the terms, not to a result that
    # may cancel to near 0: 16 units in the last place of the largest element, as the float32 check below
    assert (g2 - g1).abs().max().item() <= 16 * torch.finfo(torch.float64).eps * g1.abs().max().item()
    plain32, chunked32, g1_32, g2_32 = _plain_and_chunked(hidden, targets, lambda h: h @ w.t(), chunk, reduction)
    # float32 rounding only, for ours as for F.cross_entropy: within 16 units in the last place of the largest value
    eps = torch.finfo(torch.float32).eps
    for value in (chunked32, plain32):
        assert abs(value.double() - plain).item() <= 16 * eps * abs(plain).item()
    bound = 16 * eps * g1.abs().max().item()
    for grad in (g2_32, g1_32):
        assert (grad.double() - g1).abs().max().item() <= bound
    assert torch.all(g2_32[[0, 5, 6]] == 0)


def test_chunked_cross_entropy_never_projects_more_than_a_chunk():
    w = torch.randn(30, 8)
    sizes = []

    def project(h):
        sizes.append(h.shape[0])
        return h @ w.t()

    hidden = torch.randn(4, 10, 8, requires_grad=True)
    loss = chunked_cross_entropy(hidden, torch.randint(0, 30, (4, 10)), project, chunk=6)
    loss.backward()
    assert max(sizes) <= 6 and sum(sizes) == 40  # one projection per chunk: backward reuses the forward's work
    with torch.no_grad():
        chunked_cross_entropy(hidden, torch.randint(0, 30, (4, 10)), project, chunk=6)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_model_loss_equals_plain_cross_entropy_with_gradients_wrt_hidden(tiny_gguf, arch):
    model = ours(tiny_gguf(arch, GGMLType.Q8_0))
    tokens = torch.tensor([sample_ids(12, seed=13), sample_ids(12, seed=14)])
    targets = torch.roll(tokens, -1, dims=1)
    targets[:, -1] = -100
    with torch.no_grad():
        hidden = model(tokens).reshape(-1, model.args.n_embd)
    plain, chunked, g1, g2 = _plain_and_chunked(hidden, targets.reshape(-1), model.project, 5, "mean")
    assert abs(plain.item() - chunked.item()) <= 1e-5 * max(1.0, plain.item())
    assert torch.allclose(g1, g2, rtol=1e-4, atol=1e-7)
    with torch.no_grad():
        assert abs(model.loss(tokens, targets, chunk=5).item() - plain.item()) <= 1e-5 * max(1.0, plain.item())


def test_gradient_flows_to_the_input_embeddings_through_every_block(tiny_gguf):
    """Adapters will train inside the blocks: the frozen linears must pass gradients back (checkpointed too)."""
    model = ours(tiny_gguf("phi3", GGMLType.Q8_0))
    tokens = torch.tensor([sample_ids(8, seed=15)])
    grads = []
    for checkpointed in (False, True):
        model.checkpoint_blocks = checkpointed
        x = model.embed(tokens).requires_grad_(True)
        model.embed.forward = lambda t, x=x: x  # feed the leaf in place of the embedding
        loss = model.loss(tokens, torch.roll(tokens, -1, dims=1))
        loss.backward()
        del model.embed.forward
        grads.append(x.grad)
    assert grads[0].abs().sum() > 0
    assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_activation_gives_autograds_gradients_and_keeps_two_tensors(act, dtype):
    """The MLP's `act(gate) · up` through GatedActivation: the same output and gradients, bit for bit, as autograd
    of the plain expression, while backward keeps gate and up only (plain autograd also keeps act(gate))."""
    from juno_py.models.model import ACTIVATIONS, gated

    fn = ACTIVATIONS[act]
    g = torch.Generator().manual_seed(3)
    gate0, up0, dy = (torch.randn(5, 7, 48, generator=g).to(dtype) for _ in range(3))
    results, kept = [], []
    for fused in (False, True):
        gate, up = gate0.clone().requires_grad_(True), up0.clone().requires_grad_(True)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = gated(fn, gate, up) if fused else fn(gate) * up
        y.backward(dy)
        results.append((y.detach(), gate.grad, up.grad))
        kept.append({t.untyped_storage().data_ptr() for t in saved})
    for plain, fused in zip(*results):
        assert torch.equal(plain, fused)
    assert len(kept[0]) == 3 and len(kept[1]) == 2


@pytest.mark.parametrize("cap", [0.0, 3.0])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("cache", ["none", "fp32"])
def test_streamed_head_loss_and_gradient_equal_the_projected_loss(cap, bias, cache):
    """The block-by-block loss head (online softmax over W's row blocks, one pass) against F.cross_entropy of the
    full logits in float64: uneven blocks (7 rows, 50-word vocabulary), chunks splitting the positions, ignored
    positions, a soft cap and a bias. In float64 they agree to rounding; in float32 both stay within float32 rounding of float64."""
    from juno_py.gguf import quants
    from juno_py.models.loss import LinearHead
    from juno_py.weights.frozen import FrozenQuantLinear

    g = torch.Generator().manual_seed(4)
    w = torch.randn(50, 32, generator=g)
    raw = torch.from_numpy(quants.quantize(GGMLType.Q8_0, w))
    b = torch.randn(50, generator=g) if bias else None
    layer = FrozenQuantLinear(raw, GGMLType.Q8_0, 32, bias=b, chunk_rows=7, cache=cache)
    w_exact = quants.dequantize(GGMLType.Q8_0, raw, 32).double()
    hidden = torch.randn(23, 32, generator=g) * 2
    targets = torch.randint(0, 50, (23,), generator=g)
    targets[[0, 5, 6]] = -100

    def project(h):
        logits = h @ (w_exact if h.dtype == torch.float64 else w_exact.float()).t()
        if b is not None:
            logits = logits + b.to(h.dtype)
        return torch.tanh(logits / cap) * cap if cap else logits

    h64 = hidden.double().requires_grad_(True)
    ref = F.cross_entropy(project(h64), targets, ignore_index=-100, reduction="sum")
    ref.backward()
    h32 = hidden.clone().requires_grad_(True)
    plain = F.cross_entropy(project(h32), targets, ignore_index=-100, reduction="sum")
    plain.backward()
    for dtype in (torch.float64, torch.float32):
        h = hidden.to(dtype).requires_grad_(True)
        loss = chunked_cross_entropy(h, targets, project, chunk=9, reduction="sum", head=LinearHead(layer, cap))
        loss.backward()
        if dtype == torch.float64:
            torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)
            torch.testing.assert_close(h.grad, h64.grad, rtol=1e-10, atol=1e-13)
        else:
            # float32 rounding only: within 16 units in the last place of the largest value, as the plain float32
            # loss is (a formula slip, a missed rescaling or a lost target term is off by orders of magnitude)
            eps = torch.finfo(torch.float32).eps
            assert abs(loss.item() - ref.item()) <= 16 * eps * ref.item()
            assert abs(plain.item() - ref.item()) <= 16 * eps * ref.item()
            bound = 16 * eps * h64.grad.abs().max().item()
            assert (h.grad.double() - h64.grad).abs().max().item() <= bound
            assert (h32.grad.double() - h64.grad).abs().max().item() <= bound
        assert torch.all(h.grad[[0, 5, 6]] == 0)
    with torch.no_grad():  # no gradient wanted: the loss alone
        value = chunked_cross_entropy(
            hidden.double(), targets, project, chunk=9, reduction="sum", head=LinearHead(layer, cap)
        )
    torch.testing.assert_close(value, ref.detach(), rtol=1e-12, atol=0)


def test_model_loss_head_streams_the_quantized_output_on_the_cpu(tiny_gguf):
    """A model whose output projection streams on the CPU computes its loss through the head: same value and
    gradient as projecting the full logits."""
    model = ours(tiny_gguf("llama", GGMLType.Q8_0))
    assert model.loss_head() is not None
    model.output.chunk_rows = 5  # several blocks
    tokens = torch.tensor([sample_ids(12, seed=21)])
    targets = torch.roll(tokens, -1, dims=1)
    with torch.no_grad():
        hidden = model(tokens).reshape(-1, model.args.n_embd)
    h1, h2 = hidden.clone().requires_grad_(True), hidden.clone().requires_grad_(True)
    plain = F.cross_entropy(model.project(h1).float(), targets.reshape(-1), reduction="sum")
    plain.backward()
    fused = chunked_cross_entropy(h2, targets, model.project, chunk=7, reduction="sum", head=model.loss_head())
    fused.backward()
    assert abs(fused.item() - plain.item()) <= 1e-5 * plain.item()
    torch.testing.assert_close(h2.grad, h1.grad, rtol=1e-4, atol=1e-6)
