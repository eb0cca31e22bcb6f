"""The on-disk cache of tokenised corpora and trained BPEs, and the fingerprint that keys it.

The fingerprint hashes what determines the tokens: tokenizer identity (BPE: vocab and merges), the ordered
(relative name, sha256, side) list of the text actually read or the ``.bin`` bytes hash, and the split keys.
Tokenised corpora are cached under ``$MIXDEPTH_CACHE`` (default ``~/.cache/mixdepth``) as
``corpus-<fingerprint>/{train,val}.npy``; a trained BPE as ``bpe-<key>.json`` beside them. An unreadable cache
entry is rebuilt. The text is re-read and re-hashed on every load (tens of ms for the default 4 MB), so a
changed file can never be served stale tokens; ``.bin`` hashes are memoised by (size, mtime, ctime, inode).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from mixdepth.data.sources import Doc
from mixdepth.data.tokenizer import BPETokenizer, Tokenizer, TokenizerError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump when the split rule, text assembly or cache layout changes


def cache_root(cache_dir: Path | str | None = None) -> Path:
    """The cache folder: ``cache_dir`` if given, else ``$MIXDEPTH_CACHE``, else ``~/.cache/mixdepth``."""
    if cache_dir is None:
        cache_dir = os.environ.get("MIXDEPTH_CACHE") or "~/.cache/mixdepth"
    return Path(cache_dir).expanduser()


def fingerprint(payload: dict) -> str:
    """16 hex chars of sha256 over ``payload`` and ``FORMAT_VERSION`` (canonical JSON)."""
    blob = json.dumps({"format": FORMAT_VERSION, **payload}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def atomic_write(path: Path, blob: bytes) -> None:
    """Write-then-rename so concurrent readers never see half a file; an unwritable cache is skipped."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("cannot write cache file %s (%s); continuing without it", path, e)


def cached_bpe(vocab_size: int, train_docs: list[Doc], root: Path) -> BPETokenizer:
    """The BPE of ``vocab_size`` trained on ``train_docs``: read from ``bpe-<key>.json``, else trained and written."""
    key = fingerprint({"bpe": vocab_size, "train": [[d.rel, d.digest] for d in train_docs]})
    path = root / f"bpe-{key}.json"
    if path.is_file():
        try:
            return BPETokenizer.from_json(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, TokenizerError) as e:
            log.warning("rebuilding unreadable BPE cache %s (%s)", path, e)
    t0 = time.perf_counter()
    tok = BPETokenizer.train((d.text for d in train_docs), vocab_size)
    log.info("trained BPE vocab %d in %.1fs", tok.vocab_size, time.perf_counter() - t0)
    atomic_write(path, tok.to_json().encode("utf-8"))
    return tok


def read_cache(entry: Path, fp: str, vocab_size: int) -> tuple[np.ndarray, np.ndarray] | None:
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


def write_cache(
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


def bin_stats(path: Path, arr: np.ndarray, root: Path) -> tuple[str, int]:
    """(sha256 of the file, max token id), memoised in ``binstat-<path hash>.json`` by size/mtime/ctime/inode."""
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
    atomic_write(memo, json.dumps({"stamp": stamp, "sha256": digest, "max": top}).encode())
    return digest, top
