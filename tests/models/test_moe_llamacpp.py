"""Mixture-of-experts models against llama.cpp, the reference for what a GGUF means: tiny qwen3moe, Mixtral (llama
with experts) and gpt-oss files, and llama.cpp's logits and routing on a fixed token sequence, made once by
`tests/golden/make_golden.py --only moe` and committed (tests/golden/README.md, set `moe`); llama.cpp is not needed
here.

Files whose weights are all F32 (`*_f32`): llama.cpp multiplies F32 activations, so its logits equal juno-py's fp32
ones to float rounding. Files with quantized weights (`*_quant`): before each product with a quantized weight llama.cpp
rounds the activation row to 8 bits (q8_0 blocks of 32 for Q4_0, Q5_0, Q8_0 and MXFP4; q8_1 for Q4_1 and Q5_1, whose
minimum term takes the block's sum rounded to fp16; q8_K blocks of 256 for the k-quants), which juno-py does not, so
the logits differ by about 1 % of their range; rounding juno-py's activations the same way (`rounded_as_llama_cpp`)
brings them back to float rounding, which says that rounding is the whole gap.

The routing must be llama.cpp's token by token: the same experts in the same order, the same weights. The files'
seeds were picked so that no token's k-th and (k+1)-th router logits are nearly tied: the smallest gap is several
times the largest difference of router logits between the two implementations, so the choice cannot flip on
rounding.
"""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import pytest
import torch

from juno_py.gguf import GGMLType
from juno_py.lora import load_adapters
from juno_py.merge import merge_model
from juno_py.models import load_model
from juno_py.models import moe as moe_mod
from juno_py.weights.frozen import FrozenQuantLinear

DATA = Path(__file__).resolve().parents[1] / "golden" / "data"
MODELS = ["qwen3moe_f32", "qwen3moe_quant", "mixtral_f32", "mixtral_quant", "gpt_oss_f32", "gpt_oss_quant"]
MERGES = {"qwen3moe_f32_merged": "qwen3moe_f32", "mixtral_quant_merged": "mixtral_quant"}
FILES = MODELS + list(MERGES)
QUANTIZED = [n for n in FILES if "_quant" in n]

# max |juno-py - llama.cpp| over the logits' range (llama.cpp's max - min):
EXACT = 2e-6  # where no activation is rounded: F32 weights, or juno-py's activations rounded as llama.cpp's (≤ 3.7e-7)
ROUNDED = 3e-2  # quantized weights, llama.cpp's activations rounded and juno-py's not (≤ 1.4e-2)
# the smallest gap between a token's k-th and (k+1)-th router logit, against the largest router-logit difference
MARGIN_OVER_DIFFERENCE = 3.0
MIN_MARGIN = 0.05


def golden(name: str) -> dict[str, np.ndarray]:
    with np.load(DATA / f"moe_{name}.npz") as z:
        return {k: z[k] for k in z.files}


def relative(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.abs(ours - theirs).max() / (theirs.max() - theirs.min()))


@contextlib.contextmanager
def recorded_routing() -> Iterator[list[tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    """Every `moe.route` call of the forwards inside, in block order: (router logits, weights, experts)."""
    calls: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    real = moe_mod.route

    def recording(logits: torch.Tensor, k: int, routing: str = "softmax_topk") -> tuple[torch.Tensor, torch.Tensor]:
        weights, experts = real(logits, k, routing)
        calls.append((logits.double().numpy(), weights.double().numpy(), experts.numpy()))
        return weights, experts

    moe_mod.route = recording  # type: ignore[assignment]
    try:
        yield calls
    finally:
        moe_mod.route = real  # type: ignore[assignment]


def load(path: Path, adapter: Optional[Path] = None):
    model = load_model(path)
    if adapter is not None:
        load_adapters(model, [str(adapter)])
    return model


def forward(model, ids) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """juno-py's fp32 logits `[T, vocab]` of `ids`, and its routing per block: router logits `[L, T, n_expert]`,
    weights and experts `[L, T, k]`."""
    with recorded_routing() as calls, torch.no_grad():
        logits = model.logits([int(i) for i in ids]).double().numpy()
    routing = {
        "router_logits": np.stack([c[0] for c in calls]),
        "expert_weights": np.stack([c[1] for c in calls]),
        "experts": np.stack([c[2] for c in calls]),
    }
    return logits, routing


# ---- llama.cpp's rounding of activations (ggml-cpu's quantize_row_q8_0 / q8_1 / q8_K), for the quantized weights

Q8_0_ACTIVATIONS = {GGMLType.Q4_0, GGMLType.Q5_0, GGMLType.Q8_0, GGMLType.MXFP4}
Q8_1_ACTIVATIONS = {GGMLType.Q4_1: 20, GGMLType.Q5_1: 24}  # block bytes: fp16 d, fp16 m at byte 2, then the bits
Q8_K_ACTIVATIONS = {GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K}
# The activations juno-py and llama.cpp multiply differ in their last bits (sums in other orders): by up to 5e-5 of an
# 8-bit step on these files (llama.cpp's attn_norm and kqv_out against juno-py's inputs of the same products). A scaled
# activation closer than this to a rounding tie (x.5) may round either way in llama.cpp, so it is tried both ways.
NEAR_TIE = 1e-4
MAX_NEAR_TIES = 8


class LlamaCppRounding:
    """llama.cpp's rounding of the activations of quantized products. `other_way[i]`: round the i-th value met within
    NEAR_TIE of a tie (in the order the forward meets them) to the other neighbour; `met` counts those values."""

    def __init__(self, other_way: tuple[bool, ...] = ()):
        self.other_way, self.met = other_way, 0

    def round(self, v: torch.Tensor) -> torch.Tensor:
        """round-half-even(v), as ggml's `_mm256_round_ps` and `nearest_int` round."""
        r = torch.round(v)
        near = (((v - v.floor()) - 0.5).abs() < NEAR_TIE).flatten().nonzero().flatten().tolist()
        flat_r, flat_v = r.view(-1), v.reshape(-1)
        for i in near:
            if self.met < len(self.other_way) and self.other_way[self.met]:
                low = torch.floor(flat_v[i])
                flat_r[i] = low + 1 if flat_r[i] == low else low
            self.met += 1
        return r

    def q8_blocks(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x's rows in blocks of 32 as q8_0/q8_1 round them (float32, as the AVX2 code): q = round(x · 127/amax)
        and d = amax/127. Returns (q `[n, 32]`, d `[n, 1]`), both float32."""
        b = x.reshape(-1, 32).float()
        amax = b.abs().amax(-1, keepdim=True)
        inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
        return self.round(b * inv), amax / 127.0

    def q8_0(self, x: torch.Tensor) -> torch.Tensor:
        """x as a q8_0 row holds it: q · fp16(d)."""
        q, d = self.q8_blocks(x)
        return (q * d.half().float()).reshape(x.shape).to(x.dtype)

    def q8_k(self, x: torch.Tensor) -> torch.Tensor:
        """x as a q8_K row holds it (blocks of 256): the first largest magnitude `max` (with its sign), iscale =
        -127/max, q = min(127, round(iscale · x)), d = 1/iscale."""
        b = x.reshape(-1, 256).float()
        mx = b.gather(-1, b.abs().argmax(-1, keepdim=True))
        iscale = torch.where(mx != 0, -127.0 / mx, torch.zeros_like(mx))
        q = self.round(iscale * b).clamp(max=127)
        d = torch.where(iscale != 0, 1.0 / iscale, torch.zeros_like(iscale))
        return (q * d).reshape(x.shape).to(x.dtype)

    def product(self, real: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """`FrozenQuantLinear._apply_fn` (every product's one entry point) with its activations rounded as llama.cpp's
        CPU matmul rounds them for the weight's type; F32 weights take them as they are. Q4_1 and Q5_1 also get the term
        by which llama.cpp's block minimum differs: it multiplies m by fp16(d·Σq), not by Σ(q·fp16(d))."""

        def apply(layer: FrozenQuantLinear, x: torch.Tensor, bias: Any) -> torch.Tensor:
            t = GGMLType(layer.ggml_type)
            if t == GGMLType.F32:
                return real(layer, x, bias)
            if t in Q8_0_ACTIVATIONS:
                return real(layer, self.q8_0(x), bias)
            if t in Q8_K_ACTIVATIONS:
                return real(layer, self.q8_k(x), bias)
            if t not in Q8_1_ACTIVATIONS:
                raise NotImplementedError(f"llama.cpp's activation rounding for {t.name} weights")
            q, d = self.q8_blocks(x)
            d16 = d.half().float()
            y = real(layer, (q * d16).reshape(x.shape).to(x.dtype), bias)
            sums = q.sum(-1, keepdim=True)
            extra = ((d * sums).half().double() - d16.double() * sums.double()).reshape(*x.shape[:-1], -1)
            raw = layer.raw.reshape(layer.raw.shape[0], -1, Q8_1_ACTIVATIONS[t])
            m = raw[..., 2:4].contiguous().view(torch.float16).squeeze(-1).double()  # [n_out, blocks]
            return y + (extra @ m.T).to(y.dtype)

        return apply


def rounded_as_llama_cpp(
    model, ids, want: np.ndarray, monkeypatch
) -> tuple[float, np.ndarray, dict[str, np.ndarray], int]:
    """juno-py's logits of `ids` with its activations rounded as llama.cpp's, nearest to llama.cpp's `want` over every
    way of rounding the values met near a tie: (max |Δ| over the range, logits, routing, values near a tie)."""
    real = FrozenQuantLinear._apply_fn
    first = LlamaCppRounding()
    monkeypatch.setattr(FrozenQuantLinear, "_apply_fn", first.product(real))
    best = forward(model, ids)
    met = first.met
    assert met <= MAX_NEAR_TIES, f"{met} activations near a rounding tie: choose seeds that meet fewer"
    for other_way in itertools.product((False, True), repeat=met):
        if relative(best[0], want) <= EXACT:
            break
        if any(other_way):
            monkeypatch.setattr(FrozenQuantLinear, "_apply_fn", LlamaCppRounding(other_way).product(real))
            candidate = forward(model, ids)
            if relative(candidate[0], want) < relative(best[0], want):
                best = candidate
    monkeypatch.setattr(FrozenQuantLinear, "_apply_fn", real)
    return relative(best[0], want), best[0], best[1], met


# ------------------------------------------------------------------------------------------------------ tests


def test_the_set_is_complete_and_small():
    """Every file the tests read is there, and the set stays small (the GGUFs are committed, not regenerated)."""
    names = [f"moe_{n}.gguf" for n in FILES] + [f"moe_{n}.npz" for n in FILES] + [f"moe_{n}.bin" for n in MERGES]
    sizes = {n: (DATA / n).stat().st_size for n in names}
    assert sum(sizes.values()) < 1_200_000, sizes
    for name in FILES:
        g = golden(name)
        assert g["ids"].shape == (16,) and g["logits"].shape == (16, 271) and g["logits"].dtype == np.float32


@pytest.mark.parametrize("name", FILES)
def test_logits_match_llama_cpp(name, record_property):
    g = golden(name)
    ours, _ = forward(load(DATA / f"moe_{name}.gguf"), g["ids"])
    rel = relative(ours, g["logits"].astype(np.float64))
    record_property("max_abs_over_range", rel)
    assert rel <= (ROUNDED if name in QUANTIZED else EXACT), rel


@pytest.mark.parametrize("name", QUANTIZED)
def test_llama_cpps_activation_rounding_is_the_whole_gap(name, monkeypatch, record_property):
    g = golden(name)
    want = g["logits"].astype(np.float64)
    rel, _, routing, near = rounded_as_llama_cpp(load(DATA / f"moe_{name}.gguf"), g["ids"], want, monkeypatch)
    record_property("max_abs_over_range", rel)
    record_property("near_ties", near)
    assert rel <= EXACT, rel
    assert np.array_equal(routing["experts"], g["experts"])
    assert np.abs(routing["router_logits"] - g["router_logits"]).max() <= 1e-5
    assert np.abs(routing["expert_weights"] - g["expert_weights"]).max() <= 1e-5


@pytest.mark.parametrize("name", FILES)
def test_routing_matches_llama_cpp_far_from_ties(name, record_property):
    """The same experts in the same order for every token and block, the same weights, and every choice clear of a
    tie by several times the router-logit difference between juno-py and llama.cpp."""
    g = golden(name)
    _, routing = forward(load(DATA / f"moe_{name}.gguf"), g["ids"])
    n_layer, n_tokens, k = g["experts"].shape
    assert routing["experts"].shape == (n_layer, n_tokens, k) and k > 1
    assert np.array_equal(routing["experts"], g["experts"])
    difference = float(np.abs(routing["router_logits"] - g["router_logits"]).max())
    weights = float(np.abs(routing["expert_weights"] - g["expert_weights"]).max())
    ranked = -np.sort(-g["router_logits"].astype(np.float64), axis=-1)
    margin = float((ranked[..., k - 1] - ranked[..., k]).min())
    record_property("router_logit_difference", difference)
    record_property("smallest_margin", margin)
    assert margin >= MIN_MARGIN and margin >= MARGIN_OVER_DIFFERENCE * difference, (margin, difference)
    assert weights <= (0.02 if name in QUANTIZED else 1e-5), weights


@pytest.mark.parametrize("name", [n for n in MERGES if n not in QUANTIZED])
def test_llama_cpp_on_the_merged_file_equals_playback(name, record_property):
    """llama.cpp ran the file `juno-py merge --requant source` wrote from an F32 base and an adapter on attention, router
    and experts; juno-py plays the adapter back on the base. The merged tensors are base + s·B·A in float32, so the two
    agree to rounding."""
    g = golden(name)
    base = DATA / f"moe_{MERGES[name]}.gguf"
    want = g["logits"].astype(np.float64)
    played, routing = forward(load(base, DATA / f"moe_{name}.bin"), g["ids"])
    plain, _ = forward(load(base), g["ids"])
    rel = relative(played, want)
    record_property("max_abs_over_range", rel)
    assert relative(plain, want) > 0.05  # the adapter moves the logits by far more than the tolerance
    assert np.array_equal(routing["experts"], g["experts"])
    assert rel <= EXACT, rel


@pytest.mark.parametrize("name", [n for n in MERGES if n in QUANTIZED])
def test_llama_cpp_on_a_quantized_merge_keeps_the_adapters_effect(name, record_property):
    """A quantized base: the merge re-encoded the adapted blocks in their own types (Q4_0, Q4_1, Q5_1, Q8_0), so the
    merged weights hold base + s·B·A up to that quantization's error and llama.cpp's logits differ from playback's by
    it too (besides its activation rounding; that juno-py reads the merged file as llama.cpp does is checked above).
    Its logits still move from the base's to playback's: they lie far closer to playback's than the base's do."""
    g = golden(name)
    base = DATA / f"moe_{MERGES[name]}.gguf"
    want = g["logits"].astype(np.float64)
    played, routing = forward(load(base, DATA / f"moe_{name}.bin"), g["ids"])
    plain, _ = forward(load(base), g["ids"])
    effect = float(np.abs(played - plain).max())
    gap = float(np.abs(played - want).max())
    record_property("gap_over_effect", gap / effect)
    assert np.array_equal(routing["experts"], g["experts"])
    assert relative(plain, want) > 0.1 and gap <= 0.2 * effect, (gap, effect)


@pytest.mark.parametrize("name", list(MERGES))
def test_a_merge_made_here_gives_llama_cpps_logits(name, tmp_path, monkeypatch):
    """The merge of the committed base and adapter, read by juno-py, gives llama.cpp's logits on the committed merged
    file: a change in how a merge places or encodes the experts' rows would show here."""
    g = golden(name)
    merged = tmp_path / "merged.gguf"
    merge_model(DATA / f"moe_{MERGES[name]}.gguf", merged, [DATA / f"moe_{name}.bin"], requant="source")
    rel, _, routing, _ = rounded_as_llama_cpp(load(merged), g["ids"], g["logits"].astype(np.float64), monkeypatch)
    assert rel <= EXACT, rel
    assert np.array_equal(routing["experts"], g["experts"])
