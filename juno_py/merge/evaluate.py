"""How far a merged model is from the base with its adapter played at run time: perplexity of both on data
files, and the mean KL divergence KL(playback ‖ merged) of the next-token distributions, over the tokens that
carry a loss (the same tokens `juno-py eval` scores)."""

from __future__ import annotations

import math
from typing import Sequence

import torch

# positions projected to logits at once: the streaming output projection dequantizes the whole (tied) vocabulary
# matrix per call, so calls should be few; the float64 log-probabilities are formed LOGPROB_ROWS rows at a time
CHUNK_POSITIONS = 256
LOGPROB_ROWS = 32
BATCH = 8  # sequences per forward: each forward dequantizes every weight once (streaming), so batch them


@torch.no_grad()
def compare_with_playback(
    base, adapters: Sequence, merged, data: Sequence, max_seq_len: int = 512, force: bool = False
) -> dict:
    """{"tokens", "loss_merged", "loss_playback", "ppl_merged", "ppl_playback", "kl_mean", "kl_max"}."""
    from juno_py.lora import load_adapters
    from juno_py.models import load_model
    from juno_py.train.data import IGNORE, load_examples, pad_batch

    playback = load_model(base)
    load_adapters(playback, list(adapters), force=force)
    merged_model = load_model(merged)
    examples, _ = load_examples(list(data), playback.tokenizer, max_seq_len)
    n, ce_m, ce_p, kl_sum, kl_max = 0, 0.0, 0.0, 0.0, 0.0
    ordered = sorted(examples, key=lambda e: len(e.ids))  # similar lengths together: less padding
    for start in range(0, len(ordered), BATCH):
        b = pad_batch(ordered[start : start + BATCH])
        supervised = b.targets != IGNORE
        if not supervised.any():
            continue
        hp = playback(b.tokens, b.positions, documents=b.documents)[supervised]
        hm = merged_model(b.tokens, b.positions, documents=b.documents)[supervised]
        targets = b.targets[supervised]
        for i in range(0, len(targets), CHUNK_POSITIONS):
            zp = playback.project(hp[i : i + CHUNK_POSITIONS])
            zm = merged_model.project(hm[i : i + CHUNK_POSITIONS])
            for j in range(0, len(zp), LOGPROB_ROWS):
                lp = torch.log_softmax(zp[j : j + LOGPROB_ROWS].double(), dim=-1)
                lm = torch.log_softmax(zm[j : j + LOGPROB_ROWS].double(), dim=-1)
                tgt = targets[i + j : i + j + len(lp)].unsqueeze(1)
                ce_p -= float(lp.gather(1, tgt).sum())
                ce_m -= float(lm.gather(1, tgt).sum())
                kl = (lp.exp() * (lp - lm)).sum(dim=1)
                kl_sum += float(kl.sum())
                kl_max = max(kl_max, float(kl.max()))
                n += len(tgt)
    if not n:
        raise ValueError(f"{', '.join(map(str, data))}: no supervised tokens to evaluate")
    return {
        "tokens": n,
        "loss_merged": ce_m / n,
        "loss_playback": ce_p / n,
        "ppl_merged": math.exp(ce_m / n),
        "ppl_playback": math.exp(ce_p / n),
        "kl_mean": kl_sum / n,
        "kl_max": kl_max,
    }
