"""Hand-run check that llama.cpp loads and runs what juno-py writes: merged GGUFs and GGUF-LoRA exports.

Needs llama-cpp-python (not a project dependency, not in CI); without it the script says so and exits 0.

    python tests/golden/check_llamacpp.py                    # tiny F32 models, then SmolLM2 and Gemma-3
    python tests/golden/check_llamacpp.py --tiny-only
    python tests/golden/check_llamacpp.py --adapter smollm2-135m=facts.bin --adapter gemma3-270m=g.bin

Tiny models are F32, so llama.cpp's CPU matmuls do not quantize activations and its logits must equal our
playback's to ~1e-5 (the KV cache is set to F32 too). Real models are quantized: llama.cpp rounds activations
to 8 bits inside its matmuls, so its logits differ from exact ones by ~1 %; there the check compares the
llama.cpp-vs-juno-py gap on the merged file (and on base + GGUF-LoRA) with the same gap on the untouched base.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

REAL_TEXT = (
    "The quick brown fox jumps over the lazy dog. In 1879, the first practical light bulb was shown in "
    "public; within a few decades electric light had changed how cities looked at night."
)


def llama_cpp_logits(model, ids, lora=None, n_ctx=256) -> np.ndarray:
    """llama.cpp's logits of every position (F32 KV cache, so only its matmuls differ from exact)."""
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(model),
        lora_path=str(lora) if lora else None,
        logits_all=True,
        verbose=False,
        n_ctx=n_ctx,
        type_k=0,
        type_v=0,
        n_threads=2,
    )
    llm.eval(list(ids))
    out = np.array(llm.scores[: len(ids)], dtype=np.float64)
    llm.close()
    return out


def compare_tiny(arch, targets, scaling, folder) -> dict:
    """Tiny F32 `arch` model, a random-B LoRA: llama.cpp on the merged file (requant f32) and on base + GGUF-LoRA
    against our playback. Returns max-abs differences and the adapter's effect on the logits."""
    from juno_py.exchange import export_gguf_lora
    from juno_py.gguf import GGMLType
    from juno_py.merge import merge_model
    from juno_py.testing.tiny_models import sample_ids, write_tiny_gguf
    from tests.merge.helpers import LLAMA_CPP_NAME, make_adapter, model_logits, playback_logits

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    base = write_tiny_gguf(folder / "base.gguf", arch, GGMLType.F32, metadata=LLAMA_CPP_NAME)
    adapter = make_adapter(base, folder / "a.bin", targets=targets, scaling=scaling, rank=4, alpha=8)
    merged = folder / "merged.gguf"
    merge_model(base, merged, [adapter], requant="f32")
    lora = export_gguf_lora(base, adapter, folder / "a.lora.gguf")
    ids = sample_ids(24)
    ours = playback_logits(base, adapter, ids).double().numpy()
    effect = float(np.abs(ours - model_logits(base, ids).double().numpy()).max())
    return {
        "arch": arch,
        "targets": targets,
        "scaling": scaling.name.lower(),
        "effect": effect,
        "merged_max_abs": float(np.abs(llama_cpp_logits(merged, ids) - ours).max()),
        "lora_max_abs": float(np.abs(llama_cpp_logits(base, ids, lora) - ours).max()),
    }


def _gap(a: np.ndarray, b: np.ndarray) -> dict:
    """max-abs, top-1 agreement and mean KL(a ‖ b) of two logit matrices."""
    la = a - np.logaddexp.reduce(a, axis=1, keepdims=True)
    lb = b - np.logaddexp.reduce(b, axis=1, keepdims=True)
    kl = float(np.mean(np.sum(np.exp(la) * (la - lb), axis=1)))
    return {"max_abs": float(np.abs(a - b).max()), "top1": float(np.mean(a.argmax(1) == b.argmax(1))), "kl": kl}


def compare_real(name, adapter, folder) -> dict:
    """A real model: llama.cpp vs juno-py on the base, on the merged file (source types) and on base + GGUF-LoRA."""
    from juno_py.exchange import export_gguf_lora
    from juno_py.lora import Mode, read_adapter
    from juno_py.merge import merge_model
    from juno_py.models import load_model
    from juno_py.store import resolve_model
    from tests.merge.helpers import make_adapter, model_logits, playback_logits

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    base = Path(resolve_model(name))
    if adapter is None:
        adapter = make_adapter(base, folder / "random.bin", targets="qv", rank=8, alpha=16, b_std=0.01)
    merged = folder / "merged.gguf"
    report = merge_model(base, merged, [adapter], requant="source")
    ids = load_model(base).tokenizer.encode(REAL_TEXT)
    ours_base = model_logits(base, ids).double().numpy()
    ours_merged = model_logits(merged, ids).double().numpy()
    ours_play = playback_logits(base, adapter, ids).double().numpy()
    out = {
        "model": name,
        "tokens": len(ids),
        "retention_mean": report.summary()["retention_mean"],
        "base": _gap(ours_base, llama_cpp_logits(base, ids)),
        "merged": _gap(ours_merged, llama_cpp_logits(merged, ids)),
        "adapter_effect_max_abs": float(np.abs(ours_play - ours_base).max()),
    }
    if not any(e.mode == Mode.DORA for e in read_adapter(adapter)[1]):
        lora = export_gguf_lora(base, adapter, folder / "a.lora.gguf")
        out["lora"] = _gap(ours_play, llama_cpp_logits(base, ids, lora))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny-only", action="store_true")
    ap.add_argument("--adapter", action="append", default=[], help="MODEL=adapter.bin for a real model")
    args = ap.parse_args(argv)
    try:
        import llama_cpp
    except ImportError:
        print("llama_cpp (llama-cpp-python) is not installed: nothing checked")
        return 0
    from juno_py.lora import Scaling

    print(f"llama-cpp-python {llama_cpp.__version__}")
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for arch, targets, scaling in [
            ("llama", "all", Scaling.STANDARD),
            ("llama", "all", Scaling.RSLORA),
            ("qwen2", "all", Scaling.STANDARD),
            ("phi3", "qv", Scaling.STANDARD),
            ("phi3", "all", Scaling.STANDARD),
        ]:
            r = compare_tiny(arch, targets, scaling, Path(tmp) / f"{arch}-{targets}-{scaling.name}")
            good = r["merged_max_abs"] <= 1e-3 and r["lora_max_abs"] <= 1e-3
            ok &= good
            print(
                f"tiny {arch:6s} {targets:4s} {r['scaling']:8s}: adapter effect {r['effect']:.3f}; llama.cpp vs "
                f"playback max-abs merged {r['merged_max_abs']:.2e}, GGUF-LoRA {r['lora_max_abs']:.2e}"
                f" {'ok' if good else 'FAIL'}"
            )
        if not args.tiny_only:
            given = dict(a.split("=", 1) for a in args.adapter)
            for name in ("smollm2-135m", "gemma3-270m"):
                r = compare_real(name, given.get(name), Path(tmp) / name)
                line = "; ".join(
                    f"{k}: max-abs {v['max_abs']:.3f}, top-1 {100 * v['top1']:.1f}%, KL {v['kl']:.2e}"
                    for k, v in r.items()
                    if isinstance(v, dict)
                )
                print(
                    f"{name} ({r['tokens']} tokens, retention {r['retention_mean']:.3f}, adapter effect "
                    f"{r['adapter_effect_max_abs']:.3f}): llama.cpp vs juno-py on {line}"
                )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
