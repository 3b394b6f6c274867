"""SentencePiece BPE ("llama" in GGUF): a ModelProto built from the file's tokens, scores and types.

llama.cpp's SPM merge looks pieces up among *all* tokens, so every token that is not a byte or the
unknown token goes into the proto as NORMAL (SentencePiece would otherwise never merge into a
control or user-defined piece). Spaces are escaped to U+2581 by the caller, so the proto's
normalizer is the identity and adds no dummy prefix.
"""

from __future__ import annotations

import re

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as _pb

from juno_py.errors import TokenizerError

TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_BYTE = 2, 6
_BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")


class SentencePieceBPE:
    def __init__(self, tokens: list[str], scores: list[float], types: list[int], unk_id: int, source: str):
        Piece = _pb.ModelProto.SentencePiece
        proto = _pb.ModelProto()
        proto.trainer_spec.model_type = _pb.TrainerSpec.BPE
        proto.trainer_spec.vocab_size = len(tokens)
        proto.normalizer_spec.name = "identity"
        proto.normalizer_spec.add_dummy_prefix = False
        proto.normalizer_spec.remove_extra_whitespaces = False
        proto.normalizer_spec.escape_whitespaces = False
        n_bytes = 0
        for i, (text, score, ttype) in enumerate(zip(tokens, scores, types)):
            if ttype == TOKEN_TYPE_BYTE and _BYTE_PIECE.fullmatch(text):
                kind = Piece.BYTE
                n_bytes += 1
            elif i == unk_id:
                kind = Piece.UNKNOWN
            else:
                kind = Piece.NORMAL
            proto.pieces.add(piece=text, score=score, type=kind)
        proto.trainer_spec.byte_fallback = n_bytes == 256
        proto.trainer_spec.unk_id = unk_id
        proto.trainer_spec.bos_id = proto.trainer_spec.eos_id = proto.trainer_spec.pad_id = -1
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
        except (RuntimeError, ValueError) as e:
            raise TokenizerError(f"{source}: cannot build a SentencePiece model from the vocabulary: {e}") from None

    def encode(self, escaped_text: str) -> list[int]:
        return self._sp.encode(escaped_text)
