"""Corpora, token windows and the Lightning data module.

Sources (``DataConfig.corpus``):

- ``"stdlib"`` (default, no download): the ``.py`` files of the running interpreter's standard library
  (``sysconfig.get_paths()["stdlib"]``) in sorted relative-path order. Skipped folders, see
  ``STDLIB_SKIP``: third-party code (``site-packages``), test suites (``test``, ``tests``, ``idle_test``),
  IDLE, lib2to3, turtledemo, ensurepip and ``encodings`` (generated codec tables, not prose or code).
- a text file, a folder (every text file inside, recursively, sorted; hidden entries and ``__pycache__``
  skipped; a file is text when its first 8 KiB hold no NUL byte) or a glob (``data/*.txt``, ``**`` allowed).
- a pre-tokenised ``.bin`` memmap of ``bin_dtype`` ids below ``bin_vocab_size``.

Text is read in order up to ``max_bytes`` (the last file is cut at a UTF-8 boundary), decoded as UTF-8 with
``errors="replace"`` and concatenated without separators. With two files or more the split is by file: a file
is held out when ``sha1(relative path) mod 1000 < 1000 * val_fraction`` (so adding files never moves others),
forcing one file into each side if the rule left a side empty. A single file, and a ``.bin``, hold out their
tail instead. ``val`` is the first ``val_tokens`` tokens of the held-out part (0 = all of it); the rest of the
held-out part is unused, never trained on. ``max_bytes`` does not apply to ``.bin`` corpora.

The fingerprint hashes what determines the tokens: tokenizer identity (BPE: vocab and merges), the ordered
(relative name, sha256, side) list of the text actually read or the ``.bin`` bytes hash, and the split keys.
Tokenised corpora are cached under ``$MIXDEPTH_CACHE`` (default ``~/.cache/mixdepth``) as
``corpus-<fingerprint>/{train,val}.npy``; a trained BPE as ``bpe-<key>.json`` beside them. An unreadable cache
entry is rebuilt. The text is re-read and re-hashed on every load (tens of ms for the default 4 MB), so a
changed file can never be served stale tokens; ``.bin`` hashes are memoised by (size, mtime, ctime, inode).

Batches: ``TokenWindows`` gathers a whole batch of ``seq_len + 1``-token windows with one numpy index
(~70 us for 32 x 128 on CPU); random training windows are a counter-based hash of (seed, sample index).
``LMDataModule`` wraps both; it is built on first access (PEP 562 ``__getattr__``) so that everything else
here imports without Lightning.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import sysconfig
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from mixdepth.tokenizer import BPETokenizer, ByteTokenizer, IdTokenizer, Tokenizer, TokenizerError

__all__ = [  # and LMDataModule, built lazily by __getattr__ (not here: `import *` would load Lightning)
    "Corpus",
    "DataConfig",
    "DataError",
    "ShardedBatchSampler",
    "TokenWindows",
    "as_batch",
    "cache_root",
    "load_corpus",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump when the split rule, text assembly or cache layout changes
STDLIB_SKIP = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "lib2to3", "turtledemo"}
    | {"ensurepip", "encodings", "__pycache__"}
)
BIN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
TOKENIZERS = ("bytes", "bpe")
_SNIFF = 8192  # bytes inspected for NUL to tell text from binary
_MAGIC = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from and how they are split (plain types only: built from YAML).

    Attributes:
        corpus: ``"stdlib"``, a text file, a folder, a glob, or a ``.bin`` token memmap.
        tokenizer: ``"bytes"`` (vocab 256) or ``"bpe"`` (trained locally on the train split).
        bpe_vocab_size: BPE target vocabulary (> 256).
        bin_dtype: dtype of ``.bin`` ids: ``uint16`` or ``uint32``.
        bin_vocab_size: vocabulary of a ``.bin`` corpus (required > 0 for ``.bin``).
        max_bytes: cap on text read, a deterministic prefix in file order (0 = no cap).
        val_fraction: share of files (or of the tail of a single file / ``.bin``) held out.
        val_tokens: size of the fixed validation set, taken from the start of the held-out part (0 = all).
        seq_len: tokens per training window (inputs); windows hold ``seq_len + 1`` tokens.
    """

    corpus: str = "stdlib"
    tokenizer: str = "bytes"
    bpe_vocab_size: int = 1024
    bin_dtype: str = "uint16"
    bin_vocab_size: int = 0
    max_bytes: int = 4_000_000
    val_fraction: float = 0.1
    val_tokens: int = 65_536
    seq_len: int = 128


class DataError(ValueError):
    """A corpus cannot be used as configured; the one-line message names the key or path to change."""


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


@dataclass(frozen=True)
class _Doc:
    rel: str  # name relative to the corpus root, '/'-separated
    data: bytes  # raw bytes actually used (after the max_bytes cut)

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


def cache_root(cache_dir: Path | str | None = None) -> Path:
    """The cache folder: ``cache_dir`` if given, else ``$MIXDEPTH_CACHE``, else ``~/.cache/mixdepth``."""
    if cache_dir is None:
        cache_dir = os.environ.get("MIXDEPTH_CACHE") or "~/.cache/mixdepth"
    return Path(cache_dir).expanduser()


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
    if cfg.corpus.endswith(".bin") and not _MAGIC.search(cfg.corpus):
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
    if cfg.tokenizer not in TOKENIZERS:
        raise DataError(f"data.tokenizer={cfg.tokenizer!r} is unknown; use one of {', '.join(TOKENIZERS)}")
    if cfg.bin_dtype not in BIN_DTYPES:
        raise DataError(f"data.bin_dtype={cfg.bin_dtype!r} is not supported; use uint16 or uint32")
    if not 0.0 < cfg.val_fraction < 1.0:
        raise DataError(f"data.val_fraction={cfg.val_fraction} must be in (0, 1)")
    if cfg.val_tokens < 0 or cfg.max_bytes < 0:
        raise DataError(f"data.val_tokens={cfg.val_tokens}, data.max_bytes={cfg.max_bytes} must be >= 0")
    if cfg.seq_len < 1:
        raise DataError(f"data.seq_len={cfg.seq_len} must be >= 1")
    if cfg.tokenizer == "bpe" and cfg.bpe_vocab_size <= 256:
        raise DataError(f"data.bpe_vocab_size={cfg.bpe_vocab_size} must be > 256 (the byte alphabet)")


def _fingerprint(payload: dict) -> str:
    blob = json.dumps({"format": FORMAT_VERSION, **payload}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ---------------------------------------------------------------- text sources


def _walk(root: str, skip: frozenset[str], suffix: str | None) -> list[tuple[str, str]]:
    """(relative name, path) of files under ``root``, no hidden entries or ``skip`` folders, sorted."""
    out: list[tuple[str, str]] = []
    cut = len(os.path.join(root, ""))
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in skip and not x.startswith(".") and not x.startswith("config-")]
        for f in files:
            if not f.startswith(".") and (suffix is None or f.endswith(suffix)):
                p = os.path.join(d, f)
                out.append((p[cut:].replace(os.sep, "/"), p))
    return sorted(out)


def _list_text_source(cfg: DataConfig) -> tuple[list[tuple[str, str]], bool, str]:
    """((relative name, path) of each file in order, skip binary files?, display name) of a text source."""
    src = cfg.corpus
    if src == "stdlib":
        root = sysconfig.get_paths()["stdlib"]
        return _walk(root, STDLIB_SKIP, ".py"), True, f"stdlib:python{platform.python_version()}"
    expanded = os.path.expanduser(src)
    if _MAGIC.search(src):
        files = [p for p in sorted(glob.glob(expanded, recursive=True)) if os.path.isfile(p)]
        if not files:
            raise DataError(f"data.corpus={src}: no files match the glob; check the pattern")
        parts = Path(expanded).parts
        root = Path(*parts[: next(i for i, p in enumerate(parts) if _MAGIC.search(p))] or ".")
        return [(Path(p).relative_to(root).as_posix(), p) for p in files], True, src
    if os.path.isdir(expanded):
        files = _walk(expanded, frozenset({"__pycache__"}), None)
        if not files:
            raise DataError(f"data.corpus={src}: folder holds no files; point it at a folder of text files")
        return files, True, src
    if os.path.isfile(expanded):
        return [(os.path.basename(expanded), expanded)], False, src
    raise DataError(f"data.corpus={src}: no such file or folder; fix the path (or use 'stdlib')")


def _read_docs(cfg: DataConfig) -> tuple[list[_Doc], str]:
    """Reads the text source up to ``max_bytes``; empty and (in folders/globs) binary files are skipped."""
    files, skip_binary, name = _list_text_source(cfg)
    docs: list[_Doc] = []
    total = 0
    for rel, path in files:
        with open(path, "rb") as f:
            data = f.read()
        if b"\0" in data[:_SNIFF]:
            if skip_binary:
                continue
            raise DataError(f"data.corpus={cfg.corpus}: file looks binary; give text, or a .bin token memmap")
        full = not cfg.max_bytes or total + len(data) < cfg.max_bytes
        if not full:
            data = _utf8_prefix(data, cfg.max_bytes - total)
        if data:
            docs.append(_Doc(rel, data))
            total += len(data)
        if not full:
            break
    if not docs:
        raise DataError(f"data.corpus={cfg.corpus}: no text (empty or binary files only); add text files")
    return docs, name


def _utf8_prefix(data: bytes, n: int) -> bytes:
    """At most ``n`` bytes of ``data``, not ending inside a UTF-8 character."""
    if n >= len(data):
        return data
    while n > 0 and (data[n] & 0xC0) == 0x80:  # data[n] continues a character: back off
        n -= 1
    return data[:n]


def _split_docs(docs: list[_Doc], val_fraction: float) -> tuple[list[_Doc], list[_Doc]]:
    """(train, held-out) documents: by file hash for >= 2 files, else the tail of the one file."""
    if len(docs) == 1:
        d = docs[0]
        cut = _utf8_prefix(d.data, int(len(d.data) * (1.0 - val_fraction)))
        return [_Doc(d.rel + "#head", cut)], [_Doc(d.rel + "#tail", d.data[len(cut) :])]
    keys = {d.rel: int.from_bytes(hashlib.sha1(d.rel.encode()).digest()[:8], "big") for d in docs}
    held = {d.rel for d in docs if keys[d.rel] % 1000 < val_fraction * 1000}
    if not held:  # too few files for the rule to pick one: hold out the lowest key
        held = {min(keys, key=keys.__getitem__)}
    if len(held) == len(docs):  # keep something to train on: the highest key trains
        held.discard(max(keys, key=keys.__getitem__))
    return [d for d in docs if d.rel not in held], [d for d in docs if d.rel in held]


def _get_tokenizer(cfg: DataConfig, train_docs: list[_Doc], root: Path) -> Tokenizer:
    if cfg.tokenizer == "bytes":
        return ByteTokenizer()
    key = _fingerprint({"bpe": cfg.bpe_vocab_size, "train": [[d.rel, d.digest] for d in train_docs]})
    path = root / f"bpe-{key}.json"
    if path.is_file():
        try:
            return BPETokenizer.from_json(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, TokenizerError) as e:
            log.warning("rebuilding unreadable BPE cache %s (%s)", path, e)
    t0 = time.perf_counter()
    tok = BPETokenizer.train((d.text for d in train_docs), cfg.bpe_vocab_size)
    log.info("trained BPE vocab %d in %.1fs", tok.vocab_size, time.perf_counter() - t0)
    _atomic_write(path, tok.to_json().encode("utf-8"))
    return tok


def _load_text(cfg: DataConfig, root: Path) -> Corpus:
    docs, name = _read_docs(cfg)
    train_docs, held_docs = _split_docs(docs, cfg.val_fraction)
    tok = _get_tokenizer(cfg, train_docs, root)
    files = [[d.rel, d.digest, "train"] for d in train_docs] + [[d.rel, d.digest, "val"] for d in held_docs]
    fp = _fingerprint(
        {
            "tokenizer": tok.identity,
            "files": files,
            "max_bytes": cfg.max_bytes,
            "val_fraction": cfg.val_fraction,
            "val_tokens": cfg.val_tokens,
        }
    )
    entry = root / f"corpus-{fp}"
    arrays = _read_cache(entry, fp, tok.vocab_size)
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
        _write_cache(entry, fp, arrays, meta, tok)
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


def _encode_docs(tok: Tokenizer, docs: list[_Doc]) -> np.ndarray:
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.int32
    parts = tok.encode_many([d.text for d in docs])
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)


# ---------------------------------------------------------------- cache


def _atomic_write(path: Path, blob: bytes) -> None:
    """Write-then-rename so concurrent readers never see half a file; an unwritable cache is skipped."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("cannot write cache file %s (%s); continuing without it", path, e)


def _read_cache(entry: Path, fp: str, vocab_size: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(train, val) from a cache entry, or None if absent or unusable (then it is rebuilt)."""
    if not entry.is_dir():
        return None
    try:
        meta = json.loads((entry / "meta.json").read_text())
        arrays = tuple(np.load(entry / f"{k}.npy", allow_pickle=False) for k in ("train", "val"))
        ok = meta["fingerprint"] == fp and meta["vocab_size"] == vocab_size
        for a, k in zip(arrays, ("n_train", "n_val"), strict=True):
            ok = ok and a.ndim == 1 and a.dtype.kind in "iu" and a.size == meta[k]
            ok = ok and (a.size == 0 or int(a.max()) < vocab_size)
        if ok:
            return arrays  # type: ignore[return-value]
    except (OSError, ValueError, KeyError, EOFError, TypeError) as e:
        log.warning("rebuilding unreadable corpus cache %s (%s)", entry, e)
        return None
    log.warning("rebuilding inconsistent corpus cache %s", entry)
    return None


def _write_cache(
    entry: Path,
    fp: str,
    arrays: tuple[np.ndarray, np.ndarray],
    meta: dict,
    tok: Tokenizer,
) -> None:
    """Build the entry in a temporary folder, then rename it into place (first writer wins)."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=".tmp-"))
        for k, a in zip(("train", "val"), arrays, strict=True):
            np.save(tmp / f"{k}.npy", a, allow_pickle=False)
        sizes = {"n_train": arrays[0].size, "n_val": arrays[1].size}
        meta = {**meta, **sizes, "fingerprint": fp, "format": FORMAT_VERSION}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if isinstance(tok, BPETokenizer):
            (tmp / "tokenizer.json").write_text(tok.to_json(), encoding="utf-8")
        if entry.exists():  # unusable (else we would not be here): replace it
            shutil.rmtree(entry, ignore_errors=True)
        try:
            os.rename(tmp, entry)
        except OSError:  # another process just wrote the same entry
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        log.warning("cannot write corpus cache %s (%s); continuing without it", entry, e)


# ---------------------------------------------------------------- .bin token memmaps


def _bin_stats(path: Path, arr: np.ndarray, root: Path) -> tuple[str, int]:
    """(sha256 of the file, max token id), memoised by the file's size/mtime/ctime/inode."""
    st = path.stat()
    stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, str(arr.dtype)]
    memo = root / f"binstat-{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]}.json"
    try:
        m = json.loads(memo.read_text())
        if m["stamp"] == stamp:
            return m["sha256"], int(m["max"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    step = 1 << 24
    top = max(int(arr[i : i + step].max()) for i in range(0, arr.size, step))
    _atomic_write(memo, json.dumps({"stamp": stamp, "sha256": digest, "max": top}).encode())
    return digest, top


def _load_bin(cfg: DataConfig, path: Path, root: Path) -> Corpus:
    src = cfg.corpus
    if not path.is_file():
        raise DataError(f"data.corpus={src}: no such .bin file; fix the path")
    dtype = np.dtype(BIN_DTYPES[cfg.bin_dtype])
    limit = 1 << 16 if dtype == np.uint16 else 1 << 31  # uint32 ids are viewed as int32
    if not 0 < cfg.bin_vocab_size <= limit:
        raise DataError(
            f"data.bin_vocab_size={cfg.bin_vocab_size}: set it to the vocab of the .bin corpus "
            f"(1..{limit} for {cfg.bin_dtype})"
        )
    size = path.stat().st_size
    if size == 0 or size % dtype.itemsize:
        raise DataError(
            f"data.corpus={src}: {size} bytes is {'empty' if size == 0 else 'not a whole number of ids'} "
            f"for data.bin_dtype={cfg.bin_dtype}; check the file and dtype"
        )
    arr = np.memmap(path, dtype=dtype, mode="c")  # copy-on-write: a stray write never reaches the file
    digest, top = _bin_stats(path, arr, root)
    if top >= cfg.bin_vocab_size:
        raise DataError(
            f"data.corpus={src}: token id {top} >= data.bin_vocab_size={cfg.bin_vocab_size}; "
            f"fix bin_vocab_size or bin_dtype"
        )
    n_held = int(arr.size * cfg.val_fraction)
    n_val = cfg.val_tokens or n_held
    if n_held < n_val:
        raise DataError(
            f"data.corpus={src}: held-out tail has {n_held} tokens < data.val_tokens={cfg.val_tokens}; "
            f"lower data.val_tokens or raise data.val_fraction"
        )
    head = arr[: arr.size - n_held]
    train = torch.from_numpy(head.view(np.int32) if dtype == np.uint32 else head)  # zero-copy, ids < 2**31
    val = torch.from_numpy(np.array(arr[head.size : head.size + n_val], dtype=np.int32))
    tok = IdTokenizer(cfg.bin_vocab_size, cfg.bin_dtype)
    fp = _fingerprint(
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
        name=src,
        tokenizer=tok,
    )


# ---------------------------------------------------------------- windows


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, elementwise on uint64 (wraps mod 2**64)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class TokenWindows(Dataset):
    """Windows of ``seq_len + 1`` tokens as ``(x, y)`` pairs, ``x = w[:-1]``, ``y = w[1:]``.

    Random mode (``seed`` given; training): item ``i`` starts at ``splitmix64(seed, i) mod (N - seq_len)``:
    a counter-based draw, so a sample depends only on (seed, i) — not on batch size, worker count or what
    was drawn before — and a run can resume at any step. Length ``num_samples`` (default 2**31).

    Fixed mode (``seed=None``; validation): item ``i`` is ``tokens[i*T : i*T + T + 1]``, so every token but
    the first is a target exactly once; the ragged tail is dropped. Length ``(N - 1) // T``.

    ``__getitems__`` builds a whole batch with one gather (no per-sample Python); use it through a
    ``DataLoader`` with ``collate_fn=as_batch``.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        seq_len: int,
        seed: int | None = None,
        num_samples: int = 1 << 31,
    ) -> None:
        if tokens.dim() != 1 or tokens.numel() < seq_len + 1:
            shape = tuple(tokens.shape)
            raise DataError(f"need a 1-D token tensor of >= seq_len+1={seq_len + 1} tokens, got {shape}")
        self.tokens = tokens.numpy()  # [N], shares memory (memmap stays a memmap)
        self.seq_len = seq_len
        self.seed = seed
        n_fixed = (self.tokens.size - 1) // seq_len
        self.length = num_samples if seed is not None else n_fixed
        self._offsets = np.arange(seq_len + 1, dtype=np.int64)  # [T+1]
        if seed is not None:
            self._key = _mix64(np.array([seed & (2**64 - 1)], dtype=np.uint64))

    def __len__(self) -> int:
        return self.length

    def starts(self, index: np.ndarray) -> np.ndarray:
        """Start positions ``[B]`` (int64) of items ``index`` ``[B]``."""
        index = np.asarray(index, dtype=np.int64)
        if self.seed is None:
            return index * self.seq_len
        z = _mix64((index.astype(np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15) + self._key)
        return (z % np.uint64(self.tokens.size - self.seq_len)).astype(np.int64)

    def __getitems__(self, index: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch: ``x, y`` int64 ``[B, T]``."""
        idx = np.asarray(index, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.length):
            raise IndexError(f"window index out of range [0, {self.length})")
        pos = self.starts(idx)[:, None] + self._offsets  # [B, T+1]
        w = torch.from_numpy(self.tokens[pos].astype(np.int64))  # [B, T+1]
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One window: ``x, y`` int64 ``[T]``."""
        x, y = self.__getitems__([i])
        return x[0], y[0]


def as_batch(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``collate_fn`` for ``TokenWindows``: ``__getitems__`` already returns the stacked batch."""
    return batch


class ShardedBatchSampler(Sampler[list[int]]):
    """Consecutive blocks of ``batch_size`` indices, the k-th global batch split over ``world`` ranks.

    Rank ``r`` gets indices ``[(k*world + r)*B, (k*world + r + 1)*B)`` at step ``k``, so W ranks with batch
    B see exactly the samples of one process with batch W*B. Lazy: never materialises the index list
    (Lightning's DistributedSampler would build a list of all 2**31 indices: keep
    ``Trainer(use_distributed_sampler=False)``).
    """

    def __init__(self, num_samples: int, batch_size: int, rank: int = 0, world: int = 1) -> None:
        self.num_samples, self.batch_size, self.rank, self.world = num_samples, batch_size, rank, world

    def __len__(self) -> int:
        return self.num_samples // (self.batch_size * self.world)

    def __iter__(self) -> Iterator[list[int]]:
        for k in range(len(self)):
            base = (k * self.world + self.rank) * self.batch_size
            yield list(range(base, base + self.batch_size))


def __getattr__(name: str) -> Any:
    """PEP 562 hook: ``LMDataModule`` is built on first access, so importing this module (corpora, windows,
    tokenizers) does not import Lightning (~5 s on a loaded 2-core CPU)."""
    if name == "LMDataModule":
        globals()[name] = cls = _define_datamodule()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _define_datamodule() -> type:
    import lightning as L

    class LMDataModule(L.LightningDataModule):
        """Language-model batches ``(x, y)``, int64 ``[B, T]`` with ``y`` = ``x`` shifted by one token.

        Training draws random windows (see ``TokenWindows``), as many as the trainer's ``max_steps`` asks for;
        set ``val_check_interval`` in steps, since an epoch is ~2**31 samples. Validation walks the fixed val
        windows in order. Loading runs in the main process (``num_workers=0``): a batch is one numpy gather.
        """

        def __init__(
            self,
            cfg: DataConfig,
            batch_size: int,
            seed: int,
            cache_dir: Path | str | None = None,
        ) -> None:
            super().__init__()
            if batch_size < 1:
                raise DataError(f"batch_size={batch_size} must be >= 1")
            self.cfg = cfg
            self.batch_size = batch_size
            self.seed = seed
            self.cache_dir = cache_dir
            self._corpus: Corpus | None = None

        @property
        def corpus(self) -> Corpus:
            """The loaded corpus (loads it on first access)."""
            if self._corpus is None:
                self._corpus = load_corpus(self.cfg, self.cache_dir)
            return self._corpus

        def setup(self, stage: str | None = None) -> None:
            """Loads the corpus once; later calls are no-ops."""
            _ = self.corpus

        def train_dataloader(self) -> DataLoader:
            """Endless-enough random windows; sharded by rank when a distributed trainer is attached."""
            trainer = getattr(self, "trainer", None)
            rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
            ds = TokenWindows(self.corpus.train, self.cfg.seq_len, seed=self.seed)
            sampler = ShardedBatchSampler(len(ds), self.batch_size, rank, world)
            return DataLoader(ds, batch_sampler=sampler, collate_fn=as_batch, num_workers=0)

        def val_dataloader(self) -> DataLoader:
            """The fixed validation windows, in order (the last batch may be smaller)."""
            ds = TokenWindows(self.corpus.val, self.cfg.seq_len)
            return DataLoader(ds, batch_size=self.batch_size, collate_fn=as_batch, num_workers=0)

    LMDataModule.__module__ = __name__
    LMDataModule.__qualname__ = "LMDataModule"  # pickle finds it through __getattr__
    return LMDataModule
