"""GaLore-AdamW on its own: AdamW at P = I, a float64 reference with exact SVD, the randomized SVD, staggered
refreshes, the state size, and a reduced toy problem that still tells GaLore from a frozen projector and from BA."""

import math

import pytest
import torch

from juno_py.train.galore import (
    GaLoreAdamW,
    GaLoreConfig,
    GaLoreConfigError,
    check_per_layer,
    resolve_update_mode,
    state_numel,
    top_singular_vectors,
)


def gradients(shape, steps, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # a decaying spectrum plus noise: top subspaces are well defined but move from step to step
    out = []
    for _ in range(steps):
        a = torch.randn(shape[0], 6, generator=g, dtype=torch.float64) * torch.tensor(
            [4.0, 3.0, 2.0, 1.5, 1, 0.5], dtype=torch.float64
        )
        b = torch.randn(6, shape[1], generator=g, dtype=torch.float64)
        out.append((a @ b + 0.3 * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype))
    return out


def run_ours(w0, grads, cfg, lr, wd, **kw):
    w = torch.nn.Parameter(w0.clone())
    opt = GaLoreAdamW([("w", w)], lr, wd, cfg, **kw)
    for g in grads:
        w.grad = g.clone()
        opt.step()
        opt.zero_grad()
    return w.detach(), opt


def reference_galore(w0, grads, rank, gap, scale, lr, wd, betas=(0.9, 0.999), eps=1e-8):
    """GaLore-AdamW in float64, written from the paper: P from torch.linalg.svd of the gradient every `gap` steps
    (left singular vectors when m <= n, else right), Adam on R = PᵀG (or G P), the step lifted back times α,
    decoupled weight decay before the step (torch.optim.AdamW's order)."""
    w = w0.double().clone()
    m = v = p = None
    left = w.shape[0] <= w.shape[1]
    for t, g in enumerate(grads):
        g = g.double()
        if t % gap == 0:
            u, _, vh = torch.linalg.svd(g, full_matrices=False)
            p = u[:, :rank] if left else vh[:rank].T
        r = p.T @ g if left else g @ p
        m = (1 - betas[0]) * r if m is None else betas[0] * m + (1 - betas[0]) * r
        v = (1 - betas[1]) * r * r if v is None else betas[1] * v + (1 - betas[1]) * r * r
        m_hat, v_hat = m / (1 - betas[0] ** (t + 1)), v / (1 - betas[1] ** (t + 1))
        n = m_hat / (v_hat.sqrt() + eps)
        w = w * (1 - lr * wd) - lr * scale * (p @ n if left else n @ p.T)
    return w


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_identity_projector_and_unit_scale_equal_torch_adamw(shape):
    grads = gradients(shape, 50, seed=1)
    w0 = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    ours, _ = run_ours(w0, grads, GaLoreConfig(rank=min(shape), scale=1.0, svd="identity"), 3e-3, 0.1)
    w = torch.nn.Parameter(w0.clone())
    adam = torch.optim.AdamW([w], lr=3e-3, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8)
    for g in grads:
        w.grad = g.clone()
        adam.step()
    torch.testing.assert_close(ours, w.detach())
    assert (ours - w0).abs().max() > 0.05  # it moved: the comparison is not between two unchanged tensors


def test_rotating_full_rank_projector_is_not_adam():
    shape = (24, 40)
    grads = gradients(shape, 20, seed=3)
    w0 = torch.zeros(shape)
    ours, _ = run_ours(w0, grads, GaLoreConfig(rank=24, scale=1.0, svd="exact", update_gap=1), 1e-2, 0.0)
    w = torch.nn.Parameter(w0.clone())
    adam = torch.optim.AdamW([w], lr=1e-2, weight_decay=0.0)
    for g in grads:
        w.grad = g.clone()
        adam.step()
    assert float((ours - w.detach()).norm() / w.detach().norm()) > 0.05


@pytest.mark.parametrize("shape,wd", [((12, 30), 0.0), ((30, 12), 0.05)])
def test_exact_svd_updates_equal_a_float64_reference(shape, wd):
    grads = gradients(shape, 23, seed=4, dtype=torch.float64)
    w0 = torch.randn(shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    cfg = GaLoreConfig(rank=4, update_gap=5, scale=0.25, svd="exact", stagger=False)
    ours, opt = run_ours(w0, grads, cfg, 1e-2, wd)
    ref = reference_galore(w0, grads, 4, 5, 0.25, 1e-2, wd)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    assert opt.summary()["matrices"]["w"]["refreshes"] == 5  # steps 0, 5, 10, 15, 20
    assert float((ours - w0).norm()) > 0.05


def test_updates_equal_galore_torch_when_it_imports():
    """galore-torch 1.0 needs bitsandbytes, so it is no dependency; where it is present, its GaLoreAdamW must give
    our updates (eps = 0 and no weight decay: it adds eps before the bias correction and decays after the step)."""
    galore_torch = pytest.importorskip("galore_torch")
    shape = (12, 30)
    grads = gradients(shape, 13, seed=6, dtype=torch.float32)
    w0 = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    ours, _ = run_ours(w0, grads, GaLoreConfig(rank=4, update_gap=5, scale=0.25, svd="exact", stagger=False), 1e-2, 0.0)
    w = torch.nn.Parameter(w0.clone())
    theirs = galore_torch.GaLoreAdamW(
        [{"params": [w], "rank": 4, "update_proj_gap": 5, "scale": 0.25, "proj_type": "std"}],
        lr=1e-2,
        eps=0.0,
        weight_decay=0.0,
        no_deprecation_warning=True,
    )
    for g in grads:
        w.grad = g.clone()
        theirs.step()
    torch.testing.assert_close(ours, w.detach(), rtol=1e-4, atol=1e-6)


def test_randomized_svd_finds_the_top_subspace():
    g = torch.Generator().manual_seed(8)
    u = torch.linalg.qr(torch.randn(300, 300, generator=g)).Q
    v = torch.linalg.qr(torch.randn(200, 200, generator=g)).Q
    s = torch.cat([torch.linspace(10, 5, 16), 0.5 * torch.rand(184, generator=g)])
    a = (u[:, :200] * s) @ v.T  # [300, 200]
    for side, truth in (("left", u[:, :16]), ("right", v[:, :16])):
        p = top_singular_vectors(a, 16, side, "randomized", torch.Generator().manual_seed(0))
        assert p.shape == truth.shape
        torch.testing.assert_close(p.T @ p, torch.eye(16), atol=1e-5, rtol=0)
        # the cosines of the principal angles between the found and true subspaces
        cosines = torch.linalg.svdvals(truth.T @ p)
        assert float(cosines.min()) > 0.999
        exact = top_singular_vectors(a, 16, side, "exact")
        assert float(torch.linalg.svdvals(exact.T @ p).min()) > 0.999


def test_refreshes_are_staggered_across_matrices():
    params = [(f"m{i}", torch.nn.Parameter(torch.zeros(8, 12))) for i in range(6)]
    opt = GaLoreAdamW(params, 1e-3, 0.0, GaLoreConfig(rank=2, update_gap=4, svd="exact"))
    per_step = []
    gen = torch.Generator().manual_seed(0)
    for _ in range(13):
        for _, p in params:
            p.grad = torch.randn(8, 12, generator=gen)
        before = sum(opt.state[p]["refreshes"] for _, p in params)
        opt.step()
        per_step.append(sum(opt.state[p]["refreshes"] for _, p in params) - before)
    assert per_step[0] == 6  # every matrix needs its first projector
    assert max(per_step[1:]) <= 2 and sum(per_step[1:]) == 6 * 3  # 6 matrices over a gap of 4: at most 2 a step
    assert sorted(opt.state[p]["phase"] for _, p in params) == [0, 0, 1, 2, 2, 3]


def test_state_size_on_a_4096_by_14336_matrix_at_rank_512():
    w = torch.nn.Parameter(torch.zeros(4096, 14336))
    # the identity projector spares CI a rank-512 SVD of this size; the state's shapes do not depend on the method
    opt = GaLoreAdamW([("w", w)], 1e-3, 0.0, GaLoreConfig(rank=512, svd="identity"))
    w.grad = torch.ones(4096, 14336)
    opt.step()
    assert float(w.detach()[0, 0]) == pytest.approx(-1e-3 * 0.25)  # one real step was taken
    st = opt.state[w]
    assert st["side"] == "left" and tuple(st["projector"].shape) == (4096, 512)
    assert tuple(st["exp_avg"].shape) == tuple(st["exp_avg_sq"].shape) == (512, 14336)
    size = opt.state_size()  # counted from the allocated tensors
    assert size == {"moments": 14_680_064, "projector": 2_097_152, "adamw": 117_440_512}
    assert size == state_numel((4096, 14336), 512)
    lines = opt.summary_lines()
    assert "14.68M moment values + 2.10M projector values (16.78M) vs AdamW's 117.44M" in lines[0]


def test_per_layer_mode_refuses_what_needs_all_gradients():
    check_per_layer(1, 0.0)
    with pytest.raises(GaLoreConfigError, match="gradient accumulation"):
        check_per_layer(4, 0.0)
    with pytest.raises(GaLoreConfigError, match="global gradient norm"):
        check_per_layer(1, 1.0)
    with pytest.raises(GaLoreConfigError, match="bptt-window"):
        check_per_layer(1, 0.0, bptt_window=16)
    with pytest.raises(GaLoreConfigError, match="processes"):
        check_per_layer(1, 0.0, world_size=2)
    with pytest.raises(GaLoreConfigError, match="galore-svd"):
        GaLoreConfig(svd="qr")


def test_update_mode_defaults_per_layer_with_per_matrix_clipping_in_one_process():
    assert resolve_update_mode("galore", None, "auto", 1.0) == (True, "per-matrix", 0.0, 1.0)
    assert resolve_update_mode("galore", None, "auto", 1.0, accumulation=4, world_size=2) == (False, "global", 1.0, 0.0)
    assert resolve_update_mode("galore", False, "per-matrix", 0.5, accumulation=4) == (False, "per-matrix", 0.0, 0.5)
    assert resolve_update_mode("adamw", None, "auto", 1.0) == (False, "global", 1.0, 0.0)
    with pytest.raises(GaLoreConfigError, match="gradient accumulation"):
        resolve_update_mode("galore", None, "auto", 1.0, accumulation=2)


def test_per_layer_hook_updates_during_backward_and_frees_the_gradient():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(32, 16, generator=g)
    w1, w2 = (torch.nn.Parameter(0.3 * torch.randn(16, 16, generator=g)) for _ in range(2))
    states = []
    for per_layer in (False, True):
        a, b = torch.nn.Parameter(w1.detach().clone()), torch.nn.Parameter(w2.detach().clone())
        opt = GaLoreAdamW(
            [("a", a), ("b", b)], 1e-2, 0.0, GaLoreConfig(rank=4, update_gap=2, svd="exact", per_layer=per_layer)
        )
        for _ in range(5):
            loss = ((x @ a.T).tanh() @ b.T).square().mean()
            loss.backward()
            if per_layer:
                assert a.grad is None and b.grad is None
                assert opt.grad_norm([a, b]) > 0
            opt.step()
            opt.zero_grad()
        states.append((a.detach(), b.detach()))
    torch.testing.assert_close(states[1][0], states[0][0], rtol=0, atol=0)
    torch.testing.assert_close(states[1][1], states[0][1], rtol=0, atol=0)


def test_device_guarded_update_equals_the_plain_one_and_skips_a_non_finite_gradient():
    """The GPU per-layer path checks finiteness on the device (`ok`): a finite gradient must step exactly as the
    plain path does; a non-finite one must leave weights and moments as they were (run here on the CPU)."""
    grads = gradients((16, 24), 4, seed=10)
    results = []
    for guarded in (False, True):
        w = torch.nn.Parameter(torch.ones(16, 24))
        opt = GaLoreAdamW([("w", w)], 1e-2, 0.1, GaLoreConfig(rank=4, update_gap=3, svd="exact"))
        for g in grads:
            ok = torch.tensor(True) if guarded else None
            opt._update(w, g, opt.param_groups[0], ok=ok)
        results.append((w.detach().clone(), opt.state[w]["exp_avg"].clone()))
        if guarded:
            before = (w.detach().clone(), opt.state[w]["exp_avg"].clone(), opt.state[w]["exp_avg_sq"].clone())
            bad = grads[0].clone()
            bad[3, 5] = float("nan")
            assert opt.state[w]["step"] % 3 != 0  # no refresh due: the update runs, masked on the device
            opt._update(w, bad, opt.param_groups[0], ok=torch.isfinite(bad.sum()))
            assert torch.equal(w.detach(), before[0]) and torch.equal(opt.state[w]["exp_avg"], before[1])
            assert torch.equal(opt.state[w]["exp_avg_sq"], before[2])
            opt.state[w]["step"] = 6  # a refresh is due: the non-finite gradient is caught before the SVD
            opt._update(w, bad, opt.param_groups[0], ok=torch.isfinite(bad.sum()))
            assert torch.equal(w.detach(), before[0])
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ toy problem
@pytest.fixture
def one_thread():
    """64x64 matmuls gain nothing from a second thread, and lose a lot to it on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_reduced_toy_problem_separates_galore_from_frozen_projector_and_low_rank_product(one_thread):
    """The benchmark's toy problem at 64x64, rank 4 (benchmarks.galore_toy runs the full 256x256 one): GaLore
    with refreshes goes far below the rank-4 Eckart-Young floor; a never-refreshed projector and a trained B·A
    cannot."""
    from juno_py.testing.galore_toy import eckart_young_floor, make_toy, train_toy

    toy = make_toy(d=64, n=2048, seed=0)
    floor = eckart_young_floor(64, 4)
    assert floor == pytest.approx(0.5608, abs=1e-4)
    kw = dict(rank=4, gap=25, batch=256, svd="exact")
    galore = train_toy(toy, "galore", 1e-2, 800, **kw)[-1][1]
    frozen = train_toy(toy, "galore-frozen", 1e-2, 400, **kw)[-1][1]
    lora = train_toy(toy, "lora", 1e-2, 400, **kw)[-1][1]
    print(f"\nreduced toy: galore {galore:.2e}, frozen projector {frozen:.3f}, BA {lora:.3f} (floor {floor:.3f})")
    assert galore < 1e-2
    assert frozen > 0.9 * floor and lora > 0.95 * floor
    assert math.isfinite(galore)
