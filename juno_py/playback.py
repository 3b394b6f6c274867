"""Playing a model back: opening it as `juno-py local`, `eval` and `serve` do, generating a reply's text (streamed,
with stop strings), and named adapters switched per request (`juno-py serve`).

`open_model` resolves the `auto` weights cache and compute dtype for inference. `complete` runs
`juno_py.models.generate.generate` on prompt ids and turns its tokens into text as they come, holding back only
what could be the start of a stop string. `Adapters` keeps named adapter files for one model and installs a
selection (`base`, `name`, `a+b:0.5`) before a generation; the modules of recent selections are kept, so switching
back costs nothing.
"""

from __future__ import annotations

import math
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from juno_py.errors import JunoError, show

BASE = "base"  # the selection that plays no adapter


class UnknownAdapter(JunoError, LookupError):
    """A selection names an adapter that is not served."""


class SelectionError(JunoError, ValueError):
    """A selection that cannot be read (`name[:scale][+name[:scale]]`)."""


# ----------------------------------------------------------------------------------------------- opening
def open_model(
    model_path,
    lora_play=None,
    force=False,
    weights_cache="auto",
    compute_dtype="fp32",
    device="cpu",
    threads=None,
    announce=True,
):
    """The model for inference, with the adapters of `lora_play` (`A[:scale][,B[:scale]]`) played on it.
    `auto` resolves as in every command (juno_py.precision); one stderr line says what it resolved to."""
    from juno_py import threads as cpu_threads
    from juno_py.lora import load_adapters
    from juno_py.models import load_model

    cpu_threads.setup(threads)
    from juno_py import precision
    from juno_py.store import resolve_model

    compute = precision.resolve_compute_dtype(compute_dtype, device)
    weights_cache = precision.resolve_weights_cache(weights_cache, resolve_model(model_path), compute, device)
    compute_dtype = precision.dtype_name(compute)
    resolution = f"compute {str(compute).removeprefix('torch.')}, weights cache {weights_cache}"  # as training says
    model = load_model(model_path, device=device, weights_cache=weights_cache, compute_dtype=compute_dtype)
    if lora_play:
        from juno_py.cli.common import warnings_to_stderr

        with warnings_to_stderr():  # a differing fingerprint: one `juno-py: warning:` line, no raw warning
            load_adapters(model, [s for s in lora_play.split(",") if s.strip()], force=force)
    model.resolution = resolution  # what `auto` resolved to, for the command's summary line
    if announce:  # once the model and adapters are open: a bad input stays a single line
        print(f"juno-py: {resolution}", file=sys.stderr)
    return model


# ------------------------------------------------------------------------------------------- generation
@dataclass
class Sampling:
    """How a reply is sampled: temperature 0 is greedy; top_k None or 0 and top_p 1 are off."""

    max_tokens: int = 256
    temperature: float = 0.7
    top_k: Optional[int] = 40
    top_p: float = 0.95
    seed: Optional[int] = None
    stop: Sequence[str] = ()  # texts that end the reply (not included in it)


@dataclass
class Completion:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop": end of generation or a stop text; "length": max_tokens; "cancelled"
    seconds: float = 0.0
    stopped_by: Optional[str] = None  # the stop text that ended it
    token_ids: list[int] = field(default_factory=list)  # the generated tokens (the end-of-generation one not)


class _Finished(Exception):
    """Raised from the token callback to end a generation early (a stop text, a cancelled request)."""


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of `text` that could begin one of `stops`: the longest such suffix."""
    longest = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


def complete(
    model,
    ids: Sequence[int],
    sampling: Sampling,
    on_text: Optional[Callable[[str], None]] = None,
    cancelled: Optional[Callable[[], bool]] = None,
    thread_guard=None,
) -> Completion:
    """Generate after the prompt `ids` (stopping at the tokenizer's end-of-generation tokens, `sampling.stop`
    texts or `max_tokens`); `on_text` receives the reply's text piece by piece, whole characters only and never
    part of a stop text; `cancelled()` is asked after each token."""
    import time

    from juno_py.models.generate import generate

    tok = model.tokenizer
    decoder = tok.stream()
    stops = [s for s in sampling.stop if s]
    parts: list[str] = []
    state: dict[str, Any] = {"pending": "", "n": 0, "finish": None, "stop": None}
    tokens: list[int] = []

    def emit(text: str) -> None:
        if text:
            parts.append(text)
            if on_text is not None:
                on_text(text)

    def take(text: str, final: bool = False) -> None:
        pending = state["pending"] + text
        hits = [(i, s) for s in stops if (i := pending.find(s)) >= 0]
        if hits:
            i, s = min(hits)
            emit(pending[:i])
            state.update(pending="", finish="stop", stop=s)
            raise _Finished
        keep = 0 if final else _held_back(pending, stops)
        emit(pending[: len(pending) - keep])
        state["pending"] = pending[len(pending) - keep :]

    def on_token(token: int) -> None:
        state["n"] += 1
        tokens.append(token)
        take(decoder.push(token))
        if cancelled is not None and cancelled():
            state["finish"] = "cancelled"
            raise _Finished

    t0 = time.perf_counter()
    try:
        generate(
            model,
            ids,
            sampling.max_tokens,
            temperature=sampling.temperature,
            top_k=sampling.top_k or None,
            top_p=sampling.top_p,
            seed=sampling.seed,
            stop_ids=tok.eog_ids,
            on_token=on_token,
            thread_guard=thread_guard,
        )
    except _Finished:
        pass
    if state["finish"] is None:
        try:
            take(decoder.flush(), final=True)
        except _Finished:
            pass
    if state["finish"] is None:
        state["finish"] = "length" if state["n"] >= sampling.max_tokens else "stop"
    return Completion("".join(parts), len(ids), state["n"], state["finish"], time.perf_counter() - t0, state["stop"])


# ------------------------------------------------------------------------------------------------ adapters
Selection = tuple[tuple[str, float], ...]  # (adapter name, scale) pairs; () is the base


def adapter_name(path: Union[str, Path]) -> str:
    """The name an adapter file is served under when none is given: its file name without `.bin`."""
    name = Path(path).name
    return name[: -len(".bin")] if name.endswith(".bin") and len(name) > 4 else name


def parse_named(specs: Sequence[str]) -> dict[str, Path]:
    """`NAME=PATH` or `PATH` (named after the file) for each adapter; names are unique and not `base`."""
    named: dict[str, Path] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = adapter_name(spec), spec
        name = name.strip()
        if not name or name == BASE or any(c in name for c in "+,:= ") or name.startswith("/"):
            raise SelectionError(
                f"adapter {show(spec)}: the name {show(name)} cannot be used; a name is not {BASE!r} and has no "
                f"'+', ',', ':', '=' or spaces (give NAME=PATH)"
            )
        if name in named:
            raise SelectionError(f"adapter {show(spec)}: the name {name!r} is given twice")
        named[name] = Path(path)
    return named


class Adapters:
    """Named adapter files for one model, installed per selection: `base`, `name`, or LoRAs combined as in
    `juno-py local --adapter`, `a+b:0.5` (or `a,b:0.5`). Every file is loaded and checked against the model when it is
    registered, so a bad one fails at start, not at the first request."""

    def __init__(self, model, named: Mapping[str, Union[str, Path]], force: bool = False, keep: int = 8):
        from juno_py.lora import detach

        self.model, self.force, self.keep = model, force, max(1, keep)
        self.named = {name: Path(path) for name, path in named.items()}
        self._built: OrderedDict[Selection, dict[str, Any]] = OrderedDict()
        self.current: Selection = ()
        detach(model)
        for name in self.named:
            self.use(self.parse(name))
        self.use(())

    def names(self) -> list[str]:
        return [BASE, *self.named]

    def parse(self, spec: str) -> Selection:
        """The selection `spec` names; UnknownAdapter for a name not served, SelectionError for a bad form."""
        from juno_py.lora import parse_adapter_spec

        text = spec.strip() if isinstance(spec, str) else ""
        if not text:
            raise SelectionError(f"model {show(spec)}: expected {BASE!r}, an adapter's name or a combination a+b:0.5")
        if text == BASE:
            return ()
        picked: list[tuple[str, float]] = []
        for part in text.replace(",", "+").split("+"):
            name, scale = parse_adapter_spec(part.strip())
            if name not in self.named:
                served = ", ".join(self.names())
                raise UnknownAdapter(f"model {show(spec)}: no adapter named {show(name)} (served: {served})")
            if not math.isfinite(scale):
                raise SelectionError(f"model {show(spec)}: the scale of {name!r} is not a finite number")
            if name in (n for n, _ in picked):
                raise SelectionError(f"model {show(spec)}: {name!r} appears twice")
            picked.append((name, scale))
        return tuple(picked)

    def use(self, selection: Selection) -> None:
        """Install `selection` on the model (a DoRA adapter only alone at scale 1: AdapterMismatch otherwise)."""
        from juno_py.lora import detach, load_adapters
        from juno_py.lora.format import parse_key

        if selection == self.current:
            return
        if not selection:
            detach(self.model)
        elif selection in self._built:
            self._built.move_to_end(selection)
            detach(self.model)
            for key, module in self._built[selection].items():
                layer, target = parse_key(key)
                self.model.blocks[layer].linears[target] = module
        else:
            try:
                built = load_adapters(self.model, [(str(self.named[n]), s) for n, s in selection], force=self.force)
            except BaseException:
                detach(self.model)  # whatever happened, the model holds the base, and says so
                self.current = ()
                raise
            self._built[selection] = dict(built)
            while len(self._built) > self.keep:
                self._built.popitem(last=False)
        self.current = selection
