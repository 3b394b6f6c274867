"""The playback GEMV compiled for a GPU without one: `gemv_kernel` (and `gemv_finish_kernel`) of each type and
config built by Triton for sm_90 (the H200) on this machine, with what the build says about speed: registers a
thread, spilled bytes, global load widths, layout conversions and the shared memory they take (a step whose values
go through shared memory between the weight words' layout and x's). A compile error shows here before a GPU run.

    python -m benchmarks.gemv_compile                       # the MATVEC_CONFIG table, bf16 x, 1 token
    python -m benchmarks.gemv_compile --types Q4_K --configs 4,2,4 8,2,8 --tokens 1 4 --lora 16

Needs triton (with its bundled ptxas); no GPU, no TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import warnings
from pathlib import Path


def build(kernel, signature: dict, constexprs: dict, warps: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    names = list(sig)
    pointers = [i for i, v in enumerate(sig.values()) if v.startswith("*")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in pointers}
    src = ASTSource(
        fn=kernel, signature=sig, constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs
    )
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))


def facts(compiled) -> dict:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    facts: dict = {}
    cubin = Path(os.environ.get("TMPDIR", "/tmp")) / "juno_gemv_compile.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    if tool.exists():
        out = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
        facts["registers"] = ",".join(re.findall(r"REG:(\d+)", out))
        facts["stack"] = ",".join(re.findall(r"STACK:(\d+)", out))
    ptx, ttgir = compiled.asm["ptx"], compiled.asm["ttgir"]
    facts["loads"] = dict(collections.Counter(re.findall(r"ld\.global[.\w]*", ptx)))
    facts["layout conversions"] = ttgir.count("convert_layout")
    facts["shared bytes"] = compiled.metadata.shared
    return facts


def gemv(t: int, br: int, kb: int, warps: int, tokens: int, lora: int, split: bool, xpack: bool) -> dict:
    from juno_py.kernels import matvec_triton as m
    from juno_py.kernels.dequant import GEMV_HW_ROUND, GEMV_MAGIC_CODES

    word = m.WORD_BYTES[t]
    xtype = ("*i64" if word == 4 else "*i32") if xpack else "*bf16"
    sig = dict(
        raw8_ptr="*u8",
        rw_ptr="*i32" if word == 4 else "*i16",
        x_ptr=xtype,
        y_ptr="*fp32" if split else "*i16",
        n_rows="i32",
        n_blk="i32",
        split_blk="i32",
        row_units="i32",
        x_stride="i32",
        y_stride="i32",
        xa_ptr="*bf16",
        lb_ptr="*bf16",
        alpha="fp32",
        rank="i32",
        xa_stride="i32",
        lb_stride="i32",
    )
    rp = max(2, 1 << (lora - 1).bit_length()) if lora else 0
    consts = dict(
        TYPE=t,
        B=m.BLOCK_VALUES[t],
        BLOCK_WORDS=m.BLOCK_WORDS[t],
        RA=16 // word,
        T=tokens,
        ROUND_BF16=True,
        OUT_BF16=True,
        PARTIAL=split,
        EVEN=True,
        MAGIC=GEMV_MAGIC_CODES,
        HW_ROUND=GEMV_HW_ROUND,
        NPART=m.PARTS[t],
        XI=word,
        XPACK=xpack,
        RP=0 if split else rp,
        BR=br,
        KB=kb,
    )
    return facts(build(m.gemv_kernel, sig, consts, warps))


def finish(split: int, lora: int) -> dict:
    from juno_py.kernels import matvec_triton as m

    sig = dict(
        part_ptr="*fp32",
        y_ptr="*i16",
        n_rows="i32",
        n="i32",
        y_stride="i32",
        xa_ptr="*bf16",
        lb_ptr="*bf16",
        alpha="fp32",
        rank="i32",
        xa_stride="i32",
        lb_stride="i32",
    )
    rp = max(2, 1 << (lora - 1).bit_length()) if lora else 0
    consts = dict(SPLIT=split, OUT_BF16=True, RP=rp, BLOCK=1024 // max(rp, 1))
    return facts(build(m.gemv_finish_kernel, sig, consts, 4))


def main() -> None:
    from juno_py.gguf import GGMLType
    from juno_py.kernels import dequant

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", nargs="*", default=[GGMLType(t).name for t in sorted(dequant.GEMV_TYPES)])
    ap.add_argument("--configs", nargs="*", default=[], help="BR,KB,WARPS (default: each type's MATVEC_CONFIG)")
    ap.add_argument("--tokens", nargs="*", type=int, default=[1])
    ap.add_argument("--lora", type=int, default=0, help="also a LoRA epilogue of this rank")
    ap.add_argument("--split", type=int, default=0, help="also the split-K pair with this many splits")
    ap.add_argument("--fp32-x", action="store_true", help="x as fp32 elements instead of packed bf16 words")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("gemv_compile.py builds real kernels: unset TRITON_INTERPRET")
    warnings.filterwarnings("ignore")
    for name in args.types:
        t = int(GGMLType[name])
        configs = [tuple(int(v) for v in c.split(",")) for c in args.configs] or [dequant.MATVEC_CONFIG[t][:3]]
        for br, kb, warps in configs:
            for tokens in args.tokens:
                f = gemv(t, br, kb, warps, tokens, args.lora, False, not args.fp32_x)
                print(f"{name} BR={br} KB={kb} warps={warps} T={tokens} lora={args.lora}: {f}", flush=True)
                if args.split:
                    f = gemv(t, br, kb, warps, tokens, 0, True, not args.fp32_x)
                    print(f"{name} BR={br} KB={kb} warps={warps} T={tokens} partial sums: {f}", flush=True)
    if args.split:
        print(f"finish SPLIT={args.split} lora={args.lora}: {finish(args.split, args.lora)}", flush=True)


if __name__ == "__main__":
    main()
