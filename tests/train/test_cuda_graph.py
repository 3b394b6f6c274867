"""CUDA graphs of training steps (`juno_py.train.cuda_graph`): the graphed run trains as the eager one does, step by
step; shapes, accumulation and a failing capture; when graphs may run at all. The loss chunk they need (no host
synchronisation) gives the same gradient as the indexing it replaced. GPU tests run on the device machine."""

import functools
import math

import pytest
import torch

from juno_py.gguf import GGMLType
from juno_py.lora import Mode, attach
from juno_py.models import load_model
from juno_py.models.loss import _chunk_loss_and_grad
from juno_py.train.cuda_graph import GraphedSteps, GraphsUnavailable, graph_blocker, resolve_graphs
from juno_py.train.data import Example, pad_batch
from juno_py.train.loop import TrainConfig, train
from juno_py.train.steps import forward_backward, model_loss

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
# hidden 256 and MLP 512: the K-quant decode kernels run inside the model
KQ_CONFIG = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
)


def test_resolve_graphs_modes():
    assert resolve_graphs("off", None) is False
    assert resolve_graphs("auto", None) is True
    assert resolve_graphs("auto", "some reason") is False
    assert resolve_graphs("on", None) is True
    with pytest.raises(GraphsUnavailable, match="--cuda-graphs on: some reason"):
        resolve_graphs("on", "some reason")
    with pytest.raises(ValueError, match="expected one of auto, on, off"):
        resolve_graphs("sometimes", None)


def test_cuda_graphs_on_for_a_cpu_model_is_refused(tiny_gguf):
    model = load_model(tiny_gguf("llama", GGMLType.Q8_0))
    adapters = attach(model, "qv", rank=2, alpha=4)
    cfg = TrainConfig(cuda_graphs="on", max_steps=1, epochs=None, batch_size=2)
    assert graph_blocker(model, cfg, None, None, adapters) == "the model is not on a CUDA device"
    with pytest.raises(GraphsUnavailable, match="not on a CUDA device"):
        train(model, adapters, [Example([1, 2, 3, 4], [True] * 4)] * 2, cfg, progress=False, log=lambda s: None)


def _indexed_chunk_loss_and_grad(logits: torch.Tensor, t: torch.Tensor, ignore_index: int):
    """The loss chunk as it was before graphs: the valid rows picked by index (a data-dependent shape)."""
    z = logits.clone()
    valid = t != ignore_index
    rows = valid.nonzero().squeeze(1)
    target = z[rows, t[rows]]
    m = z.amax(dim=1, keepdim=True)
    z.sub_(m).exp_()
    total = z.sum(dim=1, keepdim=True)
    loss = (m[rows, 0] + total[rows, 0].log() - target).sum()
    z.div_(total)
    z[rows, t[rows]] -= 1
    z[~valid] = 0
    return loss, z


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_masked_loss_chunk_equals_the_indexed_one(dtype):
    gen = torch.Generator().manual_seed(0)
    n, d, vocab = 37, 16, 301
    h = torch.randn(n, d, generator=gen, dtype=dtype)
    w = torch.randn(vocab, d, generator=gen, dtype=dtype)
    t = torch.randint(0, vocab, (n,), generator=gen)
    t[::5] = -100  # ignored rows
    loss, grad = _chunk_loss_and_grad(lambda x: x @ w.T, h, t, -100)
    ref_loss, ref_dz = _indexed_chunk_loss_and_grad(h @ w.T, t, -100)
    assert torch.equal(grad, ref_dz @ w)  # the same gradient of the logits, value for value
    assert math.isclose(float(loss), float(ref_loss), rel_tol=1e-12 if dtype == torch.float64 else 1e-6)
    assert float(grad[::5].abs().max()) == 0.0  # ignored rows carry nothing


# ---------------------------------------------------------------------------------------------------- on a GPU
def _examples(lengths, seed=0, vocab=256):
    gen = torch.Generator().manual_seed(seed)
    return [Example(torch.randint(0, vocab, (n,), generator=gen).tolist(), [True] * n) for n in lengths]


def _run(path, mode, graphs, examples, **cfg_kw):
    torch.manual_seed(0)
    model = load_model(path, device="cuda", compute_dtype="bf16")
    adapters = attach(model, "all", rank=4, alpha=8, mode=mode, seed=0)
    log = []
    cfg = TrainConfig(
        **{
            **dict(lr=5e-3, batch_size=4, epochs=None, schedule="constant", max_seq_len=64, cuda_graphs=graphs),
            **cfg_kw,
        }
    )
    start = {k: v.detach().float().cpu().clone() for k, v in adapters.named_parameters()}
    result = train(model, adapters, examples, cfg, progress=False, log=log.append)
    moved = {k: v.detach().float().cpu() - start[k] for k, v in adapters.named_parameters()}
    return result, moved, log


def _close_runs(eager, graphed):
    """Same number of steps, the same losses, and the same change of every adapter tensor (to 1 % of the change:
    a replay of stale inputs, a stale DoRA norm or lost accumulation would be far off)."""
    (r_e, d_e, _), (r_g, d_g, _) = eager, graphed
    assert r_g.steps == r_e.steps
    assert math.isclose(r_g.first_loss, r_e.first_loss, rel_tol=1e-3)
    assert math.isclose(r_g.last_loss, r_e.last_loss, rel_tol=1e-2)
    for k in d_e:
        assert float(d_e[k].norm()) > 0, k  # training moved it
        assert float((d_g[k] - d_e[k]).norm()) <= 1e-2 * float(d_e[k].norm()), k


@needs_cuda
def test_graphed_lora_training_matches_eager(tiny_gguf):
    path = tiny_gguf("llama", GGMLType.Q4_K, config=KQ_CONFIG)
    examples = _examples([32] * 16)  # one shape, no padding: captured at its second step, replayed after
    eager = _run(path, Mode.LORA, "off", examples, max_steps=10)
    graphed = _run(path, Mode.LORA, "on", examples, max_steps=10)
    assert any("captured a CUDA graph" in m for m in graphed[2]), graphed[2]
    assert not any("CUDA graphs off" in m for m in graphed[2]), graphed[2]
    assert graphed[0].last_loss < graphed[0].first_loss
    _close_runs(eager, graphed)


def _syncing(real):
    def fb(self, s):
        loss = real(self, s)
        float(loss)  # a host read: not allowed while a stream is being captured
        return loss

    return fb


@needs_cuda
def test_a_failing_capture_falls_back_to_eager_training(tiny_gguf, monkeypatch):
    path = tiny_gguf("llama", GGMLType.Q4_K, config=KQ_CONFIG)
    examples = _examples([32] * 16)
    eager = _run(path, Mode.LORA, "off", examples, max_steps=6)
    monkeypatch.setattr(GraphedSteps, "_forward_backward", _syncing(GraphedSteps._forward_backward))
    graphed = _run(path, Mode.LORA, "on", examples, max_steps=6)
    assert any("CUDA graphs off for this run: capture failed" in m for m in graphed[2]), graphed[2]
    _close_runs(eager, graphed)


# Gradient by gradient. Whole DoRA runs cannot be compared this way: Adam turns the GPU's run-to-run noise in
# near-zero gradient components (attention's backward accumulates with atomics) into full steps of the rate, and
# over ten steps eager runs differ from each other by a few per cent. One replay against one eager micro-step at
# the same parameters has no such amplification.
def _setup(tiny_gguf, mode):
    path = tiny_gguf("llama", GGMLType.Q4_K, config=KQ_CONFIG)
    model = load_model(path, device="cuda", compute_dtype="bf16").train()
    adapters = attach(model, "all", rank=4, alpha=8, mode=mode, seed=0)
    params = list(adapters.parameters())
    _move(adapters, 0)
    return model, adapters, params, GraphedSteps(model, adapters, functools.partial(model_loss, model))


def _move(adapters, seed):
    """An optimizer step's worth of change, in place: B (and A, m) moved so that ‖s·BA‖ is a third of ‖W‖ per
    row (DoRA's norms, and so g, change by per cents)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for ad in adapters.adapters.values():
            ad.lora_B.add_((torch.randn(ad.lora_B.shape, generator=gen) * 0.05).to(ad.lora_B.device))
            ad.lora_A.add_((torch.randn(ad.lora_A.shape, generator=gen) * 0.01).to(ad.lora_A.device))
            if ad.magnitude is not None:
                ad.magnitude.mul_((1 + 0.05 * torch.randn(ad.magnitude.shape, generator=gen)).to(ad.magnitude.device))


def _take_grads(params):
    out = [p.grad.detach().clone() for p in params]
    for p in params:
        p.grad = None
    return out


def _eager(model, params, batches, den):
    for p in params:
        p.grad = None
    loss = sum(forward_backward(model, b, den) for b in batches)
    return loss, _take_grads(params)


def _rel(got, ref) -> float:
    num = sum(float((a.double() - b.double()).norm()) ** 2 for a, b in zip(got, ref))
    return math.sqrt(num / sum(float(b.double().norm()) ** 2 for b in ref))


@needs_cuda
@pytest.mark.parametrize("mode", [Mode.LORA, Mode.DORA], ids=["lora", "dora"])
def test_replayed_gradients_follow_the_adapter(tiny_gguf, mode):
    """Each replay gives the eager gradients at the parameters of that moment (new inputs, moved adapters, DoRA's
    norms recomputed inside the graph)."""
    model, adapters, params, graphs = _setup(tiny_gguf, mode)
    batches = [pad_batch(_examples([32] * 4, seed=i)) for i in range(3)]
    den = float(batches[0].n_supervised)
    assert graphs(batches[0], den) is None  # first sight: the caller runs it eagerly
    refs = []
    for i, b in enumerate((batches[1], batches[2], batches[1])):
        loss, ref = _eager(model, params, [b], den)
        value = graphs(b, den)
        assert value is not None and math.isclose(value, loss, rel_tol=1e-4)
        assert _rel(_take_grads(params), ref) <= 1e-3
        refs.append(ref)
        _move(adapters, i + 1)
    assert graphs.replays == 3 and len(graphs.graphs) == 1
    assert _rel(refs[2], refs[0]) > 5e-2  # the same batch after two moves: a stale replay could not match


@needs_cuda
def test_replays_accumulate_over_micro_batches_of_several_shapes(tiny_gguf):
    model, adapters, params, graphs = _setup(tiny_gguf, Mode.DORA)
    short, full = pad_batch(_examples([20, 24], seed=1)), pad_batch(_examples([32, 32], seed=2))
    den = float(short.n_supervised + full.n_supervised)
    for b in (short, full):
        assert graphs(b, den) is None  # first sight of each shape
    loss, ref = _eager(model, params, [short, full], den)
    value = graphs(short, den, last=False) + graphs(full, den, last=True)
    assert len(graphs.graphs) == 2
    assert math.isclose(value, loss, rel_tol=1e-4)
    assert _rel(_take_grads(params), ref) <= 1e-3


@needs_cuda
def test_a_failing_capture_leaves_no_dora_state_behind(tiny_gguf, monkeypatch):
    model, adapters, params, graphs = _setup(tiny_gguf, Mode.DORA)
    monkeypatch.setattr(GraphedSteps, "_forward_backward", _syncing(GraphedSteps._forward_backward))
    batch = pad_batch(_examples([32] * 4))
    den = float(batch.n_supervised)
    assert graphs(batch, den) is None and graphs(batch, den) is None  # first sight, then the failed capture
    assert graphs.disabled and "capture failed" in graphs.disabled
    assert all(p.grad is None for p in params)
    _, got = _eager(model, params, [batch], den)  # the eager step that follows the failure
    for m in adapters.modules.values():
        m._g_cache = None  # a fresh reference: every norm recomputed
    _, ref = _eager(model, params, [batch], den)
    assert _rel(got, ref) <= 1e-3


def _run_moe(path, graphs, examples, checkpoint):
    """A tiny qwen3moe trained with LoRA on attention and every expert; the run, as `_run` gives it, and the router
    load's total per block of every step."""
    from juno_py.metrics import MetricsRecorder

    torch.manual_seed(0)
    model = load_model(path, device="cuda", compute_dtype="bf16")
    adapters = attach(model, "all", rank=4, alpha=8, seed=0)
    cfg = TrainConfig(
        lr=5e-3,
        batch_size=4,
        epochs=None,
        schedule="constant",
        max_seq_len=64,
        max_steps=10,
        cuda_graphs=graphs,
        grad_checkpoint=checkpoint,
    )
    start = {k: v.detach().float().cpu().clone() for k, v in adapters.named_parameters()}
    rec, log = MetricsRecorder(), []
    result = train(model, adapters, examples, cfg, recorder=rec, progress=False, log=log.append)
    moved = {k: v.detach().float().cpu() - start[k] for k, v in adapters.named_parameters()}
    totals = [{layer: sum(c) for layer, c in e.values["counts"].items()} for e in rec.events if e.kind == "expert_load"]
    return (result, moved, log), totals


@needs_cuda
@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpointed"])
def test_graphed_moe_training_matches_eager_and_counts_the_router_load(tiny_gguf, checkpoint):
    """The grouped experts' step is captured (with activation checkpointing too), trains as the eager one does,
    and every replayed step reports its own router load."""
    path = tiny_gguf("qwen3moe", GGMLType.Q8_0)
    examples = _examples([32] * 40)
    eager, eager_load = _run_moe(path, "off", examples, checkpoint)
    graphed, graphed_load = _run_moe(path, "on", examples, checkpoint)
    assert any("captured a CUDA graph" in m for m in graphed[2]), graphed[2]
    _close_runs(eager, graphed)
    assert len(graphed_load) == len(eager_load) == 10
    passes = 2 if checkpoint else 1  # a checkpointed block routes again when it is recomputed
    for step in graphed_load + eager_load:
        assert step and all(n == 4 * 32 * 2 * passes for n in step.values()), step  # batch x tokens x top-k


@needs_cuda
def test_cuda_graphs_are_refused_with_checkpointing(tiny_gguf):
    path = tiny_gguf("llama", GGMLType.Q8_0)
    with pytest.raises(GraphsUnavailable, match="--grad-checkpoint"):
        _run(path, Mode.LORA, "on", _examples([16] * 4), max_steps=1, grad_checkpoint=True)
    result, _, log = _run(path, Mode.LORA, "auto", _examples([16] * 8), max_steps=3, grad_checkpoint=True)
    assert result.steps == 3 and not any("captured" in m for m in log)
