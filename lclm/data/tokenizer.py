"""SentencePiece LLaMA tokenizers (`tokenizer.model`: unk=0, bos=1, eos=2)."""

from __future__ import annotations

import os

import sentencepiece as spm

from lclm.config import ConfigError


class Tokenizer:
    """A SentencePiece model file; loading it parses a protobuf, never executes anything."""

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer {path!r} not found; set config.data.tokenizer "
                                    "to a SentencePiece .model file")
        self.path = path
        try:
            self._sp = spm.SentencePieceProcessor(model_file=path)
        except RuntimeError as e:  # SentencePiece's only error for a file it cannot parse
            raise ConfigError(f"tokenizer {path!r} is not a SentencePiece model ({e}); set "
                              "config.data.tokenizer to a .model file") from None

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts)

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])

    def check_fits(self, model_vocab_size: int) -> None:
        """Fail when token ids could fall outside the model's embedding table."""
        if self.vocab_size > model_vocab_size:
            raise ConfigError(f"tokenizer {self.path!r} has {self.vocab_size} pieces but "
                              f"model.vocab_size={model_vocab_size}; set model.vocab_size >= "
                              f"{self.vocab_size}")
