"""Typed, frozen configuration, resolved once from conf/ YAML and ``key=value`` overrides with omegaconf.

Layers, last wins: conf/base.yaml, conf/sweep/<preset>.yaml, command-line overrides. The ``model`` section
holds keys of the family configs (models/<family>.py) shared by the swept archs. ``load_config`` resolves
every entry of ``sweep.archs`` once into an ``ArchConfig``: its family defaults (conf/model/<family>.yaml)
with the shared ``model`` keys that the family knows. An arch name may also be a named variant:
conf/model/<name>.yaml with ``family: <family>`` layers its keys over that family's YAML (e.g.
mode_integrated, mod_random), so one sweep can hold several variants of a family. ``model_config`` adds a
ladder shape, ``data.seq_len`` and the tokenizer's vocabulary to give the family config of one grid point;
nothing after ``load_config`` reads YAML. Unknown keys and wrong types raise ConfigError with one line
naming the key.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mixdepth.models import MODELS

# Family-config fields that sweep.archs, the ladder, the data and the tokenizer set, never model.* or the YAML.
FIXED_KEYS = ("arch", "d_model", "n_layers", "n_heads", "n_kv_heads", "seq_len", "vocab_size")


class ConfigError(ValueError):
    """A bad configuration key or value, reported in one line."""


class DataError(ValueError):
    """A corpus cannot be used as configured; the one-line message names the key or path to change."""


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from and how they are split (plain types only: built from YAML).

    Attributes:
        corpus: ``"stdlib"``, ``"site-packages"``, a text file, a folder, a glob, or a ``.bin`` token memmap.
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


@dataclass(frozen=True)
class TrainConfig:
    batch_size: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_frac: float = 0.05  # share of steps for linear warmup (at least one step)
    warmup_steps: int = 0  # at least this many warmup steps, at most half the run's: a floor for short runs (0: none)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    accelerator: str = "auto"  # auto | cpu | gpu
    precision: str = "auto"  # auto: 32-true on CPU, bf16-mixed on GPU; or any Lightning precision string
    compile: bool = False  # torch.compile the model (GPU presets)
    compile_mode: str = "default"  # torch.compile mode: default | reduce-overhead (CUDA graphs) | max-autotune | ...
    compile_scope: str = "model"  # model: one graph of the whole forward | block: one per kind of block
    graph_step: bool = False  # one GPU: forward, backward and clipping replay one CUDA graph (mixdepth.graphs)
    peak_flops: float = 0.0  # FLOP/s assumed for MFU; 0: known-device table, else MFU is not reported
    log_every: int = 10  # steps between curve points
    threads: int = 0  # torch.set_num_threads on CPU; 0 leaves PyTorch's default
    progress: bool = True  # Lightning's progress bar (a sweep on a terminal shows its own bar instead)
    logger: str = "none"  # none | csv | tensorboard | wandb | mlflow: each run's Lightning logger (DuckDB: the record)
    devices: int = 1  # devices per node one run trains on (DDP/FSDP when devices * num_nodes > 1)
    num_nodes: int = 1  # nodes one run spans (launched by torchrun or srun)
    strategy: str = "auto"  # auto | ddp | fsdp: how a run spreads over devices * num_nodes
    ckpt_every: int | None = None  # steps between Lightning checkpoints of a run; None: no checkpoints
    ckpt_dir: str = ""  # checkpoint root, one folder per run_id; "": beside the database (workers: ./checkpoints)
    keep_ckpt: bool = False  # keep a run's final checkpoint once its row is stored (else its folder is removed)


@dataclass(frozen=True)
class Shape:
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int = 0  # 0: same as n_heads (multi-head attention)


@dataclass(frozen=True)
class SweepConfig:
    name: str = "isoflop"
    archs: list[str] = field(default_factory=lambda: ["dense"])
    budgets: list[float] = field(default_factory=lambda: [1e12])  # training FLOPs C per grid point
    ladder: list[Shape] = field(default_factory=list)  # model sizes tried at every budget
    min_steps: int = 20  # grid points that would train fewer steps are left out of the plan
    max_steps: int = 0  # grid points that would train more steps are left out (sizes far below the optimum); 0: none
    max_extra: int = 2  # sizes added per (arch, budget) whose isoFLOP vertex lies outside the sampled ones; 0: none
    seeds: int = 1  # each grid point trained with train.seed, train.seed + 1, ..., train.seed + seeds - 1
    seed_budgets: list[float] = field(default_factory=list)  # the budgets repeated with other seeds; []: all
    workers: int = 1  # runs trained at once in spawned processes (CPU: cores/workers threads each; GPU: see below)
    workers_per_gpu: int = 1  # GPU: workers that share one GPU (small runs side by side); sweep.workers in all
    mps: str = "auto"  # auto | always | never: NVIDIA MPS for workers sharing a GPU (sweeps/mps.py); auto: if it works
    retries: int = 1  # with workers > 1: a run whose worker dies (or whose fit raises) is tried 1 + retries times
    storage: str = ""  # Optuna storage URL of the work queue; "": the journal file beside the database
    heartbeat_interval: int = 60  # RDB storage: seconds between a running trial's heartbeats
    grace_period: int = 180  # RDB storage: seconds without a heartbeat after which a run is failed and queued again


@dataclass(frozen=True)
class ArchConfig:
    """One ``sweep.archs`` entry, resolved by ``load_config``.

    Attributes:
        name: the entry (e.g. ``mode_integrated``); runs are stored under it.
        family: its key in ``MODELS`` (e.g. ``mode``): the entry itself, or the ``family:`` of a variant YAML.
        keys: every field of the family config but ``FIXED_KEYS``, typed: the dataclass defaults, then the
            family YAML, the variant's YAML and the shared ``model.*`` keys the family knows.
    """

    name: str
    family: str
    keys: dict[str, Any]


@dataclass(frozen=True)
class Sections:
    """The sections that conf/ YAML and overrides set (the omegaconf schema)."""

    sweep: SweepConfig = field(default_factory=SweepConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    model: dict[str, Any] = field(default_factory=dict)  # family keys, checked against sweep.archs


@dataclass(frozen=True)
class LabConfig(Sections):
    """The merged sections and each ``sweep.archs`` entry resolved (derived: not part of any identity)."""

    archs: dict[str, ArchConfig] = field(default_factory=dict)

    def sections(self) -> dict[str, Any]:
        """The merged sections as plain data, without the derived ``archs`` (what sweep ids hash, sweeps store)."""
        d = dataclasses.asdict(self)
        del d["archs"]
        return d


def _one_line(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None) or getattr(e, "key", None)
    msg = str(e).strip().splitlines()[0]
    if "not in" in msg and key:
        return f"unknown config key '{key}'"
    return f"bad value for config key '{key}': {msg}" if key else msg


def _yaml(path: Path):
    try:
        return OmegaConf.load(path)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except Exception as e:  # yaml syntax errors
        raise ConfigError(f"cannot parse {path}: {str(e).splitlines()[0]}") from None


def _dotlist(overrides: list[str]):
    for o in overrides:
        if "=" not in o or o.startswith("="):
            raise ConfigError(f"override {o!r} is not key=value")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as e:
        raise ConfigError(_one_line(e)) from None


def _refuse_env(node: Any, key: str = "") -> None:
    """The stored config (database, sweep id) must say what ran: ``${oc.env:...}`` would store whatever the
    environment held, so it is refused; interpolations of other keys are fine."""
    if isinstance(node, dict):
        for k, v in node.items():
            _refuse_env(v, f"{key}.{k}" if key else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _refuse_env(v, f"{key}[{i}]")
    elif isinstance(node, str) and "oc.env" in node:
        raise ConfigError(f"config key '{key}' reads the environment ({node}); write the value itself")


def load_config(conf_dir: Path, preset: str = "isoflop", overrides: list[str] = ()) -> LabConfig:
    """Merge base.yaml, sweep/<preset>.yaml and overrides into a validated LabConfig with every arch resolved.

    Args:
        conf_dir: the config folder (base.yaml, sweep/, model/); read here and nowhere else.
        preset: ``conf_dir/sweep/<preset>.yaml``.
        overrides: ``key=value`` strings, applied last.

    Raises:
        ConfigError: one line naming the bad key, value, preset or file.
    """
    if not _is_name(preset):  # it begins the sweep id, which names the report folder
        raise ConfigError(f"preset {preset!r} must be {NAME_RULE}")
    preset_path = conf_dir / "sweep" / f"{preset}.yaml"
    if not preset_path.exists():
        names = sorted(p.stem for p in (conf_dir / "sweep").glob("*.yaml"))
        raise ConfigError(f"unknown preset {preset!r}; available: {', '.join(names)}")
    try:
        merged = OmegaConf.merge(
            OmegaConf.structured(Sections), _yaml(conf_dir / "base.yaml"), _yaml(preset_path), _dotlist(overrides)
        )
        _refuse_env(OmegaConf.to_container(merged, resolve=False))
        sections: Sections = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(_one_line(e)) from None
    lab = LabConfig(**{f.name: getattr(sections, f.name) for f in dataclasses.fields(Sections)})
    layers = {arch: _family_layers(conf_dir, arch) for arch in lab.sweep.archs}
    _validate(lab, [family for family, _ in layers.values()])
    archs = {}
    for arch in lab.sweep.archs:
        archs[arch] = _resolve(lab, arch, *layers[arch])
        _build(archs[arch], lab.sweep.ladder[0], lab.data)  # bad values fail now, before any training
    return dataclasses.replace(lab, archs=archs)


def _count(lo: int) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v >= lo), f"at least {lo}"


def _real(lo: float, hi: float = math.inf, *, open_lo: bool = False, open_hi: bool = False):
    """A finite number in [lo, hi] (ends open where asked)."""
    ok = lambda v: math.isfinite(v) and (v > lo if open_lo else v >= lo) and (v < hi if open_hi else v <= hi)  # noqa: E731
    if hi == math.inf:
        return ok, f"a finite number {'>' if open_lo else '>='} {lo:g}"
    return ok, f"in {'(' if open_lo else '['}{lo:g}, {hi:g}{')' if open_hi else ']'}"


NAME_RULE = "a name of letters, digits, '.', '_' and '-' (not a path)"


def _is_name(v: str) -> bool:
    return re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", v) is not None


def _one_of(*choices: str) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v in choices), f"one of {', '.join(choices)}"


# Lightning's precision settings that train here (auto: 32-true on CPU, bf16-mixed on GPU).
PRECISIONS = ("auto", "32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true")

# torch.compile's modes, and those that capture CUDA graphs (their outputs live in buffers the next replay overwrites).
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
COMPILE_SCOPES = ("model", "block")  # what torch.compile wraps: the whole forward, or each kind of block

# Every scalar field's range or choice, checked by load_config before any file is opened, and by load_corpus for
# data configs built in code: key -> (check, what the value must be).
RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "sweep.name": (_is_name, NAME_RULE),  # a label in the store and the reports, never a path
    "sweep.min_steps": _count(1),
    "sweep.max_steps": _count(0),
    "sweep.max_extra": _count(0),
    "sweep.seeds": _count(1),
    "sweep.workers": _count(1),
    "sweep.workers_per_gpu": _count(1),
    "sweep.mps": _one_of("auto", "always", "never"),
    "sweep.retries": _count(0),
    "sweep.heartbeat_interval": _count(1),
    "sweep.grace_period": _count(1),
    "data.tokenizer": _one_of("bytes", "bpe"),  # data/tokenizer.py
    "data.bpe_vocab_size": (lambda v: v > 256, "> 256 (the byte alphabet)"),
    "data.bin_dtype": _one_of("uint16", "uint32"),  # data/sources.py BIN_DTYPES
    "data.bin_vocab_size": _count(0),
    "data.max_bytes": _count(0),
    "data.val_fraction": _real(0, 1, open_lo=True, open_hi=True),
    "data.val_tokens": _count(0),
    "data.seq_len": _count(1),
    "train.batch_size": _count(1),
    "train.lr": _real(0, open_lo=True),
    "train.min_lr_ratio": _real(0, 1),
    "train.warmup_frac": _real(0, 1),
    "train.warmup_steps": _count(0),
    "train.weight_decay": _real(0),
    "train.beta1": _real(0, 1, open_hi=True),
    "train.beta2": _real(0, 1, open_hi=True),
    "train.grad_clip": _real(0),
    "train.seed": ((lambda v: 0 <= v < 2**32), "in [0, 2**32)"),
    "train.accelerator": _one_of("auto", "cpu", "gpu"),
    "train.precision": _one_of(*PRECISIONS),
    "train.compile_mode": _one_of(*COMPILE_MODES),
    "train.compile_scope": _one_of(*COMPILE_SCOPES),
    "train.peak_flops": _real(0),
    "train.log_every": _count(1),
    "train.threads": _count(0),
    "train.devices": _count(1),
    "train.num_nodes": _count(1),
    "train.strategy": _one_of("auto", "ddp", "fsdp"),
    "train.logger": _one_of("none", "csv", "tensorboard", "wandb", "mlflow"),
    "train.ckpt_every": ((lambda v: v is None or v >= 1), "at least 1 (or null: no checkpoints)"),
}


def check_rules(section: str, cfg: Any, error: type[Exception] = ConfigError) -> None:
    """Check the fields of one config section (``sweep``, ``data``, ``train``) against ``RULES``; one line."""
    for key, (ok, what) in RULES.items():
        name, _, field_name = key.partition(".")
        if name == section:
            value = getattr(cfg, field_name)
            if not ok(value):
                raise error(f"{key} must be {what}, got {value!r}")


FSDP_CPU = "train.strategy=fsdp needs GPUs (Lightning's FSDPStrategy refuses the CPU); use train.strategy=ddp"


def micro_batch(t: TrainConfig) -> int:
    """Sequences per rank per step: ``train.batch_size`` is the optimizer step's whatever the device count.

    Raises:
        ConfigError: the batch does not split evenly over ``devices * num_nodes`` ranks.
    """
    world = t.devices * t.num_nodes
    if t.batch_size % world:
        raise ConfigError(
            f"train.batch_size={t.batch_size} must split evenly over train.devices * train.num_nodes = "
            f"{t.devices} * {t.num_nodes} ranks"
        )
    return t.batch_size // world


def check_graph_step(t: TrainConfig, accelerator: str) -> None:
    """What ``train.graph_step`` needs: a GPU, one device, a compile mode without CUDA graphs of its own, no fp16
    loss scaling. ``accelerator``: the train config's (``auto`` passes) or the one resolved on the host.

    Raises:
        ConfigError: one line naming the key in conflict.
    """
    if not t.graph_step:
        return
    if accelerator == "cpu":
        raise ConfigError("train.graph_step=true captures CUDA graphs: it needs a GPU (train.accelerator=gpu)")
    if t.devices * t.num_nodes > 1:
        raise ConfigError("train.graph_step=true trains on one device (DDP's and FSDP's hooks are not captured)")
    if t.compile and t.compile_mode in CUDA_GRAPH_MODES:
        raise ConfigError(
            f"train.graph_step=true captures the whole step: train.compile_mode={t.compile_mode} captures graphs"
            " of its own; use default or max-autotune-no-cudagraphs"
        )
    if t.precision == "16-mixed":
        raise ConfigError("train.graph_step=true does not scale fp16 gradients; use train.precision=bf16-mixed")


def _validate(lab: LabConfig, families: list[str]) -> None:
    s = lab.sweep
    for section in ("sweep", "data", "train"):
        check_rules(section, getattr(lab, section))
    micro_batch(lab.train)
    check_graph_step(lab.train, lab.train.accelerator)
    if lab.train.strategy == "fsdp" and lab.train.accelerator == "cpu":  # auto: launch.check_devices, on the host
        raise ConfigError(FSDP_CPU)
    if not s.archs:
        raise ConfigError("sweep.archs is empty")
    if len(set(s.archs)) != len(s.archs):
        raise ConfigError(f"sweep.archs lists an arch twice: {list(s.archs)}")
    if not s.budgets:
        raise ConfigError("sweep.budgets is empty")
    for c in s.budgets:
        if not (c > 0 and math.isfinite(c)):
            raise ConfigError(f"sweep.budgets must be positive finite FLOP counts, got {c:g}")
    if len(set(s.budgets)) != len(s.budgets):
        raise ConfigError(f"sweep.budgets lists a budget twice (it would train each point twice): {list(s.budgets)}")
    for c in s.seed_budgets:
        if c not in s.budgets:
            raise ConfigError(f"sweep.seed_budgets lists {c:g}, which is not one of sweep.budgets {list(s.budgets)}")
    if lab.train.seed + s.seeds > 2**32:
        raise ConfigError(f"train.seed + sweep.seeds - 1 = {lab.train.seed + s.seeds - 1} must be below 2**32")
    if not s.ladder:
        raise ConfigError("sweep.ladder is empty")
    shapes = [(x.d_model, x.n_layers, x.n_heads, x.n_kv_heads or x.n_heads) for x in s.ladder]
    if len(set(shapes)) != len(shapes):
        raise ConfigError("sweep.ladder lists a shape twice (it would train each point twice)")
    known = {f.name for fam in families for f in dataclasses.fields(MODELS[fam][0])}
    for key in lab.model:
        if key not in known:
            raise ConfigError(f"unknown config key 'model.{key}' for archs {', '.join(s.archs)}")
        if key in FIXED_KEYS:
            where = {"arch": "sweep.archs", "seq_len": "data.seq_len", "vocab_size": "the tokenizer"}.get(key)
            raise ConfigError(f"config key 'model.{key}' is set by {where or 'sweep.ladder'}, not by model.*")


def vocab_size(data: DataConfig) -> int:
    """The model vocabulary implied by the data config (known before the corpus is read)."""
    if data.corpus.endswith(".bin"):
        return data.bin_vocab_size
    if data.tokenizer == "bpe":
        return data.bpe_vocab_size
    return 256


def _family_layers(conf_dir: Path, arch: str) -> tuple[str, list]:
    """The model family of a ``sweep.archs`` entry and its YAML layers (family file, then the variant's)."""
    path = conf_dir / "model" / f"{arch}.yaml"
    spec = _yaml(path) if path.exists() else OmegaConf.create()
    family = spec.pop("family", arch)
    if family not in MODELS:
        known = sorted({*MODELS, *(p.stem for p in (conf_dir / "model").glob("*.yaml"))})
        raise ConfigError(f"unknown arch {arch!r} in sweep.archs; known: {', '.join(known)}")
    if family == arch:
        return family, [spec]
    base = conf_dir / "model" / f"{family}.yaml"
    return family, [_yaml(base) if base.exists() else OmegaConf.create(), spec]


def _typed_keys(family: str, *layers) -> dict[str, Any]:
    """The family config's fields after merging ``layers`` over its defaults, converted to the field types."""
    try:
        return OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(MODELS[family][0]), *layers))
    except OmegaConfBaseException as e:
        raise ConfigError(_one_line(e).replace("config key '", "config key 'model.")) from None


def _resolve(lab: LabConfig, arch: str, family: str, yamls: list) -> ArchConfig:
    """The typed family keys of ``arch``: dataclass defaults, family (and variant) YAML, shared model keys."""
    names = {f.name for f in dataclasses.fields(MODELS[family][0])}
    shared = OmegaConf.create({k: v for k, v in lab.model.items() if k in names})
    keys = _typed_keys(family, *yamls, shared)
    return ArchConfig(arch, family, {k: v for k, v in keys.items() if k not in FIXED_KEYS})


def model_config(lab: LabConfig, arch: str, shape: Shape):
    """The family config of ``arch`` at ``shape``: its resolved keys, the shape, ``data.seq_len``, the vocab.

    Raises:
        ConfigError: ``arch`` is not a resolved ``sweep.archs`` entry, or the family rejects the shape.
    """
    if arch not in lab.archs:
        raise ConfigError(f"arch {arch!r} is not one of the archs load_config resolved: {', '.join(lab.archs)}")
    return _build(lab.archs[arch], shape, lab.data)


def _build(a: ArchConfig, shape: Shape, data: DataConfig):
    fixed = {
        "arch": a.family,
        "d_model": shape.d_model,
        "n_layers": shape.n_layers,
        "n_heads": shape.n_heads,
        "n_kv_heads": shape.n_kv_heads or shape.n_heads,
        "seq_len": data.seq_len,
        "vocab_size": vocab_size(data),
    }
    try:
        return MODELS[a.family][0](**a.keys, **fixed)
    except ValueError as e:  # the family's own shape checks
        raise ConfigError(str(e)) from None


def model_options(family: str, overrides: list[str]) -> dict[str, Any]:
    """``key=value`` strings as typed values of the family config's fields (booleans, numbers, strings).

    Raises:
        ConfigError: a key the family lacks or a value of the wrong type, in one line.
    """
    if family not in MODELS:
        raise ConfigError(f"unknown model family {family!r}; known: {', '.join(MODELS)}")
    given = _dotlist(overrides)
    keys = _typed_keys(family, given)
    return {k: keys[k] for k in given}


def train_overrides(overrides: list[str], allowed: tuple[str, ...]) -> dict[str, Any]:
    """``train.key=value`` strings as typed, checked values of ``allowed`` TrainConfig fields (a worker's own
    hardware and checkpoint settings over a queued run's).

    Raises:
        ConfigError: another section, a key outside ``allowed``, a bad value; in one line.
    """
    given = OmegaConf.to_container(_dotlist(overrides))
    for section, keys in given.items():
        if section != "train" or not isinstance(keys, dict):
            raise ConfigError(f"only train.* keys can be set here, not {section!r}")
        for key in keys:
            if key not in allowed:
                raise ConfigError(
                    f"train.{key} cannot be set here (it is part of the run); allowed: {', '.join(allowed)}"
                )
    try:
        train = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), given.get("train", {})))
    except OmegaConfBaseException as e:
        raise ConfigError(_one_line(e)) from None
    check_rules("train", train)
    return {k: getattr(train, k) for k in given.get("train", {})}
