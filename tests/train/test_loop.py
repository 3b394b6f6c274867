"""The training loop: accumulation, clipping, the NaN guard, resume, BPTT, checkpointing, optimizer groups."""

import json
import math

import pytest
import torch

from juno_py.lora import Mode, attach, read_adapter
from juno_py.metrics import MetricsRecorder
from juno_py.train.data import collate, load_dataset, pad_batch
from juno_py.train.loop import TrainConfig, train
from juno_py.train.optim import build_optimizer, lr_factor
from juno_py.train.state import load_state, state_path
from juno_py.train.steps import TrainingDiverged, evaluate, forward_backward


def dataset(model, path, **kw):
    train_set, val_set, _ = load_dataset([path], model.tokenizer, 256, **kw)
    return train_set, val_set


def attached(model, mode=Mode.LORA, targets="all", dropout=0.0, seed=0):
    return attach(model, targets, rank=4, alpha=8, mode=mode, dropout=dropout, seed=seed)


def grads(adapters):
    return {n: p.grad.clone() for n, p in adapters.named_parameters()}


def params(adapters):
    return {n: p.detach().clone() for n, p in adapters.named_parameters()}


def nudge(adapters, seed=1):
    """Give B non-zero values, so every parameter has a gradient."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapters.groups()["B"]:
            p.copy_(0.05 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("mode", [Mode.LORA, Mode.DORA])
def test_accumulation_4x2_equals_batch_8(tiny_model, mixed_data, mode):
    examples = dataset(tiny_model, mixed_data)[0][:8]
    adapters = attached(tiny_model, mode)
    nudge(adapters)
    big = pad_batch(examples)
    loss8 = forward_backward(tiny_model, big, big.n_supervised) / big.n_supervised
    g8 = grads(adapters)
    for p in adapters.parameters():
        p.grad = None
    micro = [pad_batch(examples[i : i + 2]) for i in range(0, 8, 2)]
    n = sum(b.n_supervised for b in micro)
    assert n == big.n_supervised
    loss2 = sum(forward_backward(tiny_model, b, n) for b in micro) / n
    assert loss2 == pytest.approx(loss8, rel=1e-5)
    for name, g in grads(adapters).items():
        torch.testing.assert_close(g, g8[name], rtol=1e-4, atol=1e-6, msg=name)


def test_accumulation_through_the_loop_gives_the_same_adapter(tiny_model, tiny_path, mixed_data):
    from juno_py.models import load_model

    results = []
    for batch, accum in ((8, 1), (2, 4)):
        model = load_model(tiny_path)
        examples = dataset(model, mixed_data)[0][:8]
        adapters = attached(model)
        cfg = TrainConfig(lr=1e-2, batch_size=batch, accumulation=accum, max_steps=2, epochs=None, seed=1)
        r = train(model, adapters, examples, cfg, progress=False, log=lambda s: None)
        assert r.steps == 2
        results.append(params(adapters))
    for name, p in results[0].items():
        torch.testing.assert_close(results[1][name], p, rtol=1e-4, atol=1e-6, msg=name)


def test_bptt_window_forward_is_exact_and_full_window_gradients_are_exact(tiny_model, mixed_data):
    examples = dataset(tiny_model, mixed_data)[0][:4]
    adapters = attached(tiny_model)
    nudge(adapters)
    batch = pad_batch(examples)
    full = forward_backward(tiny_model, batch, 1.0)
    g_full = grads(adapters)
    for p in adapters.parameters():
        p.grad = None
    same = forward_backward(tiny_model, batch, 1.0, window=batch.tokens.shape[1])
    assert same == full
    for name, g in grads(adapters).items():
        assert torch.equal(g, g_full[name])
    for p in adapters.parameters():
        p.grad = None
    windowed = forward_backward(tiny_model, batch, 1.0, window=7)
    assert windowed == pytest.approx(full, rel=1e-5)  # cached K/V hold the same values
    g_win = grads(adapters)
    assert all(torch.isfinite(g).all() for g in g_win.values())
    assert any(not torch.allclose(g_win[n], g_full[n]) for n in g_full)  # gradients stop at window edges


def test_grad_checkpoint_gives_the_same_gradients(tiny_model, mixed_data):
    examples = dataset(tiny_model, mixed_data)[0][:4]
    adapters = attached(tiny_model)
    nudge(adapters)
    batch = pad_batch(examples)
    loss = forward_backward(tiny_model, batch, 1.0)
    g = grads(adapters)
    for p in adapters.parameters():
        p.grad = None
    tiny_model.checkpoint_blocks = True
    assert forward_backward(tiny_model, batch, 1.0) == pytest.approx(loss, rel=1e-6)
    for name, gc in grads(adapters).items():
        torch.testing.assert_close(gc, g[name], rtol=1e-5, atol=1e-7)


def run(
    tiny_path,
    data,
    lora_path=None,
    stop_at=None,
    resume=False,
    hook=None,
    recorder=None,
    log=None,
    thread_guard=None,
    **kw,
):
    from juno_py.models import load_model

    model = load_model(tiny_path)
    train_set, val_set = dataset(model, data, qa_variants_n=2, validation_split=kw.pop("validation_split", 0.0))
    adapters = attached(model, kw.pop("mode", Mode.LORA), dropout=kw.pop("dropout", 0.0))
    if hook is not None:
        hook(adapters)
    cfg = TrainConfig(**{"lr": 5e-3, "batch_size": 2, "seed": 3, "lora_path": lora_path, **kw})
    steps = iter(range(1, 10_000))
    stop = (lambda: next(steps) >= stop_at) if stop_at else None
    result = train(
        model,
        adapters,
        train_set,
        cfg,
        val_set,
        recorder=recorder,
        resume=resume,
        stop_requested=stop,
        progress=False,
        log=log or (lambda s: None),
        thread_guard=thread_guard,
    )
    return result, adapters


@pytest.mark.parametrize("mode", [Mode.LORA, Mode.DORA])
def test_resume_equals_an_uninterrupted_run(tiny_path, mixed_data, tmp_path, mode):
    kw = dict(
        mode=mode,
        dropout=0.1,
        accumulation=2,
        epochs=3,
        max_steps=None,
        schedule="warmup-cosine",
        warmup_steps=2,
        min_lr=1e-4,
        validation_split=0.2,
        validation_every=2,
        overfit_ratio=0,
        patience=0,
    )
    whole, a_whole = run(tiny_path, mixed_data, tmp_path / "whole.bin", **kw)
    part, _ = run(tiny_path, mixed_data, tmp_path / "part.bin", stop_at=4, **kw)
    assert part.stop_reason == "interrupted" and part.steps == 4 < whole.steps
    rest, a_rest = run(tiny_path, mixed_data, tmp_path / "part.bin", resume=True, **kw)
    assert rest.steps == whole.steps and rest.best_step == whole.best_step
    for name, p in params(a_whole).items():
        assert torch.equal(params(a_rest)[name], p), name
    e_whole = {e.key: e for e in read_adapter(tmp_path / "whole.bin")[1]}
    for e in read_adapter(tmp_path / "part.bin")[1]:
        assert (e.A == e_whole[e.key].A).all() and (e.B == e_whole[e.key].B).all()


def test_stopping_at_max_steps_and_resuming_continues_the_schedule(tiny_path, mixed_data, tmp_path):
    """The warmup-cosine schedule spans the planned epochs, not --max-steps: a run stopped at step 6 and resumed to
    step 12 takes the same steps, at the same rates, as a run straight to step 12."""
    kw = dict(schedule="warmup-cosine", warmup_steps=2, min_lr=1e-4, epochs=3, dropout=0.1)
    rec = MetricsRecorder(events_out=tmp_path / "whole.jsonl")
    whole, a_whole = run(tiny_path, mixed_data, tmp_path / "whole.bin", max_steps=12, recorder=rec, **kw)
    rec.close()
    first, _ = run(tiny_path, mixed_data, tmp_path / "part.bin", max_steps=6, **kw)
    assert first.steps == 6 and first.stop_reason == "max steps"
    _, meta = load_state(state_path(tmp_path / "part.bin"))
    planned = meta["schedule"]["steps"]
    assert planned > 12  # three epochs of the data
    notes = []
    rec = MetricsRecorder(events_out=tmp_path / "rest.jsonl")
    rest, a_rest = run(
        tiny_path, mixed_data, tmp_path / "part.bin", max_steps=12, resume=True, recorder=rec, log=notes.append, **kw
    )
    rec.close()
    assert rest.steps == whole.steps == 12 and not any("learning-rate schedule" in n for n in notes)
    for name, p in params(a_whole).items():
        assert torch.equal(params(a_rest)[name], p), name

    def rates(path):
        return [e["lr_a"] for e in map(json.loads, path.read_text().splitlines()) if e["kind"] == "train_step"]

    assert rates(tmp_path / "rest.jsonl") == rates(tmp_path / "whole.jsonl")[6:]
    assert rates(tmp_path / "whole.jsonl")[5] > 0.5 * 5e-3  # still near the peak at step 6 of the planned length


def test_a_schedule_changed_on_resume_is_said(tiny_path, mixed_data, tmp_path):
    kw = dict(schedule="warmup-cosine", epochs=3)
    run(tiny_path, mixed_data, tmp_path / "a.bin", max_steps=2, **kw)
    _, meta = load_state(state_path(tmp_path / "a.bin"))
    notes = []
    run(tiny_path, mixed_data, tmp_path / "a.bin", max_steps=4, schedule_steps=5, resume=True, log=notes.append, **kw)
    said = [n for n in notes if "learning-rate schedule" in n]
    assert len(said) == 1 and f"steps {meta['schedule']['steps']} -> 5" in said[0] and "\n" not in said[0]
    _, meta = load_state(state_path(tmp_path / "a.bin"))
    assert meta["schedule"]["steps"] == 5


def test_resume_refuses_other_data(tiny_path, mixed_data, tmp_path):
    from juno_py.train.state import StateError

    run(tiny_path, mixed_data, tmp_path / "a.bin", max_steps=2, epochs=None)
    other = tmp_path / "other.jsonl"
    other.write_text('{"text": "something else entirely"}\n')
    with pytest.raises(StateError, match="data differs"):
        run(tiny_path, other, tmp_path / "a.bin", max_steps=3, epochs=None, resume=True)


def test_nan_gradient_stops_before_the_optimizer_and_keeps_the_last_checkpoint(tiny_path, mixed_data, tmp_path):
    kw = dict(epochs=None, schedule="constant")  # the same rates whatever the run's length
    good, a_good = run(tiny_path, mixed_data, tmp_path / "good.bin", max_steps=2, **kw)
    _, good_meta = load_state(state_path(tmp_path / "good.bin"))
    good_moments, _ = load_state(state_path(tmp_path / "good.bin"))

    calls = {"n": 0}

    def poison(adapters):
        p = next(iter(adapters.parameters()))

        def hook(g):
            calls["n"] += 1
            return g * float("nan") if calls["n"] == 3 else g  # the third step's backward

        p.register_hook(hook)

    path = tmp_path / "bad.bin"
    with pytest.raises(TrainingDiverged, match="step 3: the gradient norm is nan: stopped before the optimizer"):
        run(tiny_path, mixed_data, path, max_steps=5, save_every=1, hook=poison, **kw)
    # the adapter on disk is the one after step 2, the optimizer state untouched by step 3
    entries = {e.key: e for e in read_adapter(path)[1]}
    for name, p in params(a_good).items():
        key, what = name.rsplit(".", 1)
        saved = entries[key].A if what == "lora_A" else entries[key].B
        assert (torch.from_numpy(saved) == p).all(), name
    tensors, meta = load_state(state_path(path))
    assert meta["run"]["step"] == 2 == good_meta["run"]["step"]
    for k, v in good_moments.items():
        if k.startswith(("adam/", "param/")):
            assert torch.equal(tensors[k], v), k


def test_nan_loss_is_caught_before_backward(tiny_path, mixed_data):
    def poison(adapters):
        with torch.no_grad():
            next(iter(adapters.groups()["A"])).fill_(float("inf"))
            next(iter(adapters.groups()["B"])).fill_(1.0)

    with pytest.raises(TrainingDiverged, match="the loss is nan"):
        run(tiny_path, mixed_data, None, max_steps=2, epochs=None, hook=poison)


def test_clipping_and_metrics_events(tiny_path, mixed_data, tmp_path):
    rec = MetricsRecorder(events_out=tmp_path / "events.jsonl")
    r, _ = run(
        tiny_path,
        mixed_data,
        tmp_path / "m.bin",
        max_steps=3,
        epochs=None,
        max_grad_norm=1e-3,
        mode=Mode.DORA,
        validation_split=0.2,
        recorder=rec,
    )
    rec.close()
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    kinds = {e["kind"] for e in events}
    assert {"train_step", "validation", "norm_refresh", "checkpoint"} <= kinds
    steps = [e for e in events if e["kind"] == "train_step"]
    assert len(steps) == 3 and all(e["clipped"] for e in steps)
    for field in (
        "step",
        "tokens",
        "loss",
        "grad_norm",
        "lr_a",
        "lr_b",
        "forward_ms",
        "backward_ms",
        "optimizer_ms",
        "algorithm",
        "rank",
        "targets",
    ):
        assert field in steps[0], field
    assert r.summary().startswith("trained 3 steps")


def test_optimizer_groups_decay_a_only_and_lora_plus_scales_b(tiny_model):
    adapters = attached(tiny_model, Mode.DORA)
    opt = build_optimizer(adapters, 1e-3, weight_decay=0.1, plus_ratio=16)
    groups = {g["name"]: g for g in opt.param_groups}
    assert groups["A"]["weight_decay"] == 0.1 and groups["A"]["lr"] == 1e-3
    assert groups["B"]["weight_decay"] == 0.0 and groups["B"]["lr"] == pytest.approx(16e-3)
    assert groups["magnitude"]["weight_decay"] == 0.0
    assert opt.defaults["betas"] == (0.9, 0.999) and opt.defaults["eps"] == 1e-8
    # decoupled decay: with zero gradients only A moves, by lr·wd·A
    a0 = {id(p): p.detach().clone() for g in opt.param_groups for p in g["params"]}
    for g in opt.param_groups:
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    opt.step()
    for g in opt.param_groups:
        for p in g["params"]:
            expect = a0[id(p)] * (1 - 1e-3 * 0.1) if g["name"] == "A" else a0[id(p)]
            torch.testing.assert_close(p.detach(), expect)


def test_schedules():
    assert [lr_factor("constant", s, 10, 2) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    f = [lr_factor("warmup-cosine", s, 10, 2, 0.1) for s in range(10)]
    assert f[:3] == [0.5, 1.0, 1.0] and f[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[2:], f[3:]))


def test_validation_patience_restores_the_best_weights(tiny_path, mixed_data, tmp_path):
    r, adapters = run(
        tiny_path,
        mixed_data,
        tmp_path / "v.bin",
        lr=0.5,
        max_grad_norm=0,
        epochs=30,
        validation_split=0.3,
        validation_every=1,
        patience=2,
        overfit_ratio=0,
    )
    assert r.stop_reason.startswith("validation patience")
    assert r.best_step < r.steps
    # the saved adapter holds the best weights: re-validating gives the best loss
    from juno_py.lora import load_adapters
    from juno_py.models import load_model

    model = load_model(tiny_path)
    _, val_set = dataset(model, mixed_data, qa_variants_n=2, validation_split=0.3)
    load_adapters(model, [str(tmp_path / "v.bin")])
    assert evaluate(model, val_set, 2)["loss"] == pytest.approx(r.best_validation, rel=1e-4)


def test_loss_target_stops(tiny_path, mixed_data):
    r, _ = run(tiny_path, mixed_data, None, lr=2e-2, epochs=50, loss_target=12.0)
    assert r.stop_reason.startswith("loss target") and r.steps < 50 * 7 and r.epochs >= 1


def test_evaluate_is_token_weighted(tiny_model, mixed_data):
    examples = dataset(tiny_model, mixed_data)[0]
    res = evaluate(tiny_model, examples, batch_size=3)
    total = n = 0
    with torch.no_grad():
        for e in examples:
            b = collate([[e]])
            total += float(tiny_model.loss(b.tokens, b.targets, b.positions, reduction="sum", documents=b.documents))
            n += b.n_supervised
    assert res["tokens"] == n and res["loss"] == pytest.approx(total / n, rel=1e-5)
    assert res["ppl"] == pytest.approx(math.exp(res["loss"]))


def test_cpu_adamw_is_torchs_adamw_bit_for_bit():
    """The trainer's CPU AdamW against torch.optim.AdamW(foreach=False): three groups (decay, a second rate, no
    decay), a parameter without a gradient on some steps, 12 steps: the same parameters and moments, bit for bit."""
    from juno_py.train.optim import AdamW

    g = torch.Generator().manual_seed(5)
    shapes = [(4, 6), (6,), (3, 5)]
    start = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(12)]
    runs = []
    for cls in (torch.optim.AdamW, AdamW):
        ps = [torch.nn.Parameter(t.clone()) for t in start]
        groups = [
            {"params": [ps[0]], "lr": 3e-3, "weight_decay": 0.1},
            {"params": [ps[1]], "lr": 5e-2, "weight_decay": 0.0},
            {"params": [ps[2]], "lr": 1e-3, "weight_decay": 0.0},
        ]
        opt = cls(
            groups,
            lr=1e-3,
            betas=(0.9, 0.999),
            eps=1e-8,
            weight_decay=0.01,
            **({"foreach": False} if cls is torch.optim.AdamW else {}),
        )
        for k, step_grads in enumerate(grads):
            for p, gr in zip(ps, step_grads):
                p.grad = None if (p is ps[2] and k % 3 == 1) else gr.clone()
            if k == 6:
                opt.param_groups[0]["lr"] = 1e-2  # a schedule changing a rate
            opt.step()
            opt.zero_grad(set_to_none=True)
        runs.append(
            (
                [p.detach() for p in ps],
                [(opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"], float(opt.state[p]["step"])) for p in ps],
            )
        )
    for a, b in zip(runs[0][0], runs[1][0]):
        assert torch.equal(a, b)
    for (m1, v1, s1), (m2, v2, s2) in zip(runs[0][1], runs[1][1]):
        assert torch.equal(m1, m2) and torch.equal(v1, v2) and s1 == s2


def test_cpu_training_does_not_import_dynamo(tiny_path, mixed_data):
    """A training run on a CPU (DoRA, all targets, the trainer's AdamW, the loss head, the gated MLP) keeps
    torch._dynamo and sympy out of the process: torch.optim.Optimizer and autograd.grad with explicit output
    gradients would import them, 145 MiB of resident memory for nothing."""
    import subprocess
    import sys

    code = f"""
import sys
from juno_py.lora import Mode, attach
from juno_py.metrics import MetricsRecorder
from juno_py.models import load_model
from juno_py.train.data import load_dataset
from juno_py.train.loop import TrainConfig, train
model = load_model({str(tiny_path)!r})
adapters = attach(model, "all", rank=4, alpha=8, mode=Mode.DORA)
data, _, _ = load_dataset([{str(mixed_data)!r}], model.tokenizer, 256)
train(model, adapters, data, TrainConfig(lr=1e-3, batch_size=2, max_steps=2, epochs=None, seed=0),
      recorder=MetricsRecorder(), progress=False, log=lambda s: None)
print("torch._dynamo" in sys.modules, "sympy" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["False", "False"]


def test_dora_norms_follow_a_fused_optimizer(tiny_model, mixed_data):
    """torch's fused AdamW (the GPU optimizer; it runs on the CPU too) updates A and B without bumping their version
    counters, which key DoRA's cached norm: the loop drops the cache after every step, so each step uses the norm of
    the adapter as it is then, and so does playback after training."""
    train_set, _ = dataset(tiny_model, mixed_data, qa_variants_n=1)
    adapters = attached(tiny_model, Mode.DORA)
    nudge(adapters)
    mods = list(adapters.modules.values())
    A = mods[0].dora.lora_A
    groups = [{"params": list(adapters.parameters()), "lr": 5e-2, "base_lr": 5e-2, "name": "all"}]
    opt = torch.optim.AdamW(groups, lr=5e-2, fused=True)
    version = A._version
    cfg = TrainConfig(lr=5e-2, batch_size=2, max_steps=3, epochs=None, schedule="constant", seed=3)
    used = []
    real = type(mods[0]).dora_norm

    def recording(self, *a, **kw):
        norm = real(self, *a, **kw)
        if self is mods[0] and self.training:
            used.append((norm.clone(), self.weight_row_norm(eps=1e-6)))  # the norm used, and the adapter's own
        return norm

    type(mods[0]).dora_norm = recording
    try:
        train(tiny_model, adapters, train_set, cfg, optimizer=opt, progress=False, log=lambda s: None)
    finally:
        type(mods[0]).dora_norm = real
    assert A._version == version  # the premise: three steps of the fused optimizer left the counter alone
    assert len(used) >= 3
    for got, fresh in used:
        assert torch.allclose(got, fresh, rtol=1e-6, atol=0)
    assert not torch.allclose(used[0][1], used[-1][1], rtol=1e-4)  # the adapter moved: a stale norm would show
    tiny_model.eval()
    assert torch.allclose(mods[0].dora_norm(), mods[0].weight_row_norm(eps=1e-6), rtol=1e-6, atol=0)


def test_a_run_starts_with_an_exact_u(tiny_model, mixed_data):
    """train() forgets every DoRA layer's running U before its first step (a resume, or an earlier run in the
    process, may have put other values into A), so the first stale norm computes U = W·Aᵀ afresh."""
    train_set, _ = dataset(tiny_model, mixed_data, qa_variants_n=1)
    adapters = attached(tiny_model, Mode.DORA)
    mods = list(adapters.modules.values())
    for m in mods:
        m._running_u = ("stale", None, None)
    cfg = TrainConfig(lr=1e-3, batch_size=2, max_steps=1, epochs=None, schedule="constant", seed=3)
    train(tiny_model, adapters, train_set, cfg, progress=False, log=lambda s: None)
    assert all(m._running_u is None for m in mods)  # reset (and, on the CPU, never started)


def test_the_thread_guard_sees_every_step_and_its_changes_are_events(tiny_path, mixed_data, tmp_path):
    from juno_py import threads

    seen = []

    class Scripted(threads.StallGuard):
        def observe(self, seconds, work=1.0):
            seen.append((seconds, work))
            if len(seen) == 2:
                self._move(1)
            return self.threads

    before = torch.get_num_threads()
    rec = MetricsRecorder(events_out=tmp_path / "events.jsonl")
    try:
        run(tiny_path, mixed_data, max_steps=3, epochs=None, recorder=rec, thread_guard=Scripted(2))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
        threads.apply(before)
    rec.close()
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    steps = [e for e in events if e["kind"] == "train_step"]
    assert len(seen) == 3 and all(s > 0 for s, _ in seen)
    assert [w for _, w in seen] == [e["tokens"] for e in steps]
    moved = [e for e in events if e["kind"] == "threads"]
    assert [(e["step"], e["previous"], e["threads"]) for e in moved] == [(2, 2, 1)]


def test_summary_names_the_peak_gpu_memory_only_when_there_is_one():
    from juno_py.train.loop import TrainResult

    common = dict(steps=2, epochs=1.0, tokens=64, seconds=2.0, stop_reason="max steps", first_loss=2.0, last_loss=1.0)
    on_cpu = TrainResult(**common, peak_rss=2**30).summary()
    on_gpu = TrainResult(**common, peak_rss=2**30, peak_gpu=3 * 2**30).summary()
    assert on_cpu.endswith("peak RSS 1.00 GiB")
    assert on_gpu.endswith("peak RSS 1.00 GiB, peak GPU 3.00 GiB")
    assert "32 tokens/s" in on_gpu
