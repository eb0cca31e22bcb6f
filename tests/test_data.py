"""Corpora (embedded stdlib, text file/folder/glob, .bin), BPE, fingerprints, errors, windows, data module."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mixdepth.config import DataConfig, DataError
from mixdepth.data import ShardedBatchSampler, TokenWindows, as_batch, cache_root, load_corpus

SRC = Path(__file__).resolve().parents[1] / "src"
SMALL = DataConfig(max_bytes=200_000, val_tokens=1024, seq_len=32)
WORDS = "alpha beta gamma delta épsilon zeta eta theta iota kappa lambda mu".split()


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MIXDEPTH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _text(seed: int, n_words: int = 1500) -> str:
    rng = np.random.default_rng(seed)
    lines = [" ".join(rng.choice(WORDS, size=12)) for _ in range(n_words // 12)]
    return "\n".join(lines) + "\n"


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """Six text files (one nested), plus a hidden, an empty and a binary file that must be skipped."""
    d = tmp_path / "texts"
    (d / "sub").mkdir(parents=True)
    for i, name in enumerate(["a.txt", "b.txt", "c.txt", "d.txt", "e.txt", "sub/f.md"]):
        (d / name).write_text(_text(i), encoding="utf-8")
    (d / ".hidden.txt").write_text(_text(9))
    (d / "empty.txt").write_text("")
    (d / "blob.dat").write_bytes(b"\0\1\2" * 100)
    return d


def _cfg(corpus: str | Path, **kw) -> DataConfig:
    return DataConfig(corpus=str(corpus), **{"val_tokens": 256, "seq_len": 16, **kw})


def test_stdlib_corpus_is_deterministic_and_split_by_file(cache: Path, tmp_path: Path) -> None:
    c = load_corpus(SMALL)
    assert c.name.startswith("stdlib:python") and c.vocab_size == 256 and len(c.fingerprint) == 16
    assert c.train.dtype == torch.int32 and c.val.shape == (1024,) and c.train.numel() > 50_000
    assert (cache / f"corpus-{c.fingerprint}" / "train.npy").is_file()
    assert c.val_files and c.train_files and not set(c.val_files) & set(c.train_files)
    assert not any(f.split("/")[0] in {"test", "site-packages", "idlelib"} for f in c.train_files)
    first_val = Path(os.path.dirname(os.__file__), c.val_files[0]).read_text(encoding="utf-8")
    assert first_val.startswith(c.decode(c.val[:200]))  # val is the start of the first held-out file
    warm = load_corpus(SMALL)
    assert warm.fingerprint == c.fingerprint
    assert torch.equal(warm.train, c.train) and torch.equal(warm.val, c.val)
    code = (
        f"import sys; sys.path.insert(0, {str(SRC)!r}); from mixdepth.config import DataConfig; "
        f"from mixdepth.data import load_corpus; "
        f"print(load_corpus(DataConfig(max_bytes=200_000, val_tokens=1024, seq_len=32)).fingerprint)"
    )
    env = {**os.environ, "MIXDEPTH_CACHE": str(tmp_path / "other_cache")}  # cold build in another process
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == c.fingerprint


def test_corrupt_cache_is_rebuilt(cache: Path) -> None:
    c = load_corpus(SMALL)
    (cache / f"corpus-{c.fingerprint}" / "train.npy").write_bytes(b"garbage")
    again = load_corpus(SMALL)
    assert torch.equal(again.train, c.train)
    (cache / f"corpus-{c.fingerprint}" / "meta.json").unlink()
    assert torch.equal(load_corpus(SMALL).val, c.val)


def test_cache_root_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cache_root(tmp_path / "x") == tmp_path / "x"
    monkeypatch.delenv("MIXDEPTH_CACHE")
    assert cache_root() == Path("~/.cache/mixdepth").expanduser()


def test_text_folder_glob_and_single_file(folder: Path, tmp_path: Path) -> None:
    c = load_corpus(_cfg(folder))
    names = {"a.txt", "b.txt", "c.txt", "d.txt", "e.txt", "sub/f.md"}
    assert set(c.train_files) | set(c.val_files) == names and not set(c.train_files) & set(c.val_files)
    assert c.val_files and c.val.numel() == 256
    assert (folder / c.val_files[0]).read_text(encoding="utf-8").startswith(c.decode(c.val))

    moved = tmp_path / "moved"
    shutil.copytree(folder, moved)
    assert load_corpus(_cfg(moved)).fingerprint == c.fingerprint  # content, not location

    g = load_corpus(_cfg(f"{folder}/*.txt"))
    assert set(g.train_files) | set(g.val_files) == names - {"sub/f.md"}
    assert load_corpus(_cfg(f"{folder}/**/*.md", val_tokens=64)).train_files == ("sub/f.md#head",)

    text = (folder / "a.txt").read_text(encoding="utf-8")
    f = load_corpus(_cfg(folder / "a.txt"))
    assert f.train_files == ("a.txt#head",) and f.val_files == ("a.txt#tail",)
    n_head = f.train.numel()
    assert f.decode(f.train) == text.encode()[:n_head].decode()
    assert text.encode()[n_head:].decode().startswith(f.decode(f.val))


def test_fingerprint_tracks_content_and_split_keys(folder: Path) -> None:
    base = load_corpus(_cfg(folder)).fingerprint
    path = folder / "c.txt"
    original = path.read_text(encoding="utf-8")
    path.write_text(original.replace("alpha", "ALPHA", 1), encoding="utf-8")
    assert load_corpus(_cfg(folder)).fingerprint != base
    path.write_text(original, encoding="utf-8")
    assert load_corpus(_cfg(folder)).fingerprint == base
    assert load_corpus(_cfg(folder, max_bytes=30_000)).fingerprint != base
    assert load_corpus(_cfg(folder, val_tokens=128)).fingerprint != base
    assert load_corpus(_cfg(folder, val_fraction=0.3)).fingerprint != base


@pytest.mark.parametrize("dtype,offset", [("uint16", 0), ("uint32", 70_000)])
def test_bin_memmap_round_trip(tmp_path: Path, dtype: str, offset: int) -> None:
    arr = (np.arange(10_000) + offset).astype(dtype)
    path = tmp_path / "tokens.bin"
    arr.tofile(path)
    cfg = _cfg(path, bin_dtype=dtype, bin_vocab_size=offset + 10_000, val_tokens=500)
    c = load_corpus(cfg)
    assert c.vocab_size == offset + 10_000 and c.val.dtype == torch.int32
    assert np.array_equal(c.train.numpy(), arr[:9000]) and np.array_equal(c.val.numpy(), arr[9000:9500])
    assert load_corpus(cfg).fingerprint == c.fingerprint  # second load uses the memoised hash
    x, y = TokenWindows(c.train, 16, seed=0).__getitems__(list(range(8)))
    assert x.dtype == torch.int64 and torch.equal(y, x + 1)  # consecutive ids: y is x shifted
    arr[5] += 1
    arr.tofile(path)
    assert load_corpus(cfg).fingerprint != c.fingerprint


def test_bpe_trains_round_trips_and_fingerprints(folder: Path, cache: Path) -> None:
    cfg = _cfg(folder, tokenizer="bpe", bpe_vocab_size=300)
    c = load_corpus(cfg)
    assert c.vocab_size == 300 and int(c.train.max()) < 300
    assert c.fingerprint != load_corpus(_cfg(folder)).fingerprint
    text = "def f(x):\n\treturn 'héllo  wörld' + 😀  \r\n"
    assert c.decode(c.encode(text)) == text
    assert list(cache.glob("bpe-*.json"))
    assert load_corpus(cfg).fingerprint == c.fingerprint
    # The BPE sees only the train split: editing a held-out file changes the data, not the tokenizer.
    val_file = folder / c.val_files[0]
    val_file.write_text(val_file.read_text(encoding="utf-8") + "zzz\n", encoding="utf-8")
    edited = load_corpus(cfg)
    assert edited.tokenizer.identity == c.tokenizer.identity and edited.fingerprint != c.fingerprint


def _error_cases(tmp_path: Path) -> dict[str, tuple[DataConfig, str]]:
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "tiny.txt").write_text("just a few words\n")
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "t.bin")
    bin_path = str(tmp_path / "t.bin")
    return {
        "missing": (_cfg(tmp_path / "nope.txt"), "nope.txt"),
        "empty folder": (_cfg(tmp_path / "empty_dir"), "empty_dir"),
        "glob no match": (_cfg(f"{tmp_path}/*.xyz"), "*.xyz"),
        "empty file": (_cfg(tmp_path / "empty.txt"), "empty.txt"),
        "too small": (_cfg(tmp_path / "tiny.txt", val_tokens=0), "seq_len"),
        "val too small": (_cfg(tmp_path / "tiny.txt", seq_len=2, val_tokens=100), "val_tokens"),
        "bad dtype": (_cfg(bin_path, bin_dtype="int8", bin_vocab_size=100), "bin_dtype"),
        "vocab 0": (_cfg(bin_path), "bin_vocab_size"),
        "id >= vocab": (_cfg(bin_path, bin_vocab_size=50), "bin_vocab_size"),
        "unknown tokenizer": (_cfg(tmp_path / "tiny.txt", tokenizer="sentencepiece"), "tokenizer"),
        "bpe vocab": (_cfg(tmp_path / "tiny.txt", tokenizer="bpe", bpe_vocab_size=100), "bpe_vocab_size"),
    }


def test_errors_are_one_line_data_errors(tmp_path: Path) -> None:
    for case, (cfg, needle) in _error_cases(tmp_path).items():
        with pytest.raises(DataError) as info:
            load_corpus(cfg)
        msg = str(info.value)
        assert isinstance(info.value, ValueError) and "\n" not in msg, case
        assert needle in msg, (case, msg)


def test_windows_are_seeded_per_sample_and_cover_val() -> None:
    c = load_corpus(SMALL)
    T = SMALL.seq_len
    ds = TokenWindows(c.train, T, seed=3)
    x, y = ds.__getitems__(list(range(8)))
    assert x.shape == y.shape == (8, T) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    s = int(ds.starts(np.array([5]))[0])
    assert torch.equal(x[5], c.train[s : s + T].long())
    assert torch.equal(y[5], c.train[s + 1 : s + T + 1].long())
    assert torch.equal(ds.__getitems__([0, 1, 2, 3])[0], x[:4])  # independent of batch composition
    assert torch.equal(ds[6][1], y[6])
    starts = ds.starts(np.arange(100_000))
    assert starts.min() >= 0 and starts.max() <= c.train.numel() - T - 1
    assert not torch.equal(TokenWindows(c.train, T, seed=4).__getitems__(list(range(8)))[0], x)

    val = TokenWindows(c.val, T)
    assert len(val) == (1024 - 1) // T
    vx, vy = val.__getitems__(list(range(len(val))))
    assert torch.equal(vx.flatten(), c.val[: len(val) * T].long())
    assert torch.equal(vy.flatten(), c.val[1 : len(val) * T + 1].long())

    one = [b for b in ShardedBatchSampler(64, 4, 0, 1)]
    two = [ShardedBatchSampler(64, 2, r, 2) for r in range(2)]
    assert [a + b for a, b in zip(*two, strict=True)] == one and len(one) == 16


def test_datamodule_batches() -> None:
    from mixdepth.lit import LMDataModule

    def batches(seed: int, n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
        dm = LMDataModule(SMALL, batch_size=4, seed=seed)
        dm.setup("fit")
        it = iter(dm.train_dataloader())
        return [next(it) for _ in range(n)]

    a, b, other = batches(0), batches(0), batches(1)
    for (x, y), (x2, y2) in zip(a, b, strict=True):
        assert x.shape == (4, SMALL.seq_len) and x.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(x, x2) and torch.equal(y, y2)
    assert not all(torch.equal(p[0], q[0]) for p, q in zip(a, other, strict=True))

    dm = LMDataModule(SMALL, batch_size=8, seed=0)
    dm.setup()
    first, second = list(dm.val_dataloader()), list(dm.val_dataloader())
    assert [v[0].shape[0] for v in first] == [8, 8, 8, 7]  # 31 windows of 32 tokens from 1024
    for p, q in zip(first, second, strict=True):
        assert torch.equal(p[0], q[0]) and torch.equal(p[1], q[1])
    assert torch.equal(torch.cat([v[0] for v in first]).flatten(), dm.corpus.val[: 31 * 32].long())
    assert as_batch(first[0]) is first[0]
    assert dataclasses.is_dataclass(dm.corpus)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_only_regular_files_are_read(folder: Path, tmp_path: Path) -> None:
    """A FIFO (or socket, device, dangling link) in a corpus folder or glob is skipped, and the log names it: a read
    would block forever. Given as the corpus itself it is a one-line DataError. (In a subprocess with a timeout, so
    that a regression hangs no test run.)"""
    os.mkfifo(folder / "pipe.txt")
    (folder / "dangling.txt").symlink_to(tmp_path / "gone.txt")
    code = (
        "import logging, sys; logging.basicConfig(level=logging.WARNING, stream=sys.stdout)\n"
        "from mixdepth.config import DataConfig, DataError\n"
        "from mixdepth.data import load_corpus\n"
        f"c = load_corpus(DataConfig(corpus={str(folder)!r}, val_tokens=0, seq_len=8))\n"
        "print('files', sorted(c.train_files + c.val_files))\n"
        f"g = load_corpus(DataConfig(corpus={str(folder / '*.txt')!r}, val_tokens=0, seq_len=8))\n"
        "print('glob', sorted(g.train_files + g.val_files))\n"
        "try:\n"
        f"    load_corpus(DataConfig(corpus={str(folder / 'pipe.txt')!r}, seq_len=8))\n"
        "except DataError as e:\n"
        "    print('error', e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert sum("skipped 2 entries that are not regular files: dangling.txt, pipe.txt" in ln for ln in out) == 2
    files = next(ln for ln in out if ln.startswith("files"))
    assert "pipe.txt" not in files and "dangling.txt" not in files and ".txt" in files
    glob_files = next(ln for ln in out if ln.startswith("glob"))
    assert "pipe.txt" not in glob_files and "dangling.txt" not in glob_files and "a.txt" in glob_files
    assert any(ln.startswith("error") and "not a regular file" in ln for ln in out)


def test_training_batches_are_pinned_for_a_gpu_trainer() -> None:
    """Lightning copies batches to a GPU with non_blocking=True: from pinned memory that copy does not wait for the
    stream, so the host queues the next step while the GPU runs this one. On a CPU nothing is pinned."""
    from types import SimpleNamespace

    from mixdepth.lit import LMDataModule

    dm = LMDataModule(SMALL, batch_size=4, seed=0)
    dm.setup("fit")
    assert dm.train_dataloader().pin_memory is False  # no trainer: the CPU
    for device, pinned in (("cuda", True), ("cpu", False)):
        strategy = SimpleNamespace(root_device=torch.device(device))
        dm.trainer = SimpleNamespace(global_step=0, global_rank=0, world_size=1, strategy=strategy)
        assert dm.train_dataloader().pin_memory is pinned


def test_site_packages_corpus_reads_the_installed_packages_sources(cache: Path) -> None:
    """The installed packages' .py files, in path order (numpy is installed wherever mixdepth runs)."""
    import site
    import sysconfig

    c = load_corpus(DataConfig(corpus="site-packages", max_bytes=3_000_000, val_tokens=1024, seq_len=32))
    assert c.name.startswith("site-packages:python") and c.vocab_size == 256
    files = c.train_files + c.val_files
    assert files and all(f.endswith(".py") and "__pycache__" not in f for f in files)
    roots = {os.path.realpath(r) for r in (*site.getsitepackages(), sysconfig.get_paths()["purelib"])}
    assert all(any(f.startswith(r + "/") for r in roots) for f in files)
    assert Path(files[0]).read_bytes()[:100].decode("utf-8", "replace")  # the names are the files' paths
    assert (
        load_corpus(DataConfig(corpus="site-packages", max_bytes=3_000_000, val_tokens=1024, seq_len=32)).fingerprint
        == c.fingerprint
    )
    assert c.train.numel() + 1024 <= 3_000_000
