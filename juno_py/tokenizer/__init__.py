"""Tokenizer from GGUF metadata with llama.cpp's algorithm, and sandboxed chat templates."""

from juno_py.tokenizer.chat import ChatTemplate
from juno_py.tokenizer.tokenizer import StreamDecoder, Tokenizer

__all__ = ["ChatTemplate", "StreamDecoder", "Tokenizer"]
