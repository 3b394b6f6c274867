"""The one rule behind `--compute-dtype auto` and `--weights-cache auto`, from the facts passed as arguments."""

from __future__ import annotations

import pytest
import torch

from juno_py.precision import CACHE_LIMIT_BYTES, choose_compute_dtype, choose_weights_cache

GiB = 1 << 30


@pytest.mark.parametrize("gpu", [False, True])
@pytest.mark.parametrize("native", [False, True])
def test_compute_auto_follows_native_bf16_on_every_device(gpu, native):
    assert choose_compute_dtype("auto", gpu, native) == (torch.bfloat16 if native else torch.float32)
    assert choose_compute_dtype("fp32", gpu, native) == torch.float32
    assert choose_compute_dtype("bf16", gpu, native) == torch.bfloat16


def test_compute_rejects_unknown_spec():
    with pytest.raises(ValueError, match="expected auto, fp32 or bf16"):
        choose_compute_dtype("fp16", False, True)


@pytest.mark.parametrize(
    "elements, memory, expected",
    [
        (GiB // 2, 64 * GiB, "bf16"),  # 1 GiB copy, limit 4 GiB
        (CACHE_LIMIT_BYTES // 2, 64 * GiB, "bf16"),  # exactly the limit
        (CACHE_LIMIT_BYTES // 2 + 1, 64 * GiB, "none"),  # one element over
        (GiB // 2, 4 * GiB, "none"),  # 1 GiB copy > 1/8 of 4 GiB
        (GiB // 4, 4 * GiB, "bf16"),  # 512 MiB = 1/8 of 4 GiB
        (GiB // 2, 0, "bf16"),  # memory unknown: the fixed limit alone
    ],
)
def test_cache_auto_keeps_bf16_copy_only_where_it_fits(elements, memory, expected):
    assert choose_weights_cache("auto", torch.bfloat16, elements, memory) == expected
    assert choose_weights_cache("auto", torch.float32, elements, memory) == "none"


@pytest.mark.parametrize("spec", ["none", "bf16", "fp32"])
def test_cache_explicit_spec_is_kept(spec):
    assert choose_weights_cache(spec, torch.float32, 10**12, 1) == spec


def test_cache_rejects_unknown_spec():
    with pytest.raises(ValueError, match="expected auto, none, bf16 or fp32"):
        choose_weights_cache("fp16", torch.bfloat16, 1, GiB)
