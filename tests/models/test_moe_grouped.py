"""The grouped expert path (one `torch._grouped_mm` per projection over all experts) against the per-expert loop,
on the CPU in fp32 (torch's CPU grouped matmul, forced with `expert_path="grouped"`): loss, every adapter's gradient
and the router load; the experts' bytes joined into one buffer without a copy where they already are one; one
decode per projection in forward and one in backward; the loop kept for DoRA and float64."""

import pytest
import torch

from juno_py.gguf import GGMLType
from juno_py.lora import Mode, attach
from juno_py.models import load_model
from juno_py.models import moe as moe_mod
from juno_py.models.moe import EXPERT_TARGETS

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")

CASES = [
    ("qwen3moe", "per-expert", 3),
    ("qwen3moe", "shared", 8),
    ("mixtral", "per-expert", 8),
    ("gpt-oss", "per-expert", 2),  # expert biases, the clamped SwiGLU, top-k-then-softmax routing
]


def _trained(path, path_mode, experts, rank, mode=Mode.LORA):
    model = load_model(path)
    aset = attach(model, "all,router", rank=rank, alpha=2.0 * rank, seed=0, experts=experts, mode=mode)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for ad in aset.adapters.values():
            ad.lora_B.copy_(torch.randn(ad.lora_B.shape, generator=g) * 0.1)
    for blk in model.blocks:
        blk.moe.expert_path = path_mode
    return model, aset


def _step(model, aset):
    ids = torch.randint(3, 200, (2, 13), generator=torch.Generator().manual_seed(5))
    loss = model.loss(ids, ids.roll(-1, 1))
    loss.backward()
    grads = {n: p.grad for n, p in aset.named_parameters()}
    return loss.item(), grads, {k: v.clone() for k, v in model.expert_load().items()}


@pytest.mark.parametrize("arch,experts,rank", CASES, ids=[f"{a}-{e}-r{r}" for a, e, r in CASES])
def test_grouped_matches_the_loop(tiny_gguf, arch, experts, rank, monkeypatch):
    path = tiny_gguf(arch, GGMLType.Q8_0)
    loop_loss, loop_grads, loop_load = _step(*_trained(path, "loop", experts, rank))
    calls = []
    real = moe_mod.grouped_matmul
    monkeypatch.setattr(moe_mod, "grouped_matmul", lambda *a: calls.append(1) or real(*a))
    model, aset = _trained(path, "grouped", experts, rank)
    loss, grads, load = _step(model, aset)
    assert calls, "the grouped path did not run"
    assert abs(loss - loop_loss) <= 1e-5 * abs(loop_loss)
    assert load.keys() == loop_load.keys() and all(torch.equal(load[k], loop_load[k]) for k in load)
    checked = 0
    for name, want in loop_grads.items():
        got = grads[name]
        if want is None:  # an expert no token chose: no gradient on the loop, zeros on the grouped path
            assert got is None or not got.any(), name
            continue
        assert got is not None, name
        assert want.abs().max() > 0, name
        err = float((got - want).abs().max() / want.abs().max())
        assert err <= 1e-4, (name, err)
        checked += 1
    assert checked > len(loop_grads) // 2


def test_grouped_decodes_each_projection_once_forward_and_once_backward(tiny_gguf, monkeypatch):
    model, aset = _trained(tiny_gguf("qwen3moe", GGMLType.Q8_0), "grouped", "per-expert", 4)
    decodes: list[int] = []
    real = moe_mod._GroupedProjection.decode

    def counted(self, dtype):
        inner = real(self, dtype)

        def weights():
            decodes.append(self.n_expert)
            return inner()

        return weights

    monkeypatch.setattr(moe_mod._GroupedProjection, "decode", counted)
    ids = torch.randint(3, 200, (1, 9), generator=torch.Generator().manual_seed(2))
    loss = model.loss(ids, ids.roll(-1, 1))
    n_moe = sum(blk.moe is not None for blk in model.blocks)
    assert len(decodes) == 3 * n_moe
    loss.backward()
    assert len(decodes) == 6 * n_moe
    assert set(decodes) == {model.args.n_expert}


def test_expert_bytes_join_into_one_buffer(tiny_gguf):
    model, _ = _trained(tiny_gguf("qwen3moe", GGMLType.Q4_0), "grouped", "per-expert", 8)
    moe = model.blocks[0].moe
    plan = moe._projection("wup_exps")
    assert plan is not None
    bases = [m.base for m in moe.experts["wup_exps"]]
    whole = plan.whole.raw
    row = bases[0].raw.numel()
    # each expert's bytes are its slice of the joined buffer (held once), decoded the same as before
    for e, b in enumerate(bases):
        assert b.raw.data_ptr() == whole.data_ptr() + e * row
        assert torch.equal(plan.decode(torch.float32)()[e], b.dequantize_rows(0, b.out_features))
    # a second look finds them joined: a view, not another copy
    assert moe._projection("wup_exps") is plan
    moe._grouped.clear()
    again = moe._projection("wup_exps")
    assert again is not None and again.whole.raw.data_ptr() == whole.data_ptr()


def test_dora_and_float64_take_the_loop(tiny_gguf, monkeypatch):
    path = tiny_gguf("gpt-oss", GGMLType.Q8_0)
    monkeypatch.setattr(moe_mod, "grouped_matmul", lambda *a: pytest.fail("grouped path ran"))
    model, _ = _trained(path, "grouped", "per-expert", 2, mode=Mode.DORA)
    assert all(model.blocks[0].moe._projection(t) is None for t in EXPERT_TARGETS)
    _step(model, _)
    model, aset = _trained(path, "grouped", "per-expert", 2)
    model.set_activation_dtype(torch.float64)
    for p in aset.parameters():
        p.data = p.data.double()
    _step(model, aset)


def test_idle_experts_get_a_zero_gradient_whatever_the_kernel_left():
    present = torch.tensor([True, False, True])
    t = torch.randn(3, 2, 4, requires_grad=True)
    out = moe_mod._ZeroIdleGrad.apply(t, present)
    assert torch.equal(out, t)
    g = torch.randn(3, 2, 4)
    g[1] = float("nan")  # what an uninitialised empty group may hold
    out.backward(g)
    assert torch.equal(t.grad[0], g[0]) and torch.equal(t.grad[2], g[2])
    assert torch.equal(t.grad[1], torch.zeros(2, 4))


def test_grouped_view_follows_the_expert_modules(tiny_gguf):
    """The grouped view is kept while no expert module is replaced (a count on the experts' list, not each expert's
    identity, is checked every forward), rebuilt when one is: detach, attach, a single expert put back."""
    from juno_py.lora import detach

    model, _ = _trained(tiny_gguf("qwen3moe", GGMLType.Q8_0), "grouped", "per-expert", 8)
    moe = model.blocks[0].moe
    plan = moe._projection("wup_exps")
    assert plan is not None and moe._projection("wup_exps") is plan
    # a trained per-expert slot multiplies its stack, not a stack of the experts' views
    (slot,) = plan.slots
    assert slot.stack is moe.adapter_stacks["wup_exps"]
    detach(model)
    bare = moe._projection("wup_exps")
    assert bare is not plan and bare is not None and bare.slots == []
    attach(model, "experts", rank=4, alpha=8, seed=0)
    again = moe._projection("wup_exps")
    assert again is not bare and again is not None and again.slots[0].stack is moe.adapter_stacks["wup_exps"]
    model.set_linear(0, "wup_exps", moe.experts["wup_exps"][3].base, 3)  # one expert without its adapter
    assert moe._projection("wup_exps") is None  # the experts no longer agree: the loop runs


def test_load_summary_reads_every_block_at_once(monkeypatch):
    loads = {0: torch.tensor([3, 0, 1, 4]), 2: torch.tensor([2, 2, 2, 2])}
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or real(t))
    got = moe_mod.load_summary(loads)
    assert len(reads) == 1
    assert got["counts"] == {0: [3, 0, 1, 4], 2: [2, 2, 2, 2]}
    assert got["idle_experts"] == 1 and got["imbalance_max"] == 2.0 and got["imbalance_mean"] == 1.5
