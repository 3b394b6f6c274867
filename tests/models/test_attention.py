"""Attention backends against the dense-mask reference: logits and adapter gradients in float64 on tiny models
(causal, Gemma-3's sliding windows from the file, packed documents with per-document positions, padding, truncated
BPTT windows, and their combinations), flex_attention's block tables against the dense mask, the flex mask
function on the CPU, the backend choice, and the chunked backend's memory bound."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from juno_py.gguf import GGMLType
from juno_py.lora import attach
from juno_py.models import load_model
from juno_py.models.attention import (
    BLOCK,
    AttentionMask,
    _varlen_kernel,
    attend,
    attention_settings,
    block_mask_dense,
    block_tables,
    choose_backend,
    packed_segments,
)
from juno_py.testing.tiny_models import sample_ids
from juno_py.train.data import Example, packed_batch, pad_batch
from juno_py.train.steps import forward_backward


def _model(tiny_gguf, arch):
    model = load_model(tiny_gguf(arch, GGMLType.Q8_0)).set_activation_dtype(torch.float64)
    aset = attach(model, "all", rank=3, alpha=6, seed=1)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for ad in aset.adapters.values():
            ad.lora_B.normal_(0, 0.3, generator=g)
    for p in aset.parameters():
        p.data = p.data.double()
    return model, list(aset.parameters())


def _logits_and_grads(model, params, batch, backend, dense_limit=None, window=0):
    for p in params:
        p.grad = None
    with attention_settings(dense_limit=dense_limit, force=backend):
        forward_backward(model, batch, denominator=1.0, window=window)
        with torch.no_grad():
            logits = model.project(model(batch.tokens, batch.positions, documents=batch.documents))
    return logits, [p.grad.clone() for p in params]


def _examples(lengths, seed=0):
    out = []
    for i, n in enumerate(lengths):
        ids = sample_ids(n, seed=seed + i)
        out.append(Example(ids, [True] * n))
    return out


def _assert_same(a, b):
    (la, ga), (lb, gb) = a, b
    assert torch.isfinite(la).all()
    torch.testing.assert_close(la, lb, rtol=1e-12, atol=1e-12)
    assert len(ga) == len(gb) and any(g.abs().max() > 0 for g in ga)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)


BATCHES = {
    "packed": lambda: packed_batch([_examples([7, 12, 5]), _examples([15, 4], seed=5)]),  # 2nd row padded
    "padded": lambda: pad_batch(_examples([19, 11, 6], seed=9)),
}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("kind", sorted(BATCHES))
@pytest.mark.parametrize("window", [0, 8])
def test_chunked_attention_equals_the_dense_mask_float64(tiny_gguf, arch, kind, window):
    """Logits and every adapter gradient, through the dense mask and through query blocks of 5 (several blocks
    per sequence), whole sequences and truncated BPTT windows of 8 tokens (keys from the cache)."""
    model, params = _model(tiny_gguf, arch)
    batch = BATCHES[kind]()
    b, t = batch.tokens.shape
    ref = _logits_and_grads(model, params, batch, "dense", window=window)
    got = _logits_and_grads(model, params, batch, "chunked", dense_limit=5 * b * t, window=window)
    _assert_same(got, ref)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_packed_documents_equal_separate_sequences_float64(tiny_gguf, arch):
    """Packing is exact: each packed document's logits and loss gradient are those of the document alone."""
    model, params = _model(tiny_gguf, arch)
    docs = _examples([9, 14, 6], seed=2)
    with attention_settings(dense_limit=4 * 29, force="chunked"):
        packed = _logits_and_grads(model, params, packed_batch([docs]), "chunked", dense_limit=4 * 29)
        alone_logits, alone_grads = [], None
        for e in docs:
            logits, grads = _logits_and_grads(model, params, pad_batch([e]), "chunked", dense_limit=4 * 29)
            alone_logits.append(logits[0])
            alone_grads = grads if alone_grads is None else [a + g for a, g in zip(alone_grads, grads)]
    torch.testing.assert_close(packed[0][0], torch.cat(alone_logits), rtol=1e-12, atol=1e-12)
    for x, y in zip(packed[1], alone_grads):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)


def test_gemma3_window_comes_from_the_file_and_applies(tiny_gguf):
    """The sliding layers see `window` tokens back (4 in the tiny file): changing a token further back leaves a
    sliding-only prefix of the model unchanged, and the chunked backend agrees with the dense mask."""
    model, _ = _model(tiny_gguf, "gemma3")
    assert {blk.window for blk in model.blocks} == {0, 4}
    ids = sample_ids(30, seed=3)
    with torch.no_grad(), attention_settings(dense_limit=3 * 30, force="chunked"):
        chunked = model.logits(ids)
    with torch.no_grad(), attention_settings(force="dense"):
        dense = model.logits(ids)
    torch.testing.assert_close(chunked, dense, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------ attention level
def _packed_mask(t, sizes, window=0, pad=0, s_extra=0):
    """A mask over one row: documents of `sizes`, `pad` padding tokens (each its own document), optionally with
    `s_extra` earlier tokens cached as keys (truncated BPTT: queries are the last t of s_extra + t keys)."""
    doc, pos = [], []
    for d, n in enumerate(sizes):
        doc += [d] * n
        pos += list(range(n))
    n = len(doc)
    doc += [-1 - i for i in range(n, n + pad)]
    pos += list(range(pad))
    assert len(doc) == s_extra + t
    d, p = torch.tensor([doc]), torch.tensor([pos])
    return AttentionMask(p[:, s_extra:], p, window, d[:, s_extra:], d)


MASKS = {
    "causal-window-by-index": lambda: AttentionMask(
        torch.arange(300)[None], torch.arange(300)[None], 37, by_index=True
    ),
    "prefill-after-cache": lambda: AttentionMask(
        torch.arange(200, 461)[None], torch.arange(461)[None], 150, by_index=True
    ),
    "packed": lambda: _packed_mask(520, [100, 3, 250, 140, 20], pad=7),
    "packed-window": lambda: _packed_mask(520, [100, 3, 250, 140, 20], window=130, pad=7),
    "long-documents": lambda: _packed_mask(700, [256, 384, 60]),  # a later document's block sees none before it
    "packed-bptt": lambda: _packed_mask(200, [100, 3, 250, 140], window=64, s_extra=293),
    "positions-only": lambda: AttentionMask(torch.arange(5, 305)[None], torch.arange(5, 305)[None], 0),
}


@pytest.mark.parametrize("name", sorted(MASKS))
def test_block_mask_is_the_dense_mask(name):
    """What flex_attention computes from the block tables (mask function on partial blocks, all on full ones,
    nothing elsewhere) is exactly the dense mask; the tables do skip blocks and mark some full."""
    mask = MASKS[name]()
    dense = mask.dense()[:, 0]
    assert torch.equal(block_mask_dense(mask), dense)
    partial, full = block_tables(mask.q_pos, mask.k_pos, mask.window, mask.q_doc, mask.k_doc)
    assert not (partial & full).any()
    if mask.shape[1] >= 2 * BLOCK:
        assert (~(partial | full)).any()  # blocks no query sees: skipped


@pytest.mark.parametrize("name", ["packed-window", "packed-bptt", "causal-window-by-index"])
def test_flex_mask_function_equals_dense_on_cpu_float64(name):
    """flex_attention (eager on the CPU, no backward there) with the block mask the GPU uses: the same output as
    SDPA with the dense mask, grouped-query heads, float64."""
    mask = MASKS[name]()
    b, t, s = mask.shape
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, 4, t, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, 2, s, 16, generator=g, dtype=torch.float64) for _ in range(2))
    with torch.no_grad(), attention_settings(force="flex"):
        assert choose_backend(q.device, mask) == "flex"
        flex = attend(q, k, v, mask, scale=0.25, enable_gqa=True)
    with torch.no_grad(), attention_settings(force="dense"):
        dense = attend(q, k, v, mask, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(flex, dense, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_compiled_flex_uses_the_block_tables_on_cpu():
    """Compiled flex_attention on the CPU reads the block tables (full blocks skip the mask function): its output
    equals the dense mask's, float32."""
    from torch.nn.attention.flex_attention import flex_attention

    mask = MASKS["packed-window"]()
    b, t, s = mask.shape
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, 2, n, 16, generator=g) for n in (t, s, s))
    out = torch.compile(flex_attention)(q, k, v, block_mask=mask.block_mask(), scale=0.25)
    with torch.no_grad(), attention_settings(force="dense"):
        ref = attend(q, k, v, mask, scale=0.25)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_backend_choice():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    packed = MASKS["packed"]()
    assert choose_backend(cpu, None) == "causal"
    assert choose_backend(cpu, AttentionMask(torch.arange(9)[None], torch.arange(9)[None], 0, by_index=True)) == (
        "causal"
    )
    assert choose_backend(cuda, packed) == ("varlen" if _varlen_kernel() else "flex")
    assert choose_backend(cuda, MASKS["packed-bptt"]()) == "flex"  # cached keys: not the same tokens
    assert choose_backend(cuda, MASKS["causal-window-by-index"]()) == "flex"
    assert choose_backend(cpu, packed) == "dense"
    with attention_settings(dense_limit=520 * 100):
        assert choose_backend(cpu, packed) == "chunked"
    decode = AttentionMask(torch.tensor([[40]]), torch.arange(41)[None], 4, by_index=True)
    assert choose_backend(cuda, decode) == "dense"  # one query: a [1, S] mask
    explicit = AttentionMask(packed.q_pos, packed.k_pos, allowed=packed.dense()[:, 0])
    assert choose_backend(cuda, explicit) == "dense"  # the caller's own [T, S] mask


def test_packed_segments_are_the_documents_end_to_end():
    """cu_seqlens of two packed rows (documents, then padding tokens of one each), and no segments where a
    document is not one run of consecutive positions."""
    a, b = _packed_mask(12, [5, 3], pad=4), _packed_mask(12, [2, 10])
    two = AttentionMask(torch.cat([a.q_pos, b.q_pos]), torch.cat([a.k_pos, b.k_pos]), 0, torch.cat([a.q_doc, b.q_doc]))
    two.k_doc = two.q_doc
    if _varlen_kernel() is None:
        assert packed_segments(two) is None
        return
    cu, longest = packed_segments(two)
    assert cu.tolist() == [0, 5, 8, 9, 10, 11, 12, 14, 24] and cu.dtype == torch.int32 and longest == 10
    split = AttentionMask(a.q_pos, a.k_pos, 0, a.q_doc.clone(), a.k_doc)
    split.q_doc[0, 8:] = 0  # document 0 comes back after document 1
    split.k_doc = split.q_doc
    assert packed_segments(split) is None
    jump = AttentionMask(a.q_pos.clone(), a.k_pos, 0, a.q_doc, a.k_doc)
    jump.q_pos[0, 3] += 1  # positions skip inside a document
    jump.k_pos = jump.q_pos
    assert packed_segments(jump) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="varlen_attn is a CUDA kernel")
@pytest.mark.parametrize("name", ["packed", "packed-window", "long-documents"])
def test_varlen_equals_the_dense_mask_on_the_gpu(name):
    """varlen_attn over the packed documents: output and q/k/v gradients within bf16 error of the dense mask's,
    grouped-query heads."""
    m = MASKS[name]()
    mask = AttentionMask(m.q_pos.cuda(), m.k_pos.cuda(), m.window, m.q_doc.cuda(), m.k_doc.cuda())
    b, t, s = mask.shape
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, 8, t, 64, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    k, v = (
        torch.randn(b, 2, s, 64, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
        for _ in range(2)
    )
    assert choose_backend(q.device, mask) == "varlen"
    out = attend(q, k, v, mask, scale=0.125, enable_gqa=True)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    with attention_settings(force="dense"):
        ref = attend(q64, k64, v64, mask, scale=0.125, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q64, k64, v64))
    for got, want in ((out, ref), *zip(grads, ref_grads)):
        err = (got.double() - want).abs().max() / want.abs().max()
        assert err < 2e-2, (name, float(err))


class _Largest(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor):
                self.numel = max(self.numel, x.numel())
        return out


def test_chunked_attention_never_holds_a_t_by_t_tensor():
    """Forward and backward of a packed 2048-token row above the dense limit: no tensor of T·T elements or more
    (mask, scores, probabilities) exists at any point; the largest is a block of queries by the keys."""
    t, heads = 2048, 2
    mask = _packed_mask(t, [700, 900, 448], window=300)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, t, 8, generator=g, requires_grad=True) for _ in range(3))
    with attention_settings(dense_limit=64 * t):
        assert choose_backend(q.device, mask) == "chunked"
        with _Largest() as seen:
            out = attend(q, k, v, mask, scale=0.3)
            out.square().sum().backward()
    assert seen.numel <= heads * 64 * t
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    with attention_settings(force="dense"):
        ref = attend(q, k, v, mask, scale=0.3)
        ref.square().sum().backward()
    torch.testing.assert_close(out, ref)
    for a, b in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(a, b)


def test_long_packed_training_step_never_holds_a_t_by_t_tensor(tiny_gguf):
    """A whole training step (forward, chunked loss, backward into the adapters) on a packed 1024-token row, on the CPU above the dense limit: no tensor of T·T elements exists, and the
    gradients are those of the dense mask (float64)."""
    model, params = _model(tiny_gguf, "llama")
    batch = packed_batch([_examples([350, 450, 224], seed=4)])
    t = batch.tokens.shape[1]
    with attention_settings(dense_limit=32 * t), _Largest() as seen:
        forward_backward(model, batch, denominator=1.0)
    assert seen.numel < t * t
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    with attention_settings(force="dense"):
        forward_backward(model, batch, denominator=1.0)
    for a, b in zip(grads, (p.grad for p in params)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_a_flex_that_cannot_compile_falls_back_to_the_masked_paths(tiny_gguf, monkeypatch):
    """A process whose compiler cannot build flex_attention (an Inductor lowering error) trains on: one warning,
    then the masked SDPA paths, with the dense reference's logits and gradients."""
    from juno_py.models import attention

    def refuses(*args, **kwargs):
        raise torch._inductor.exc.InductorError(RuntimeError("NoValidChoicesError: no choices"), None)

    model, params = _model(tiny_gguf, "llama")
    batch = packed_batch([_examples([5, 9]), _examples([4, 6], seed=3)], 0)
    reference = _logits_and_grads(model, params, batch, "dense")
    monkeypatch.setattr(attention, "_flex_failed", {})
    monkeypatch.setitem(attention._compiled, "flex", refuses)
    with pytest.warns(UserWarning, match="flex_attention could not be compiled"):
        fell_back = _logits_and_grads(model, params, batch, "flex")
    _assert_same(fell_back, reference)
    assert "InductorError" in attention._flex_failed["flex"]
    _assert_same(_logits_and_grads(model, params, batch, "flex"), reference)  # no second attempt, no warning


def test_errors_of_the_inputs_are_not_taken_for_compile_failures():
    from juno_py.models.attention import _is_compile_failure

    assert not _is_compile_failure(torch.OutOfMemoryError("out of memory"))
    assert not _is_compile_failure(ValueError("shapes"))
    assert _is_compile_failure(torch._inductor.exc.InductorError(RuntimeError("lowering"), None))
