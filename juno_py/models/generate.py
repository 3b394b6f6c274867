"""Text generation with a KV cache: `prefill` the prompt, `decode_one_token` at a time, `generate` around both.
Greedy at temperature 0; otherwise temperature, top-k and top-p sampling from a seeded generator.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import Tensor

from juno_py.errors import JunoError
from juno_py.models.model import KVCache, Transformer


class NonFiniteLogits(JunoError, FloatingPointError):
    """The model's next-token logits hold NaN or Inf: weights or adapters with extreme values."""


def sample(
    logits: Tensor,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
) -> int:
    """One token id from logits `[vocab]`."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    logits = logits.float() / temperature
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and 0 < top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # keep the smallest prefix reaching top_p
        sorted_probs[drop] = 0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


@torch.no_grad()
def prefill(model: Transformer, tokens: Tensor, cache: KVCache) -> Tensor:
    """Run the prompt `[1, T]` through the model, filling the cache; logits `[vocab]` of its last position."""
    hidden = model(tokens, cache=cache)
    return model.project(hidden[0, -1])


@torch.no_grad()
def decode_one_token(model: Transformer, token: int, cache: KVCache) -> Tensor:
    """Feed one token after the cached ones; logits `[vocab]` for the next."""
    tokens = torch.tensor([[token]], dtype=torch.long, device=model.embed.device)
    return model.project(model(tokens, cache=cache)[0, -1])


def generate(
    model: Transformer,
    ids: Iterable[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    seed: Optional[int] = None,
    stop_ids: Optional[Iterable[int]] = None,
    on_token: Optional[Callable[[int], None]] = None,
) -> list[int]:
    """New token ids after the prompt `ids`, at most `max_new_tokens`; stops before emitting a token of `stop_ids`
    (the stop token is not returned). `on_token` sees each token as it is produced."""
    ids = list(ids)
    if not ids:
        raise ValueError("generate needs at least one prompt token")
    stop = set(stop_ids or ())
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    cache = model.new_cache(batch=1, max_len=len(ids) + max_new_tokens)
    logits = prefill(model, torch.tensor([ids], dtype=torch.long, device=model.embed.device), cache)
    out: list[int] = []
    for step in range(max_new_tokens):
        if not bool(torch.isfinite(logits).all()):
            raise NonFiniteLogits(
                f"the model's logits for generated token {step + 1} are not finite: its weights or the adapters "
                f"played on it hold extreme values"
            )
        token = sample(logits, temperature, top_k, top_p, generator)
        if token in stop:
            break
        out.append(token)
        if on_token is not None:
            on_token(token)
        if step + 1 < max_new_tokens:
            logits = decode_one_token(model, token, cache)
    return out
