"""Tokenisers: raw UTF-8 bytes (vocab 256) and a byte-level BPE trained locally with ``tokenizers``.

Both expose the same small surface: ``vocab_size``, ``encode``, ``decode``, ``encode_array`` (fast path for
whole documents) and ``identity``, a string that pins the exact token mapping (for BPE it carries a hash of
the serialised vocab and merges), used in corpus fingerprints. Nothing here downloads anything.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["BPETokenizer", "ByteTokenizer", "IdTokenizer", "Tokenizer", "TokenizerError"]


class TokenizerError(ValueError):
    """A tokeniser could not be built or loaded (one-line message)."""


class Tokenizer:
    """Common interface: text <-> token ids."""

    name: str = ""
    vocab_size: int = 0

    @property
    def identity(self) -> str:
        """A string that changes whenever the text -> ids mapping changes."""
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        """Token ids of ``text`` as an int64 array ``[N]``."""
        raise NotImplementedError

    def encode_many(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids of each text, as int64 arrays (batched where the backend allows)."""
        return [self.encode_array(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (invalid UTF-8 becomes U+FFFD)."""
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens: vocab 256, no training, lossless for any text."""

    name = "bytes"
    vocab_size = 256

    @property
    def identity(self) -> str:
        return "bytes:utf-8:256"

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class BPETokenizer(Tokenizer):
    """Byte-level BPE (GPT-2 style pre-tokenisation) backed by a ``tokenizers.Tokenizer``.

    No special tokens; the 256 byte symbols are always in the vocabulary, so every text encodes and
    ``decode(encode(text)) == text``.
    """

    name = "bpe"

    def __init__(self, backend: object) -> None:
        self._tok = backend
        self.vocab_size = int(backend.get_vocab_size())
        self._json = backend.to_str()

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        """Train on ``texts`` (deterministic: merges tie-break by pair id, vocab serialised by id).

        Args:
            texts: training documents, in a fixed order.
            vocab_size: target vocabulary (>= 257); smaller if the text runs out of pairs to merge.
        """
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        if vocab_size <= 256:
            raise TokenizerError(f"bpe_vocab_size={vocab_size}: must be > 256 (the byte alphabet); raise it")
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=[],
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def from_json(cls, text: str) -> BPETokenizer:
        """Load from the JSON produced by :meth:`to_json`; raises TokenizerError if it is unreadable."""
        from tokenizers import Tokenizer as HFTokenizer

        try:
            return cls(HFTokenizer.from_str(text))
        except Exception as e:  # the Rust side raises plain Exception subclasses
            raise TokenizerError(f"unreadable BPE tokenizer JSON: {str(e).splitlines()[0]}") from e

    def to_json(self) -> str:
        """The full tokenizer (vocab, merges, pre-tokeniser, decoder) as JSON."""
        return self._json

    @property
    def identity(self) -> str:
        return f"bpe:{self.vocab_size}:{hashlib.sha256(self._json.encode()).hexdigest()}"

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, dtype=np.int64)

    def encode_many(self, texts: Sequence[str]) -> list[np.ndarray]:
        fast = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # skips offsets
        return [np.asarray(e.ids, dtype=np.int64) for e in fast(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class IdTokenizer(Tokenizer):
    """Stand-in for pre-tokenised corpora (``.bin``): knows the vocab, cannot map text."""

    name = "ids"

    def __init__(self, vocab_size: int, dtype: str) -> None:
        self.vocab_size = vocab_size
        self.dtype = dtype

    @property
    def identity(self) -> str:
        return f"ids:{self.dtype}:{self.vocab_size}"

    def encode_array(self, text: str) -> np.ndarray:
        raise TokenizerError("corpus is pre-tokenised (.bin): encode with its own tokenizer")

    def decode(self, ids: Iterable[int]) -> str:
        raise TokenizerError("corpus is pre-tokenised (.bin): decode with its own tokenizer")
