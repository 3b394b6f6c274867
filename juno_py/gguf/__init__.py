"""GGUF files: validated reading, streaming writing and the quant codecs."""

from juno_py.errors import GGUFFormatError, UnsupportedQuantType
from juno_py.gguf.constants import GGMLType, ValueType
from juno_py.gguf.memory import MemoryGGUF
from juno_py.gguf.reader import Field, GGUFFile, TensorInfo
from juno_py.gguf.writer import GGUFWriter

__all__ = [
    "GGUFFile",
    "GGUFWriter",
    "GGUFFormatError",
    "UnsupportedQuantType",
    "GGMLType",
    "ValueType",
    "Field",
    "TensorInfo",
    "MemoryGGUF",
]
