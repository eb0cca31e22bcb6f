"""Sources: listing and reading what ``DataConfig.corpus`` names, and the train / held-out split.

Sources (``DataConfig.corpus``):

- ``"stdlib"`` (default, no download): the ``.py`` files of the running interpreter's standard library
  (``sysconfig.get_paths()["stdlib"]``) in sorted relative-path order. Skipped folders, see
  ``STDLIB_SKIP``: third-party code (``site-packages``), test suites (``test``, ``tests``, ``idle_test``),
  IDLE, lib2to3, turtledemo, ensurepip and ``encodings`` (generated codec tables, not prose or code).
- ``"site-packages"`` (no download): the ``.py`` files of the running interpreter's installed packages (every
  folder of ``site.getsitepackages()`` and sysconfig's purelib/platlib, sorted by path; ``__pycache__`` skipped):
  hundreds of MB on a machine with a deep-learning stack, for budgets where the standard library would repeat.
- a text file, a folder (every text file inside, recursively, sorted; hidden entries and ``__pycache__``
  skipped; a file is text when its first 8 KiB hold no NUL byte) or a glob (``data/*.txt``, ``**`` allowed).
- a pre-tokenised ``.bin`` memmap of ``bin_dtype`` ids below ``bin_vocab_size``.

Text is read in order up to ``max_bytes`` (the last file is cut at a UTF-8 boundary), decoded as UTF-8 with
``errors="replace"`` and concatenated without separators. With two files or more the split is by file: a file
is held out when ``sha1(relative path) mod 1000 < 1000 * val_fraction`` (so adding files never moves others),
forcing one file into each side if the rule left a side empty. A single file, and a ``.bin``, hold out their
tail instead. ``val`` is the first ``val_tokens`` tokens of the held-out part (0 = all of it); the rest of the
held-out part is unused, never trained on. ``max_bytes`` does not apply to ``.bin`` corpora.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import platform
import re
import site
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mixdepth.config import DataConfig, DataError

log = logging.getLogger(__name__)

STDLIB_SKIP = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "lib2to3", "turtledemo"}
    | {"ensurepip", "encodings", "__pycache__"}
)
BIN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_SNIFF = 8192  # bytes inspected for NUL to tell text from binary
_MAGIC = re.compile(r"[*?\[]")


def is_glob(corpus: str) -> bool:
    """Whether ``corpus`` is a glob pattern (``*``, ``?`` or ``[``)."""
    return bool(_MAGIC.search(corpus))


@dataclass(frozen=True)
class Doc:
    rel: str  # name relative to the corpus root, '/'-separated
    data: bytes  # raw bytes actually used (after the max_bytes cut)

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


# ---------------------------------------------------------------- text sources


def _walk(root: str, skip: frozenset[str], suffix: str | None) -> list[tuple[str, str]]:
    """(relative name, path) of entries under ``root``, no hidden entries or ``skip`` folders, sorted."""
    out: list[tuple[str, str]] = []
    cut = len(os.path.join(root, ""))
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in skip and not x.startswith(".") and not x.startswith("config-")]
        for f in files:
            if not f.startswith(".") and (suffix is None or f.endswith(suffix)):
                p = os.path.join(d, f)
                out.append((p[cut:].replace(os.sep, "/"), p))
    return sorted(out)


def _regular(src: str, files: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The regular files of a listing; the rest (FIFOs, sockets, devices, dangling links: a read of a FIFO would
    block forever) are skipped, and the log says which."""
    kept, skipped = [], []
    for rel, p in files:  # one stat per entry
        (kept.append((rel, p)) if os.path.isfile(p) else skipped.append(rel))
    if skipped:
        shown = ", ".join(skipped[:5]) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
        log.warning("data.corpus=%s: skipped %d entries that are not regular files: %s", src, len(skipped), shown)
    return kept


def _list_text_source(cfg: DataConfig) -> tuple[list[tuple[str, str]], bool, str]:
    """((relative name, path) of each file in order, skip binary files?, display name) of a text source."""
    src = cfg.corpus
    if src == "stdlib":
        root = sysconfig.get_paths()["stdlib"]
        return _regular(src, _walk(root, STDLIB_SKIP, ".py")), True, f"stdlib:python{platform.python_version()}"
    if src == "site-packages":
        paths = sysconfig.get_paths()
        roots = sorted({os.path.realpath(r) for r in (*site.getsitepackages(), paths["purelib"], paths["platlib"])})
        files = [(f"{root}/{rel}", p) for root in roots if os.path.isdir(root)
                 for rel, p in _walk(root, frozenset({"__pycache__"}), ".py")]  # fmt: skip
        if not files:
            raise DataError("data.corpus=site-packages: this interpreter has no installed packages' .py files")
        return _regular(src, files), True, f"site-packages:python{platform.python_version()}"
    expanded = os.path.expanduser(src)
    if is_glob(src):
        matches = [p for p in sorted(glob.glob(expanded, recursive=True)) if not os.path.isdir(p)]
        parts = Path(expanded).parts
        root = Path(*parts[: next(i for i, p in enumerate(parts) if _MAGIC.search(p))] or ".")
        files = _regular(src, [(Path(p).relative_to(root).as_posix(), p) for p in matches])
        if not files:
            raise DataError(f"data.corpus={src}: no files match the glob; check the pattern")
        return files, True, src
    if os.path.isdir(expanded):
        files = _regular(src, _walk(expanded, frozenset({"__pycache__"}), None))
        if not files:
            raise DataError(f"data.corpus={src}: folder holds no files; point it at a folder of text files")
        return files, True, src
    if os.path.isfile(expanded):
        return [(os.path.basename(expanded), expanded)], False, src
    if os.path.exists(expanded):
        raise DataError(f"data.corpus={src}: not a regular file (a FIFO, socket or device); give a file or folder")
    raise DataError(f"data.corpus={src}: no such file or folder; fix the path (or use 'stdlib')")


def read_docs(cfg: DataConfig) -> tuple[list[Doc], str]:
    """Reads the text source up to ``max_bytes``; empty and (in folders/globs) binary files are skipped."""
    files, skip_binary, name = _list_text_source(cfg)
    docs: list[Doc] = []
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
            docs.append(Doc(rel, data))
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


def split_docs(docs: list[Doc], val_fraction: float) -> tuple[list[Doc], list[Doc]]:
    """(train, held-out) documents: by file hash for >= 2 files, else the tail of the one file."""
    if len(docs) == 1:
        d = docs[0]
        cut = _utf8_prefix(d.data, int(len(d.data) * (1.0 - val_fraction)))
        return [Doc(d.rel + "#head", cut)], [Doc(d.rel + "#tail", d.data[len(cut) :])]
    keys = {d.rel: int.from_bytes(hashlib.sha1(d.rel.encode()).digest()[:8], "big") for d in docs}
    held = {d.rel for d in docs if keys[d.rel] % 1000 < val_fraction * 1000}
    if not held:  # too few files for the rule to pick one: hold out the lowest key
        held = {min(keys, key=keys.__getitem__)}
    if len(held) == len(docs):  # keep something to train on: the highest key trains
        held.discard(max(keys, key=keys.__getitem__))
    return [d for d in docs if d.rel not in held], [d for d in docs if d.rel in held]


# ---------------------------------------------------------------- .bin token memmaps


def open_bin(cfg: DataConfig, path: Path) -> np.memmap:
    """The ``.bin`` ids ``[N]`` as a copy-on-write memmap, after checking the file against the config."""
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
    return np.memmap(path, dtype=dtype, mode="c")  # copy-on-write: a stray write never reaches the file


def split_bin(cfg: DataConfig, arr: np.memmap) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val) of a ``.bin``: train a zero-copy view of the head, val the first ``val_tokens`` of the tail."""
    n_held = int(arr.size * cfg.val_fraction)
    n_val = cfg.val_tokens or n_held
    if n_held < n_val:
        raise DataError(
            f"data.corpus={cfg.corpus}: held-out tail has {n_held} tokens < data.val_tokens={cfg.val_tokens}; "
            f"lower data.val_tokens or raise data.val_fraction"
        )
    head = arr[: arr.size - n_held]
    train = torch.from_numpy(head.view(np.int32) if arr.dtype == np.uint32 else head)  # zero-copy, ids < 2**31
    val = torch.from_numpy(np.array(arr[head.size : head.size + n_val], dtype=np.int32))
    return train, val
