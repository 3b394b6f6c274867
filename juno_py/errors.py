"""Typed errors whose message is the one line a user reads."""


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
