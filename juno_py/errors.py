"""Typed errors whose message is the one line a user reads, and the formatter that keeps values from files short."""

from __future__ import annotations

MAX_MESSAGE = 500  # characters: a message longer than this is cut in the middle


class JunoError(Exception):
    """Base class: every user-facing failure of juno-py."""


class GGUFFormatError(JunoError, ValueError):
    """A GGUF file is malformed, truncated or hostile."""


class UnsupportedQuantType(JunoError, ValueError):
    """A GGML type we cannot decode or encode."""


class UnsupportedArchitecture(JunoError, ValueError):
    """A model architecture outside the allowlist."""


class AdapterMismatch(JunoError, ValueError):
    """An adapter that does not fit the model."""


class ModelStoreError(JunoError, RuntimeError):
    """Fetching or verifying a model from the package index failed."""


class TokenizerError(JunoError, ValueError):
    """A vocabulary, pre-tokenizer or chat template we cannot use."""


def show(value, limit: int = 60) -> str:
    """A value read from a file, as it may appear in an error message: a `repr` of at most about `limit`
    characters, whatever the value's size (long strings and sequences are cut and their length said)."""
    if isinstance(value, (str, bytes, bytearray)):
        if len(value) <= limit:
            return repr(value)
        unit = "characters" if isinstance(value, str) else "bytes"
        return f"{value[:limit]!r}… ({len(value)} {unit})"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 4 * limit:
        return f"<an integer of {value.bit_length()} bits>"  # repr of a huge int is slow, and refused past 4300 digits
    if isinstance(value, (int, float)) or value is None:
        text = repr(value)
        return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} digits)"
    try:
        n = len(value)
        head = [value[i] for i in range(min(n, 4))]
    except Exception:  # noqa: BLE001 - not a sized sequence: its type is all we say
        return f"<{type(value).__name__}>"
    items = ", ".join(show(v, max(limit // 4, 12)) for v in head)
    return f"[{items}{', …' if n > 4 else ''}] ({n} items)" if n > 4 else f"[{items}]"


def one_line(message: str, limit: int = MAX_MESSAGE) -> str:
    """`message` on one line (line breaks escaped) and at most `limit` characters (cut in the middle)."""
    text = str(message).replace("\r", "\\r").replace("\n", "\\n")
    if len(text) <= limit:
        return text
    keep = limit - 3
    return text[: keep - keep // 3] + " … " + text[len(text) - keep // 3 :]
