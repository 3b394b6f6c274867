"""Make the golden data under tests/golden/data from independent implementations (llama.cpp through
llama-cpp-python). Run by hand, never in CI; see tests/golden/README.md.

    python tests/golden/make_golden.py                  # every set
    python tests/golden/make_golden.py --only kquants   # one set
    python tests/golden/make_golden.py --report kquants # print the measurements quoted in docs/

Each golden set is one function `make_<set>(out_dir)`, listed in GOLDEN_SETS; a report is `report_<set>()`,
listed in REPORTS. Module-level code imports numpy and `juno_py.testing.ggml_reference` only, so tests may
import the input generators from here.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

import numpy as np

from juno_py.testing.ggml_reference import IQ4_TYPES, KQUANT_TYPES, WRITABLE_NEW_TYPES, ggml_quantize, load_ggml

DATA_DIR = Path(__file__).resolve().parent / "data"
MODELS = {"smollm2": "/tmp/models/smollm2-135m.gguf", "gemma3": "/tmp/models/gemma3-270m.gguf"}

QK_K = 256
KQUANT_TYPE_SIZES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


# ------------------------------------------------------------------------------------------ k-quant inputs


def kquant_edge_blocks() -> tuple[np.ndarray, list[str]]:
    """Hand-made 256-value blocks that walk the corners of the k-quant searches: [n, 256] float32, names."""
    rng = np.random.default_rng(20250301)
    g = lambda scale=1.0: (rng.standard_normal(QK_K) * scale).astype(np.float32)  # noqa: E731
    blocks: list[tuple[str, np.ndarray]] = []

    def add(name, values):
        blocks.append((name, np.asarray(values, dtype=np.float32).reshape(QK_K)))

    add("zeros", np.zeros(QK_K))
    add("negative_zeros", np.full(QK_K, -0.0))
    for c in (1.0, -2.5, 1e-20, -3e4, 7.0e-8):
        add(f"constant_{c:g}", np.full(QK_K, c))
    for big in (1e3, -1e3, 1e6, 6e4):
        for pos in (0, 17, 255):
            x = g(0.01)
            x[pos] = big
            add(f"outlier_{big:g}_at_{pos}", x)
    add("outlier_in_zeros", np.eye(1, QK_K, 100)[0] * 3.0)
    add("subnormal_random", g(1e-40))
    add("subnormal_min", np.where(np.arange(QK_K) % 3 == 0, np.float32(1.4e-45), 0.0))
    x = g(1.0)
    x[::2] = g(1e-39)[::2]
    add("subnormal_mixed_with_normal", x)
    add("subnormal_one_in_zeros", np.eye(1, QK_K, 5)[0] * np.float32(3e-41))
    for k in (16, 32):
        x = g(1.0).reshape(-1, k) * (10.0 ** np.linspace(-6, 3, QK_K // k))[:, None]
        add(f"magnitudes_across_sub_blocks_{k}", x)
        x = g(1.0).reshape(-1, k) * (10.0 ** np.linspace(3, -6, QK_K // k))[:, None]
        add(f"magnitudes_across_sub_blocks_{k}_descending", x)
    add("positive_only", np.abs(g()))
    add("negative_only", -np.abs(g()))
    add("positive_offset", 10.0 + np.abs(g(0.1)))
    add("negative_offset", -10.0 - np.abs(g(0.1)))
    for s in (1e-10, 1e-15, 3e-16, 1e-16, 1e-30):
        add(f"tiny_{s:g}", g(s))
    for k in (16, 32):
        # one sub-block far smaller than the others: its 6-bit (or 4-bit) scale and min round to 0
        x = g(1.0).reshape(-1, k)
        x[3] *= 1e-4
        x[-1] = 0.0
        add(f"sub_block_scale_rounds_to_zero_{k}", x)
        x = g(1.0).reshape(-1, k)
        x[::2] *= 1e-3
        add(f"alternate_sub_blocks_small_{k}", x)
        x = np.abs(g(1.0)).reshape(-1, k) + 5.0
        x[1] = -np.abs(x[1]) - 20.0
        add(f"min_dominates_{k}", x)
        x = np.tile(np.arange(k, dtype=np.float32), QK_K // k)
        add(f"ramp_{k}", x)
        add(f"ramp_{k}_negative", -x - 1)
        x = np.repeat(g(1.0)[: QK_K // k], k)
        add(f"flat_sub_blocks_{k}", x)
    add("uniform_full_range", np.linspace(-1, 1, QK_K))
    add("uniform_positive", np.linspace(0, 1, QK_K))
    add("integers", np.round(g(4.0)))
    add("half_integers", np.round(g(4.0)) + 0.5)
    add("levels_q4", (np.arange(QK_K) % 16) * 0.25 - 1.0)
    add("levels_q6", (np.arange(QK_K) % 64 - 32) * 0.125)
    x = np.zeros(QK_K)
    x[::16] = 1.0
    x[8::16] = -1.0
    add("same_magnitude_both_signs", x)
    x = np.zeros(QK_K)
    x[::16] = -1.0
    x[8::16] = 1.0
    add("same_magnitude_both_signs_negative_first", x)
    add("alternating_signs", np.where(np.arange(QK_K) % 2, 1.0, -1.0) * np.abs(g()))
    x = np.zeros(QK_K)
    x[rng.choice(QK_K, 5, replace=False)] = g()[:5]
    add("sparse", x)
    add("large_1e18", g(1e18))  # x*x*x overflows: the sums go inf/NaN and the C comparisons skip them
    add("huge_1e30", g(1e30))
    add("huge_3e37", g(3e37))
    x = g(1.0)
    x[3], x[7] = 3e38, -3e38  # max - min overflows
    add("extremes_pm_3e38", x)
    add("max_range_alternating", np.where(np.arange(QK_K) % 2, 3.4e38, -3.4e38))
    add("large_3e4", g(3e4))
    add("fp16_overflow_scale", g(1e6))
    add("fp16_underflow_scale", g(1e-6))
    x = g(1.0)
    x[1::2] = x[::2]
    add("pairs", x)
    add("two_values", np.where(rng.random(QK_K) < 0.5, 0.3, -0.7))
    for i in range(4):
        add(f"heavy_tailed_{i}", rng.standard_cauchy(QK_K) * 0.1)
    names = [n for n, _ in blocks]
    return np.stack([b for _, b in blocks]).astype(np.float32), names


def _splitmix64(counter: np.ndarray) -> np.ndarray:
    z = counter + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _uniform(seed: int, n: int) -> np.ndarray:
    """Uniform [0, 1) float64 from a counter hash: the same bits on every platform and numpy version."""
    with np.errstate(over="ignore"):
        counter = np.arange(n, dtype=np.uint64) + np.uint64(seed) * np.uint64(1 << 40)
        return (_splitmix64(counter) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def kquant_random_blocks(kind: str, n_blocks: int) -> np.ndarray:
    """Random blocks [n_blocks, 256] float32 built with + - * / only (no libm, no numpy Generator), so a test
    regenerates exactly what the golden bytes were made from. Kinds: normal_1e-3, normal_1, normal_1e3
    (Irwin-Hall sums of 4 uniforms, about Gaussian) and heavy (a Gaussian over a uniform: power-law tails)."""
    n = n_blocks * QK_K
    seed = {"normal_1e-3": 1, "normal_1": 2, "normal_1e3": 3, "heavy": 4}[kind]
    u = _uniform(seed, 5 * n).reshape(5, n)
    gauss = (u[0] + u[1] + u[2] + u[3] - 2.0) * 1.7320508075688772
    if kind == "heavy":
        values = gauss * 0.02 / (u[4] + 0.002)
    else:
        values = gauss * float(kind.split("_")[1])
    return values.astype(np.float32).reshape(n_blocks, QK_K)


KQUANT_RANDOM_KINDS = ("normal_1e-3", "normal_1", "normal_1e3", "heavy")
KQUANT_RANDOM_BLOCKS = 256  # per kind


def kquant_random_set() -> np.ndarray:
    return np.concatenate([kquant_random_blocks(k, KQUANT_RANDOM_BLOCKS) for k in KQUANT_RANDOM_KINDS])


def array_digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


# tensors whose dequantized rows feed the "real" k-quant set: (model, tensor, blocks taken)
KQUANT_REAL_TENSORS = [
    ("gemma3", "blk.2.attn_output.weight", 128),  # Q4_K
    ("gemma3", "blk.5.ffn_down.weight", 128),  # Q6_K
    ("gemma3", "blk.7.ffn_gate.weight", 128),  # Q5_0, rows of 640 flattened
    ("gemma3", "blk.9.attn_v.weight", 128),  # Q8_0
    ("gemma3", "token_embd.weight", 128),  # Q8_0
    ("smollm2", "blk.3.ffn_down.weight", 128),  # Q4_1, rows of 1536
    ("smollm2", "blk.11.attn_q.weight", 128),  # Q4_1, rows of 576 flattened
    ("smollm2", "token_embd.weight", 128),  # Q8_0
]


def read_tensor(model: str, name: str):
    import gguf

    reader = gguf.GGUFReader(MODELS[model])
    for t in reader.tensors:
        if t.name == name:
            return t
    raise KeyError(f"{name} not in {MODELS[model]}")


def dequantized_blocks(model: str, name: str, n_blocks: int) -> np.ndarray:
    """`n_blocks` 256-value blocks of a tensor dequantized with the gguf package: whole rows spread evenly over
    the tensor, flattened (rows of 576 or 640 values straddle blocks, as a merge of such a tensor would not,
    but the values are the model's)."""
    import gguf

    t = read_tensor(model, name)
    raw = np.asarray(t.data)
    n_cols = int(t.shape[0])
    n_rows = min(len(raw), -(-n_blocks * QK_K // n_cols))
    rows = raw[np.linspace(0, len(raw) - 1, n_rows).astype(np.int64)]
    values = gguf.quants.dequantize(rows, t.tensor_type).astype(np.float32).reshape(-1)
    return np.ascontiguousarray(values[: n_blocks * QK_K].reshape(-1, QK_K))


# ----------------------------------------------------------------------------------------------- the sets


def make_kquants(out_dir: Path) -> None:
    """kquants_inputs.npz (edge and real-model blocks, the digest of the random blocks) and one
    kquants_<type>.npz per k-quant type with llama.cpp's bytes for each set."""
    lib = load_ggml()
    edge, edge_names = kquant_edge_blocks()
    random = kquant_random_set()
    real_parts = [dequantized_blocks(m, t, n) for m, t, n in KQUANT_REAL_TENSORS]
    real = np.concatenate(real_parts)
    real_sources = [f"{m}:{t}" for m, t, n in KQUANT_REAL_TENSORS for _ in range(n)]
    np.savez_compressed(
        out_dir / "kquants_inputs.npz",
        edge=edge,
        edge_names=np.array(edge_names),
        real=real,
        real_sources=np.array(real_sources),
        random_kinds=np.array(KQUANT_RANDOM_KINDS),
        random_blocks=KQUANT_RANDOM_BLOCKS,
        random_sha256=array_digest(random),
    )
    for name, ggml_type in KQUANT_TYPES.items():
        sets = {s: ggml_quantize(lib, ggml_type, x) for s, x in (("edge", edge), ("random", random), ("real", real))}
        np.savez_compressed(out_dir / f"kquants_{name}.npz", **sets)
        print(f"kquants_{name}.npz: " + ", ".join(f"{s} {v.shape}" for s, v in sets.items()))


def iq4_inputs() -> dict[str, np.ndarray]:
    """The inputs of the iq4 set, [n, 256] float32: the edge and real-model blocks of the kquants set (from
    kquants_inputs.npz) and its regenerated random blocks. IQ4_NL encodes each as 8 blocks of 32."""
    data = np.load(DATA_DIR / "kquants_inputs.npz")
    random = kquant_random_set()
    assert array_digest(random) == str(data["random_sha256"]), "the random blocks differ from kquants_inputs.npz"
    return {"edge": data["edge"], "random": random, "real": data["real"]}


def make_iq4(out_dir: Path) -> None:
    """iq4_<type>.npz per IQ4 type: llama.cpp's bytes (`ggml_quantize_chunk`, no imatrix) for each input set of
    the kquants set, uint8 [blocks, type_size] with IQ4_NL blocks of 32 values in row order."""
    lib = load_ggml()
    for name, ggml_type in IQ4_TYPES.items():
        block = 32 if name == "IQ4_NL" else QK_K
        sets = {s: ggml_quantize(lib, ggml_type, x.reshape(-1, block)) for s, x in iq4_inputs().items()}
        np.savez_compressed(out_dir / f"iq4_{name}.npz", **sets)
        print(f"iq4_{name}.npz: " + ", ".join(f"{s} {v.shape}" for s, v in sets.items()))


def make_newtypes(out_dir: Path) -> None:
    """newtypes_<type>.npz per type of WRITABLE_NEW_TYPES: llama.cpp's bytes (`ggml_quantize_chunk`, no imatrix) for
    each input set of the kquants set, uint8 [rows of 256 values, row bytes] (MXFP4: 8 blocks of 32 a row), the
    blocks tests/gguf/test_quants_llama_written.py decodes. IQ3_XXS and IQ3_S leave out the edge set: llama.cpp's
    quantizer aborts on some of its blocks (`GGML_ASSERT(grid_index >= 0)`)."""
    lib = load_ggml()
    for name, ggml_type in WRITABLE_NEW_TYPES.items():
        inputs = {s: x for s, x in iq4_inputs().items() if not (s == "edge" and name.startswith("IQ3"))}
        sets = {s: ggml_quantize(lib, ggml_type, x) for s, x in inputs.items()}
        np.savez_compressed(out_dir / f"newtypes_{name}.npz", **sets)
        print(f"newtypes_{name}.npz: " + ", ".join(f"{s} {v.shape}" for s, v in sets.items()))


GOLDEN_SETS = {"kquants": make_kquants, "iq4": make_iq4, "newtypes": make_newtypes}


def make_tokenization(out_dir: Path) -> None:
    """tokenization_smollm2.json, tokenization_gemma3.json, tokenization_variants.json: llama.cpp's token
    ids, detokenization and end-of-generation ids (the generator lives in golden_tokenization.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import golden_tokenization

    golden_tokenization.make(out_dir)


GOLDEN_SETS["tokenization"] = make_tokenization


# ---------------------------------------------------------------------------------------------- the moe set

# the token ids every moe file is evaluated on (no tokenization: llama.cpp and juno-py both take the ids)
MOE_IDS = (219, 23, 48, 64, 49, 217, 235, 157, 10, 25, 90, 117, 168, 129, 71, 43)
MOE_N_CTX = 64
# the smallest router gap allowed between the k-th and the (k+1)-th expert of any token and block (in router logits)
MOE_MIN_MARGIN = 0.05

_MOE_SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
# gpt-oss's YaRN: head size 8, base 1e7, factor 4 over 15000 original positions puts the correction range at
# 1.07..1.93 dimensions, between two whole numbers, so juno-py's unrounded ramp (the checkpoints' `truncate: false`)
# and llama.cpp's, rounded outwards to 1..2, give every pair the same frequency (pairs 0-1 kept, 2-3 divided by 4)
_MOE_YARN = dict(
    rope_type="yarn",
    rope_theta=1.0e7,
    factor=4.0,
    beta_fast=32.0,
    beta_slow=1.0,
    truncate=False,
    original_max_position_embeddings=15000,
)
_ATTN_Q8 = [("blk.*.attn_*.weight", "Q8_0"), ("output.weight", "Q8_0"), ("token_embd.weight", "Q8_0")]

# name -> the tiny architecture (`juno_py.testing.tiny_models.TINY_CONFIGS`), the seed of its random weights, config
# overrides, and the types of its 2-D and 3-D weights as (fnmatch pattern, type), first match (else F32; norms,
# biases, sinks and the router `ffn_gate_inp` are always F32, as llama.cpp's quantizer leaves them). The _f32 files
# hold F32 weights only: llama.cpp's matmuls then take F32 activations. The _quant files' experts are quantized
# (types of both activation paths: q8_0/q8_1 for Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 MXFP4, q8_K for Q4_K and Q6_K, whose
# 256-value rows need n_ff_exp 256).
MOE_MODELS: dict[str, dict] = {
    "qwen3moe_f32": dict(
        arch="qwen3moe",
        seed=144,
        tied=True,
        config={
            **_MOE_SMALL,
            "intermediate_size": 16,
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 8,
        },
        types=[],
    ),
    "qwen3moe_quant": dict(
        arch="qwen3moe",
        seed=112,
        config={
            **_MOE_SMALL,
            "intermediate_size": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 256,
        },
        types=_ATTN_Q8
        + [
            ("blk.0.ffn_gate_exps.weight", "Q8_0"),
            ("blk.0.ffn_up_exps.weight", "Q4_0"),
            ("blk.0.ffn_down_exps.weight", "Q4_K"),
            ("blk.1.ffn_gate_exps.weight", "Q4_1"),
            ("blk.1.ffn_up_exps.weight", "Q5_0"),
            ("blk.1.ffn_down_exps.weight", "Q6_K"),
        ],
    ),
    "mixtral_f32": dict(
        arch="mixtral",
        seed=35,
        tied=True,
        config={**_MOE_SMALL, "intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2},
        types=[],
    ),
    "mixtral_quant": dict(
        arch="mixtral",
        seed=285,
        config={**_MOE_SMALL, "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2},
        types=_ATTN_Q8
        + [
            ("blk.0.ffn_gate_exps.weight", "Q8_0"),
            ("blk.0.ffn_up_exps.weight", "Q4_0"),
            ("blk.0.ffn_down_exps.weight", "Q5_1"),
            ("blk.1.ffn_gate_exps.weight", "Q4_1"),
            ("blk.1.ffn_*_exps.weight", "Q8_0"),
        ],
    ),
    "gpt_oss_f32": dict(
        arch="gpt-oss",
        seed=35,
        config={
            **_MOE_SMALL,
            "intermediate_size": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 4,
            "rope_parameters": _MOE_YARN,
            "max_position_embeddings": 60000,
        },
        types=[],
    ),
    "gpt_oss_quant": dict(
        arch="gpt-oss",
        seed=154,
        config={
            **_MOE_SMALL,
            "intermediate_size": 32,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 4,
            "rope_parameters": _MOE_YARN,
            "max_position_embeddings": 60000,
        },
        types=_ATTN_Q8 + [("blk.*.ffn_*_exps.weight", "MXFP4")],
    ),
}


def moe_tensor_type(name: str, shape: tuple[int, ...], types: list[tuple[str, str]]) -> str:
    """The type a moe file stores tensor `name` as: the first matching pattern's, else F32; 1-D tensors, biases and
    the router always F32."""
    from fnmatch import fnmatchcase

    if len(shape) < 2 or name.endswith(".bias") or "ffn_gate_inp" in name:
        return "F32"
    return next((t for pattern, t in types if fnmatchcase(name, pattern)), "F32")


def write_moe_model(path: Path, name: str) -> Path:
    """The moe file `name` of MOE_MODELS at `path`: a random transformers model converted as llama.cpp's converter
    does (`juno_py.testing.tiny_models`), its tensors encoded with juno-py's encoders as the spec's types say."""
    from juno_py.gguf import GGMLType, GGUFWriter
    from juno_py.gguf.quants import quantize
    from juno_py.testing.tiny_models import gguf_metadata, gguf_tensors, hf_tiny_model, item_type

    spec = MOE_MODELS[name]
    model = hf_tiny_model(spec["arch"], spec["seed"], spec["config"])
    tensors = gguf_tensors(spec["arch"], model)
    if spec.get("tied"):  # the output projection is the embedding (llama.cpp and juno-py fall back to it)
        tensors.pop("output.weight")
    with GGUFWriter(path) as w:
        for key, value, vtype in gguf_metadata(spec["arch"], model):
            w.add_field(key, value, vtype, item_type(key))
        w.add_field("general.name", f"golden-moe-{name}")
        for tname, t in tensors.items():
            t = t.detach().float().contiguous()
            qtype = GGMLType[moe_tensor_type(tname, tuple(t.shape), spec["types"])]
            w.add_tensor(tname, quantize(qtype, t.reshape(-1, t.shape[-1])), qtype, tuple(t.shape))
    return path


# llama.cpp's names of the routing tensors build_moe_ffn computes, per block: router logits, chosen experts, weights
# (first name found wins). gpt-oss's router has a bias: the logits it ranks are `ffn_moe_logits + ffn_gate_inp.bias`,
# which this llama.cpp names ffn_moe_probs (its SOFTMAX_WEIGHT gating applies no function before the top k);
# `biased_router` reads those
_ROUTING_TENSORS = {
    "router_logits": ("ffn_moe_logits-{}",),
    "experts": ("ffn_moe_topk-{}",),
    "expert_weights": ("ffn_moe_weights_softmax-{}", "ffn_moe_weights_norm-{}"),
}
_BIASED_ROUTER_LOGITS = ("ffn_moe_logits_biased-{}", "ffn_moe_probs-{}")


def llama_cpp_moe_run(
    path: Path, ids, capture: bool = False, biased_router: bool = False, flash_attn: bool = False
) -> dict[str, np.ndarray]:
    """llama.cpp's logits of every position of `ids` (one batch, CPU, F32 KV cache, no flash attention unless asked:
    as `llama_cpp.Llama(..., logits_all=True, type_k=0, type_v=0)` runs), float32 `[T, n_vocab]`. `capture`: also
    the routing of every block, read through the scheduler's eval callback: router logits `[L, T, n_expert]`,
    chosen experts `[L, T, k]` (largest first) and their weights `[L, T, k]`."""
    import ctypes

    import llama_cpp as L
    from llama_cpp import _logger

    _logger.set_verbose(False)
    ggml = load_ggml()
    ggml.ggml_get_name.restype = ctypes.c_char_p
    ggml.ggml_get_name.argtypes = [ctypes.c_void_p]
    ggml.ggml_get_data.restype = ctypes.c_void_p
    ggml.ggml_get_data.argtypes = [ctypes.c_void_p]
    wanted: dict[str, tuple[str, int]] = {}
    got: dict[str, np.ndarray] = {}

    def read(t) -> np.ndarray:
        # struct ggml_tensor: type (int32) at 0, ne[4] (int64) at 16, nb[4] (size_t) at 48
        ggml_type = ctypes.c_int32.from_address(t).value
        ne = list((ctypes.c_int64 * 4).from_address(t + 16))
        nb = list((ctypes.c_size_t * 4).from_address(t + 48))
        dtype = {0: np.float32, 26: np.int32}[ggml_type]
        size = sum((n - 1) * b for n, b in zip(ne, nb)) + np.dtype(dtype).itemsize
        buf = (ctypes.c_char * size).from_address(ggml.ggml_get_data(t))
        a = np.ndarray(tuple(reversed(ne)), dtype, buffer=buf, strides=tuple(reversed(nb)))
        return np.array(a)  # copied: the scheduler reuses the memory

    def callback(t, ask, _user):
        name = ggml.ggml_get_name(t).decode()
        if ask:
            return name in wanted
        got[name] = read(t)
        return True

    L.llama_backend_init()
    mp = L.llama_model_default_params()
    # no extra buffer types: weights stay in ggml's own layout (no repacking into interleaved blocks, no AMX tiles,
    # whose instructions this machine's kernel refuses: tilezero raises SIGILL)
    mp.use_extra_bufts = False
    model = L.llama_model_load_from_file(str(path).encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp cannot load {path}")
    n_layer = L.llama_model_n_layer(model)
    routing = dict(_ROUTING_TENSORS, router_logits=_BIASED_ROUTER_LOGITS) if biased_router else _ROUTING_TENSORS
    if capture:
        wanted.update((n.format(il), (key, il)) for il in range(n_layer) for key, ns in routing.items() for n in ns)
    cp = L.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = MOE_N_CTX
    cp.type_k = cp.type_v = 0  # F32 KV cache
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.n_threads = cp.n_threads_batch = 2
    keep = L.ggml_backend_sched_eval_callback(callback)
    if capture:
        cp.cb_eval = keep
    ctx = L.llama_init_from_model(model, cp)
    batch = L.llama_batch_init(len(ids), 0, 1)
    try:
        for i, token in enumerate(ids):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, i, 1, 1
            batch.seq_id[i][0] = 0
        batch.n_tokens = len(ids)
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError(f"llama_decode failed on {path}")
        n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        logits = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(len(ids) * n_vocab,))
        out = {"logits": np.array(logits, dtype=np.float32).reshape(len(ids), n_vocab)}
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(model)
    if capture:
        for key, names in routing.items():
            per_layer = []
            for il in range(n_layer):
                found = [got[n.format(il)] for n in names if n.format(il) in got]
                if not found:
                    raise RuntimeError(f"llama.cpp computed none of {names} for block {il} of {path}: {sorted(got)}")
                per_layer.append(found[0].reshape(len(ids), -1))  # the first name llama.cpp computed
            out[key] = np.stack(per_layer)
    return out


# merges: name -> the base (a MOE_MODELS name), the adapter's targets and expert layout, and its random factors
# (rank 2, alpha 4, A from `seed`, B ~ N(0, b_std²)); `juno-py merge --requant source` writes the merged file
MOE_MERGES: dict[str, dict] = {
    # F32 base: the merged tensors are F32, so llama.cpp's logits must equal juno-py's playback of base + adapter
    "qwen3moe_f32_merged": dict(base="qwen3moe_f32", targets="all,router", experts="per-expert", seed=33, b_std=0.2),
    # quantized base: the adapted experts' and attention's changed blocks re-encoded in their own types
    "mixtral_quant_merged": dict(base="mixtral_quant", targets="all", experts="shared", seed=67, b_std=0.2),
}


def write_moe_adapter(path: Path, base: Path, spec: dict) -> Path:
    """A random-B adapter of the merge `spec` on the model at `base`, saved as adapter.bin at `path`."""
    import torch

    from juno_py.lora import attach
    from juno_py.models import load_model

    model = load_model(base)
    aset = attach(model, spec["targets"], rank=2, alpha=4.0, seed=spec["seed"], experts=spec["experts"])
    g = torch.Generator().manual_seed(spec["seed"])
    with torch.no_grad():
        for ad in aset.adapters.values():
            ad.lora_B.normal_(0, spec["b_std"], generator=g)
    return aset.save(path)


def juno_merge(base: Path, adapter: Path, out: Path) -> Path:
    """`juno-py merge --requant source`, as a user runs it."""
    import subprocess

    cmd = [sys.executable, "-m", "juno_py", "merge", "--model-path", str(base), "--adapter", str(adapter)]
    cmd += ["--output", str(out), "--requant", "source", "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=str(Path(__file__).resolve().parents[2]))
    if done.returncode != 0:
        raise SystemExit(f"juno-py merge failed:\n{done.stderr}")
    return out


def _save_llama_cpp_moe(npz: Path, gguf: Path, arch: str) -> None:
    """llama.cpp's logits and routing of MOE_IDS on `gguf`, as float32 (experts int32) arrays in `npz`."""
    plain = llama_cpp_moe_run(gguf, MOE_IDS)
    run = llama_cpp_moe_run(gguf, MOE_IDS, capture=True, biased_router=arch == "gpt-oss")
    # reading the routing splits the graph where the callback looks: the logits must not change
    assert np.array_equal(plain["logits"], run["logits"]), f"{gguf}: the logits change when the routing is read"
    k = run["experts"].shape[-1]
    ranked = -np.sort(-run["router_logits"], axis=-1)
    margin = float((ranked[..., k - 1] - ranked[..., k]).min())
    np.savez_compressed(
        npz,
        ids=np.array(MOE_IDS, np.int32),
        logits=plain["logits"].astype(np.float32),
        router_logits=run["router_logits"].astype(np.float32),
        experts=run["experts"].astype(np.int32),
        expert_weights=run["expert_weights"].astype(np.float32),
    )
    lg = plain["logits"]
    print(
        f"{npz.name}: logits {lg.shape} range {lg.max() - lg.min():.3f}, routing {run['experts'].shape}, "
        f"smallest gap between the k-th and (k+1)-th router logit {margin:.4f}"
    )
    if margin < MOE_MIN_MARGIN:
        raise SystemExit(f"{gguf}: a routing near-tie ({margin:.4f} < {MOE_MIN_MARGIN}): pick another seed")


def make_moe(out_dir: Path) -> None:
    """moe_<name>.gguf for each of MOE_MODELS (written by juno-py's writer and encoders) with moe_<name>.npz, llama.cpp's
    logits and routing of MOE_IDS; for each of MOE_MERGES the adapter moe_<name>.bin, the merged moe_<name>.gguf and
    llama.cpp's moe_<name>.npz on it."""
    for name, spec in MOE_MODELS.items():
        gguf = write_moe_model(out_dir / f"moe_{name}.gguf", name)
        _save_llama_cpp_moe(out_dir / f"moe_{name}.npz", gguf, spec["arch"])
    for name, spec in MOE_MERGES.items():
        base = out_dir / f"moe_{spec['base']}.gguf"
        adapter = write_moe_adapter(out_dir / f"moe_{name}.bin", base, spec)
        merged = juno_merge(base, adapter, out_dir / f"moe_{name}.gguf")
        _save_llama_cpp_moe(out_dir / f"moe_{name}.npz", merged, MOE_MODELS[spec["base"]]["arch"])


GOLDEN_SETS["moe"] = make_moe


# ------------------------------------------------------------------------------------------------ reports


def _requantization_changes(lib, t, quantize_rows, rows_per_chunk: int = 8192) -> tuple[int, int]:
    """Blocks of tensor `t` whose bytes change when its dequantized rows are quantized again: (changed, total)."""
    import gguf

    raw = np.asarray(t.data)
    n_cols = int(t.shape[0])
    block_size, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
    changed = 0
    for start in range(0, len(raw), rows_per_chunk):
        rows = raw[start : start + rows_per_chunk]
        values = gguf.quants.dequantize(rows, t.tensor_type).reshape(-1, n_cols).astype(np.float32)
        again = quantize_rows(int(t.tensor_type), values)
        changed += int((rows.reshape(-1, type_size) != again.reshape(-1, type_size)).any(1).sum())
    return changed, raw.size // type_size


def report_kquants() -> None:
    """Measurements quoted in docs/quantization.md: blocks that change when a real file is re-encoded, the
    agreement of juno-py with llama.cpp on large samples, and the round-trip RMSE on Gaussian data."""
    import gguf
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from juno_py.gguf.quants import dequantize, quantize

    lib = load_ggml()
    encoders = {
        "llama.cpp": lambda ggml_type, x: ggml_quantize(lib, ggml_type, x),
        "juno-py": lambda ggml_type, x: quantize(ggml_type, torch.from_numpy(x)),
    }
    print("## blocks that change when the dequantized data of a real file is quantized again (no imatrix)")
    for model, path in MODELS.items():
        by_type: dict[str, list] = {}
        for t in gguf.GGUFReader(path).tensors:
            if t.tensor_type.name in ("Q4_K", "Q6_K", "Q5_0", "Q8_0", "Q4_1"):
                by_type.setdefault(t.tensor_type.name, []).append(t)
        for type_name, tensors in sorted(by_type.items()):
            line = []
            for who, encode in encoders.items():
                counts = [_requantization_changes(lib, t, encode) for t in tensors]
                changed, total = sum(c for c, _ in counts), sum(n for _, n in counts)
                line.append(f"{who} {changed / total:.4%}")
            print(f"{model} {type_name} ({len(tensors)} tensors, {total} blocks): " + ", ".join(line))

    print("\n## agreement of juno-py with llama.cpp (fraction of byte-identical blocks)")
    samples = {kind: kquant_random_blocks(kind, 16384) for kind in KQUANT_RANDOM_KINDS}
    samples["real"] = np.concatenate([dequantized_blocks(m, t, 4096) for m, t, _ in KQUANT_REAL_TENSORS])
    samples["edge"] = kquant_edge_blocks()[0]
    for name, ggml_type in KQUANT_TYPES.items():
        parts = []
        for kind, x in samples.items():
            same = (encoders["juno-py"](ggml_type, x) == ggml_quantize(lib, ggml_type, x)).all(1)
            parts.append(f"{kind} {same.mean():.6f} of {len(x)}")
        print(f"{name}: " + ", ".join(parts))

    print("\n## RMSE of quantize -> dequantize, N(0, 1) data, 16384 blocks")
    x = np.random.default_rng(0).standard_normal((16384, QK_K)).astype(np.float32)
    for name, ggml_type in KQUANT_TYPES.items():
        back = dequantize(ggml_type, quantize(ggml_type, torch.from_numpy(x)), QK_K).numpy()
        print(f"{name}: rmse {np.sqrt(np.mean((back - x) ** 2.0)):.5f}, max abs error {np.abs(back - x).max():.4f}")


def report_iq4() -> None:
    """Agreement of juno-py's IQ4 encoders with llama.cpp on large samples (fraction of byte-identical blocks)."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from juno_py.gguf.quants import quantize

    lib = load_ggml()
    samples = {kind: kquant_random_blocks(kind, 16384) for kind in KQUANT_RANDOM_KINDS}
    samples.update(iq4_inputs())
    if all(Path(p).exists() for p in MODELS.values()):
        samples["real"] = np.concatenate([dequantized_blocks(m, t, 4096) for m, t, _ in KQUANT_REAL_TENSORS])
    for name, ggml_type in IQ4_TYPES.items():
        block = 32 if name == "IQ4_NL" else QK_K
        parts = []
        for kind, x in samples.items():
            x = x.reshape(-1, block)
            same = (quantize(ggml_type, torch.from_numpy(x)) == ggml_quantize(lib, ggml_type, x)).all(1)
            parts.append(f"{kind} {same.mean():.6f} of {len(x)}")
        print(f"{name}: " + ", ".join(parts))


def report_moe() -> None:
    """Measurements quoted in tests/golden/README.md and docs/: for each committed moe file, juno-py's logits and
    router logits against llama.cpp's (stored, and llama.cpp run again: with flash attention, and through
    `llama_cpp.Llama` for the F32 files); then gpt-oss's YaRN on the tiny test configuration, where the correction
    range falls between whole dimensions, against llama.cpp with and without its rounding of that range."""
    import dataclasses
    import tempfile

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import juno_py.models.config as config
    from juno_py.models import load_model
    from juno_py.testing.tiny_models import write_tiny_gguf

    def rel(a, b) -> float:
        return float(np.abs(np.asarray(a, np.float64) - b).max() / (b.max() - b.min()))

    def juno_logits(path) -> np.ndarray:
        with torch.no_grad():
            return load_model(path).logits(list(MOE_IDS)).double().numpy()

    print("## juno-py (fp32) against llama.cpp: max |Δ| / range of llama.cpp's logits")
    arch_of = {n: s["arch"] for n, s in MOE_MODELS.items()}
    arch_of.update({n: MOE_MODELS[s["base"]]["arch"] for n, s in MOE_MERGES.items()})
    for name, arch in arch_of.items():
        gguf, stored = DATA_DIR / f"moe_{name}.gguf", np.load(DATA_DIR / f"moe_{name}.npz")
        want = stored["logits"].astype(np.float64)
        again = llama_cpp_moe_run(gguf, MOE_IDS)["logits"]
        fa = llama_cpp_moe_run(gguf, MOE_IDS, flash_attn=True)["logits"]
        parts = [f"juno-py {rel(juno_logits(gguf), want):.3g}", f"llama.cpp again {rel(again, want):.3g}"]
        parts.append(f"llama.cpp with flash attention {rel(fa, want):.3g}")
        if "_f32" in name and "_quant" not in name:
            import llama_cpp

            llm = llama_cpp.Llama(str(gguf), logits_all=True, n_ctx=MOE_N_CTX, type_k=0, type_v=0, verbose=False)
            llm.eval(list(MOE_IDS))
            parts.append(f"llama_cpp.Llama {rel(np.array(llm.scores[: len(MOE_IDS)]), want):.3g}")
            llm.close()
        print(f"{name} ({arch}): " + ", ".join(parts))

    print("\n## gpt-oss YaRN on the tiny test configuration (head 16, base 1e4, factor 4, 32 original positions)")
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_gguf(Path(tmp) / "gpt-oss.gguf", "gpt-oss")
        want = llama_cpp_moe_run(path, MOE_IDS)["logits"].astype(np.float64)
        spec = config.ARCHITECTURES["gpt-oss"]
        try:
            for truncate in (False, True):
                config.ARCHITECTURES["gpt-oss"] = dataclasses.replace(spec, yarn_truncate=truncate)
                how = "rounded outwards as llama.cpp does" if truncate else "unrounded (juno-py's gpt-oss)"
                print(f"correction range {how}: max |Δ| / range {rel(juno_logits(path), want):.3g}")
        finally:
            config.ARCHITECTURES["gpt-oss"] = spec


REPORTS = {"kquants": report_kquants, "iq4": report_iq4, "moe": report_moe}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", choices=sorted(GOLDEN_SETS), help="make only this set (repeatable)")
    parser.add_argument("--report", choices=sorted(REPORTS), help="print a measurement report instead")
    parser.add_argument("--out", type=Path, default=DATA_DIR)
    args = parser.parse_args()
    if args.report:
        REPORTS[args.report]()
        return
    os.makedirs(args.out, exist_ok=True)
    for name in args.only or sorted(GOLDEN_SETS):
        print(f"== {name}")
        GOLDEN_SETS[name](args.out)


if __name__ == "__main__":
    main()
