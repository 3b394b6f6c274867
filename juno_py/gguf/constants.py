"""GGML type ids and GGUF value types: the numbers of the file format, in one place."""

from enum import IntEnum

GGUF_MAGIC = b"GGUF"
GGUF_DEFAULT_ALIGNMENT = 32
GGUF_SUPPORTED_VERSIONS = (2, 3)


class GGMLType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39


# (elements per block, bytes per block) for every type a GGUF file may declare. Knowing the size of a
# type lets the reader validate and copy tensors it cannot decode.
GGML_BLOCK_SIZES: dict[int, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.Q4_0: (32, 18),
    GGMLType.Q4_1: (32, 20),
    GGMLType.Q5_0: (32, 22),
    GGMLType.Q5_1: (32, 24),
    GGMLType.Q8_0: (32, 34),
    GGMLType.Q8_1: (32, 40),
    GGMLType.Q2_K: (256, 84),
    GGMLType.Q3_K: (256, 110),
    GGMLType.Q4_K: (256, 144),
    GGMLType.Q5_K: (256, 176),
    GGMLType.Q6_K: (256, 210),
    GGMLType.Q8_K: (256, 292),
    GGMLType.IQ2_XXS: (256, 66),
    GGMLType.IQ2_XS: (256, 74),
    GGMLType.IQ3_XXS: (256, 98),
    GGMLType.IQ1_S: (256, 50),
    GGMLType.IQ4_NL: (32, 18),
    GGMLType.IQ3_S: (256, 110),
    GGMLType.IQ2_S: (256, 82),
    GGMLType.IQ4_XS: (256, 136),
    GGMLType.I8: (1, 1),
    GGMLType.I16: (1, 2),
    GGMLType.I32: (1, 4),
    GGMLType.I64: (1, 8),
    GGMLType.F64: (1, 8),
    GGMLType.IQ1_M: (256, 56),
    GGMLType.BF16: (1, 2),
    GGMLType.TQ1_0: (256, 54),
    GGMLType.TQ2_0: (256, 66),
    GGMLType.MXFP4: (32, 17),
}


def type_name(ggml_type: int) -> str:
    try:
        return GGMLType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def parse_type_name(name: str) -> GGMLType:
    """'q8_0' or 'Q8_0' -> GGMLType.Q8_0; raises ValueError listing the known names."""
    try:
        return GGMLType[name.strip().upper()]
    except KeyError:
        known = ", ".join(t.name.lower() for t in GGMLType)
        raise ValueError(f"unknown GGML type {name!r}: expected one of {known}") from None


class ValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# numpy little-endian dtype code per scalar value type
SCALAR_DTYPES: dict[int, str] = {
    ValueType.UINT8: "<u1",
    ValueType.INT8: "<i1",
    ValueType.UINT16: "<u2",
    ValueType.INT16: "<i2",
    ValueType.UINT32: "<u4",
    ValueType.INT32: "<i4",
    ValueType.FLOAT32: "<f4",
    ValueType.BOOL: "<u1",
    ValueType.UINT64: "<u8",
    ValueType.INT64: "<i8",
    ValueType.FLOAT64: "<f8",
}
