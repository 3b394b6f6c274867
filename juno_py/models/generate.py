"""Text generation with a KV cache: `prefill` the prompt, `decode_one_token` at a time, `generate` around both.
Greedy at temperature 0; otherwise temperature, top-k and top-p sampling from a seeded generator.

On the CPU `generate` decodes through `NativeDecoder` (every frozen product straight from the quantized bytes) where
the model allows it; on CUDA through `CudaGraphDecoder` (the whole step replayed as one CUDA graph over the static
cache); elsewhere through the model's forward. The prompt is prefilled through the forward (the dequantize + GEMM
products) in blocks of `PREFILL_BLOCK` tokens.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Optional

import torch
from torch import Tensor

from juno_py.errors import JunoError
from juno_py.models.decode import NativeDecoder
from juno_py.models.decode_cuda import CudaGraphDecoder
from juno_py.models.model import KVCache, Transformer

# prompt tokens per prefill forward: bounds the activations (and the attention scores) a long prompt holds at once
PREFILL_BLOCK = 512


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
def prefill(model: Transformer, tokens: Tensor, cache: KVCache, block: int = PREFILL_BLOCK) -> Tensor:
    """Run the prompt `[1, T]` through the model in blocks of `block` tokens, filling the cache; logits `[vocab]`
    of its last position."""
    if block < 1:
        raise ValueError(f"prefill block must be at least 1 token, got {block}")
    hidden = None
    for start in range(0, tokens.shape[1], block):
        hidden = model(tokens[:, start : start + block], cache=cache)
    if hidden is None:
        raise ValueError("prefill needs at least one prompt token")
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
    native: bool = True,
    thread_guard=None,
) -> list[int]:
    """New token ids after the prompt `ids`, at most `max_new_tokens`; stops before emitting a token of `stop_ids`
    (the stop token is not returned). `on_token` sees each token as it is produced. `native`: decode through
    `NativeDecoder` (CPU) or `CudaGraphDecoder` (CUDA) where the model allows it (False: always through the model's
    forward). `thread_guard`: a `juno_py.threads.StallGuard` told each decode step's wall time, which drops CPU
    threads when steps stall."""
    ids = list(ids)
    if not ids:
        raise ValueError("generate needs at least one prompt token")
    stop = set(stop_ids or ())
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    cache = model.new_cache(batch=1, max_len=len(ids) + max_new_tokens)
    logits = prefill(model, torch.tensor([ids], dtype=torch.long, device=model.embed.device), cache)
    decoder: Optional[NativeDecoder | CudaGraphDecoder] = None
    if native and max_new_tokens > 1:
        on_cuda = model.embed.device.type == "cuda"
        decoder = CudaGraphDecoder.build(model, cache) if on_cuda else NativeDecoder.build(model, cache)
    out: list[int] = []
    for step in range(max_new_tokens):
        if step and temperature <= 0 and isinstance(decoder, CudaGraphDecoder):
            # greedy on the GPU: the step picked the token and checked the logits itself (one read of two ints)
            token, finite = decoder.pick()
        else:
            finite = bool(torch.isfinite(logits).all())
            token = -1
        if not finite:
            raise NonFiniteLogits(
                f"the model's logits for generated token {step + 1} are not finite: its weights or the adapters "
                f"played on it hold extreme values"
            )
        if token < 0:
            token = sample(logits, temperature, top_k, top_p, generator)
        if token in stop:
            break
        out.append(token)
        if on_token is not None:
            on_token(token)
        if step + 1 < max_new_tokens:
            start = time.perf_counter()
            logits = decoder.step(token) if decoder is not None else decode_one_token(model, token, cache)
            if thread_guard is not None:
                thread_guard.observe(time.perf_counter() - start, 1)
    return out
