"""Corpora for language-model training: read, split, tokenise, cache, and cut into windows.

``load_corpus(DataConfig) -> Corpus`` is the entry point; the data contract lives beside the code that keeps
it: sources.py (what each ``data.corpus`` reads and the train / held-out split rule), cache.py (the
fingerprint and the cache layout), windows.py (how batches are drawn), tokenizer.py (bytes, BPE). The Lightning
data module that serves the windows is ``mixdepth.lit.LMDataModule``. Nothing here downloads anything.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mixdepth.config import DataConfig, DataError, check_rules
from mixdepth.data.cache import bin_stats, cache_root, cached_bpe, fingerprint, read_cache, write_cache
from mixdepth.data.sources import Doc, is_glob, open_bin, read_docs, split_bin, split_docs
from mixdepth.data.tokenizer import ByteTokenizer, IdTokenizer, Tokenizer
from mixdepth.data.windows import ShardedBatchSampler, TokenWindows, as_batch

__all__ = ["Corpus", "ShardedBatchSampler", "TokenWindows", "as_batch", "cache_root", "load_corpus"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Corpus:
    """A tokenised corpus split into train and a fixed validation set.

    Attributes:
        train: training tokens ``[N_train]``: int32 for text corpora; for ``.bin`` a zero-copy view of the
            memmap (uint16 -> torch.uint16, uint32 -> int32). Treat as read-only.
        val: the fixed validation tokens ``[N_val]``, int32 (exactly ``val_tokens`` unless that is 0).
        vocab_size: token ids are in ``[0, vocab_size)``; equal to what the config implies (256,
            ``bpe_vocab_size`` even if BPE ran out of merges early, or ``bin_vocab_size``).
        fingerprint: 16 hex chars identifying tokens and split; equal iff the data are equal.
        name: human-readable source, e.g. ``stdlib:python3.11.7`` or the configured path.
        tokenizer: maps text <-> ids (``IdTokenizer`` for ``.bin``: no text mapping).
        train_files: relative names of the files trained on (text corpora).
        val_files: relative names of the held-out files (text corpora).
    """

    train: torch.Tensor
    val: torch.Tensor
    vocab_size: int
    fingerprint: str
    name: str
    tokenizer: Tokenizer
    train_files: tuple[str, ...] = ()
    val_files: tuple[str, ...] = ()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` under this corpus's tokenizer."""
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Text of ``ids`` under this corpus's tokenizer."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self.tokenizer.decode(ids)


def load_corpus(cfg: DataConfig, cache_dir: Path | str | None = None) -> Corpus:
    """Read, tokenise (or load from cache) and split the configured corpus.

    Args:
        cfg: data configuration.
        cache_dir: cache folder; default ``$MIXDEPTH_CACHE`` or ``~/.cache/mixdepth``.

    Returns:
        The corpus; deterministic across processes and machines for the same source bytes and config.

    Raises:
        DataError: bad config, missing or empty source, or too little data for the split / one window.
    """
    _check_config(cfg)
    root = cache_root(cache_dir)
    if cfg.corpus.endswith(".bin") and not is_glob(cfg.corpus):
        corpus = _load_bin(cfg, Path(cfg.corpus).expanduser(), root)
    else:
        corpus = _load_text(cfg, root)
    for part, n in (("train", corpus.train.numel()), ("val", corpus.val.numel())):
        if n < cfg.seq_len + 1:
            fix = "raise data.val_tokens" if part == "val" and cfg.val_tokens else "use more text"
            raise DataError(
                f"data.corpus={cfg.corpus}: {part} split has {n} tokens, fewer than one window of "
                f"data.seq_len+1={cfg.seq_len + 1}; {fix} or lower seq_len"
            )
    return corpus


def _check_config(cfg: DataConfig) -> None:
    check_rules("data", cfg, DataError)


def _load_text(cfg: DataConfig, root: Path) -> Corpus:
    docs, name = read_docs(cfg)
    train_docs, held_docs = split_docs(docs, cfg.val_fraction)
    tok = ByteTokenizer() if cfg.tokenizer == "bytes" else cached_bpe(cfg.bpe_vocab_size, train_docs, root)
    files = [[d.rel, d.digest, "train"] for d in train_docs] + [[d.rel, d.digest, "val"] for d in held_docs]
    fp = fingerprint(
        {
            "tokenizer": tok.identity,
            "files": files,
            "max_bytes": cfg.max_bytes,
            "val_fraction": cfg.val_fraction,
            "val_tokens": cfg.val_tokens,
        }
    )
    entry = root / f"corpus-{fp}"
    arrays = read_cache(entry, fp, tok.vocab_size)
    if arrays is None:
        t0 = time.perf_counter()
        train = _encode_docs(tok, train_docs)
        held = _encode_docs(tok, held_docs)
        if held.size < cfg.val_tokens:
            raise DataError(
                f"data.corpus={cfg.corpus}: held-out split has {held.size} tokens < data.val_tokens="
                f"{cfg.val_tokens}; lower data.val_tokens or raise data.val_fraction / data.max_bytes"
            )
        arrays = train, held[: cfg.val_tokens or held.size]
        meta = {"name": name, "vocab_size": tok.vocab_size, "tokenizer": tok.identity}
        write_cache(entry, fp, arrays, meta, tok)
        dt = time.perf_counter() - t0
        log.info("tokenised %s into %d+%d tokens in %.2fs", name, train.size, arrays[1].size, dt)
    train, val = (torch.from_numpy(a.astype(np.int32, copy=False)) for a in arrays)
    if tok.vocab_size < cfg.bpe_vocab_size and cfg.tokenizer == "bpe":
        log.warning("BPE stopped at %d < %d tokens (too little text)", tok.vocab_size, cfg.bpe_vocab_size)
    return Corpus(
        train=train,
        val=val,
        vocab_size=cfg.bpe_vocab_size if cfg.tokenizer == "bpe" else tok.vocab_size,  # known before reading
        fingerprint=fp,
        name=name,
        tokenizer=tok,
        train_files=tuple(d.rel for d in train_docs),
        val_files=tuple(d.rel for d in held_docs),
    )


def _encode_docs(tok: Tokenizer, docs: list[Doc]) -> np.ndarray:
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.int32
    parts = tok.encode_many([d.text for d in docs])
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)


def _load_bin(cfg: DataConfig, path: Path, root: Path) -> Corpus:
    arr = open_bin(cfg, path)
    digest, top = bin_stats(path, arr, root)
    if top >= cfg.bin_vocab_size:
        raise DataError(
            f"data.corpus={cfg.corpus}: token id {top} >= data.bin_vocab_size={cfg.bin_vocab_size}; "
            f"fix bin_vocab_size or bin_dtype"
        )
    train, val = split_bin(cfg, arr)
    tok = IdTokenizer(cfg.bin_vocab_size, cfg.bin_dtype)
    fp = fingerprint(
        {
            "tokenizer": tok.identity,
            "bin_sha256": digest,
            "val_fraction": cfg.val_fraction,
            "val_tokens": cfg.val_tokens,
        }
    )
    return Corpus(
        train=train,
        val=val,
        vocab_size=cfg.bin_vocab_size,
        fingerprint=fp,
        name=cfg.corpus,
        tokenizer=tok,
    )
