import dataclasses
from pathlib import Path

import pytest

from mixdepth.config import ConfigError, Shape, load_config, model_config
from mixdepth.flops import steps_for_budget, tokens_for_budget

CONF = Path(__file__).resolve().parents[1] / "conf"


def test_default_preset_is_typed_and_frozen():
    lab = load_config(CONF, "isoflop")
    assert lab.sweep.archs == ["dense", "mod", "moda", "mode", "mode_integrated"]
    assert len(lab.sweep.budgets) >= 3 and len(lab.sweep.ladder) >= 5
    assert isinstance(lab.sweep.ladder[0], Shape) and isinstance(lab.train.lr, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lab.train.lr = 1.0


def test_overrides_apply_to_sections_and_model_families():
    lab = load_config(
        CONF, "isoflop", ["train.lr=1e-3", "sweep.budgets=[2e11,4e11]", "model.qk_norm=true", "data.seq_len=64"]
    )
    assert lab.train.lr == 1e-3 and lab.sweep.budgets == [2e11, 4e11]
    m = model_config(lab, "dense", Shape(64, 2, 4, 2))
    assert m.qk_norm and m.seq_len == 64 and m.n_kv_heads == 2 and m.vocab_size == 256


@pytest.mark.parametrize(
    "override,needle",
    [
        ("train.lrr=1", "train.lrr"),
        ("sweep.foo=1", "sweep.foo"),
        ("model.n_expert=2", "model.n_expert"),
        ("model.capacity=1.5", "model.capacity"),
        ("train.lr=fast", "train.lr"),
        ("train.batch_size=1.5", "train.batch_size"),
        ("sweep.budgets=[0]", "sweep.budgets"),
        ("sweep.budgets=[-1e12]", "sweep.budgets"),
        ("sweep.archs=[nope]", "nope"),
        ("model.norm=side", "model.norm"),
        ("model.seq_len=64", "data.seq_len"),
        ("model.arch=mod", "sweep.archs"),
        ("novalue", "key=value"),
        ("sweep.seeds=0", "sweep.seeds"),
        ("sweep.max_extra=-1", "sweep.max_extra"),
        ("sweep.seed_budgets=[3e11]", "sweep.seed_budgets"),
    ],
)
def test_bad_overrides_name_the_key_in_one_line(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(CONF, "isoflop", [override])
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_seeds_stay_valid_train_seeds():
    assert load_config(CONF, "isoflop", ["train.seed=4294967294", "sweep.seeds=2"]).sweep.seeds == 2
    with pytest.raises(ConfigError, match=r"train.seed \+ sweep.seeds - 1 = 4294967296 must be below 2\*\*32"):
        load_config(CONF, "isoflop", ["train.seed=4294967294", "sweep.seeds=3"])


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset"):
        load_config(CONF, "nope")


def test_budget_arithmetic_uses_three_times_forward():
    assert tokens_for_budget(1e6, 3e12) == pytest.approx(1e6)
    assert steps_for_budget(1e6, 3e12, 1000) == 1000


def test_named_variants_layer_over_their_family():
    lab = load_config(CONF, "isoflop", ["sweep.archs=[mode,mode_integrated,mod_random]", "model.n_experts=2"])
    staged, integrated, rand = (model_config(lab, a, Shape(32, 2, 2)) for a in lab.sweep.archs)
    assert (staged.arch, staged.variant) == ("mode", "staged")
    assert (integrated.arch, integrated.variant, integrated.n_experts) == ("mode", "integrated", 2)
    assert (rand.arch, rand.routing, rand.capacity) == ("mod", "random", 0.125)
    with pytest.raises(ConfigError, match="listed twice|twice"):
        load_config(CONF, "isoflop", ["sweep.archs=[mod,mod]"])


def test_shapes_where_a_family_is_the_dense_model_are_left_out():
    from sweeps.plan import plan

    lab = load_config(CONF, "isoflop", ["sweep.archs=[dense,mod,moda]"])
    ladder = [Shape(16, 1, 2), Shape(32, 2, 2)]
    lab = dataclasses.replace(lab, sweep=dataclasses.replace(lab.sweep, ladder=ladder, budgets=[1e11]))
    trials, notes = plan(lab, "sid")
    assert sorted((t.arch, t.shape.n_layers) for t in trials) == [("dense", 1), ("dense", 2), ("mod", 2), ("moda", 2)]
    assert sum("the dense model; left out" in n for n in notes) == 2
    lab = dataclasses.replace(lab, sweep=dataclasses.replace(lab.sweep, ladder=ladder[:1]))
    with pytest.raises(ConfigError, match="no sweep.ladder shape suits mod"):
        plan(lab, "sid")


def test_max_steps_leaves_out_the_sizes_that_would_train_longer():
    """sweep.max_steps bounds the plan from the other side than min_steps: the smallest sizes at the largest budgets
    (far below the optimum) are left out with a note; a window no size fits is one line naming both keys."""
    from sweeps.plan import plan

    base = ["sweep.archs=[dense]", "sweep.budgets=[1e11,4e11]", "sweep.min_steps=1"]
    lab = load_config(CONF, "isoflop", base)
    full, _ = plan(lab, "sid")
    cap = sorted(t.steps for t in full)[-2]  # all but the longest run
    trials, notes = plan(load_config(CONF, "isoflop", [*base, f"sweep.max_steps={cap}"]), "sid")
    left = {t.run_id for t in full} - {t.run_id for t in trials}
    assert len(left) == 1 and max(t.steps for t in full if t.run_id in left) > cap
    assert all(t.steps <= cap for t in trials) and len(trials) == len(full) - 1
    assert sum(f"> sweep.max_steps={cap}, left out" in n for n in notes) == 1
    with pytest.raises(ConfigError, match="between sweep.min_steps=1 and sweep.max_steps=1 steps"):
        plan(load_config(CONF, "isoflop", [*base, "sweep.max_steps=1"]), "sid")


def test_bench_set_options_are_typed_like_overrides():
    from mixdepth.bench import step_options

    sets = ["mod.qk_norm=false", "mod.capacity=0.25", "mod.gate=sigmoid", "mod.route_every=3", "dense.qk_norm=true"]
    got = step_options("mod", sets)
    assert got == {"qk_norm": False, "capacity": 0.25, "gate": "sigmoid", "route_every": 3}
    assert got["qk_norm"] is False and step_options("dense", sets)["qk_norm"] is True
    assert type(step_options("mod", ["mod.capacity=1"])["capacity"]) is float
    with pytest.raises(ConfigError, match="model.capacity"):
        step_options("mod", ["mod.capacity=abc"])
    with pytest.raises(ConfigError, match="unknown config key 'model.capacityy'"):
        step_options("mod", ["mod.capacityy=0.5"])


def test_print_config_is_the_merged_typed_config_as_a_preset(tmp_path, monkeypatch, capsys):
    """``--print-config`` prints every section after the overrides, typed, with the storage password hidden, and
    opens nothing; printed back into a conf folder as a preset it loads to the same config."""
    import shutil

    from omegaconf import OmegaConf

    from sweeps.__main__ import main

    monkeypatch.chdir(tmp_path)
    over = ["train.lr=1e-3", "sweep.budgets=[2e11,4e11]", "model.qk_norm=true", "train.logger=csv"]
    assert main(["isoflop", "--print-config", *over, "sweep.storage=postgresql://me:s3cret@db/x"]) == 0
    out = capsys.readouterr().out
    assert "s3cret" not in out and "postgresql://me:***@db/x" in out and not list(tmp_path.iterdir())
    printed = OmegaConf.to_container(OmegaConf.create(out))
    assert printed["train"]["lr"] == 1e-3 and printed["sweep"]["budgets"] == [2e11, 4e11]
    assert printed["train"]["batch_size"] == 16 and printed["model"] == {"qk_norm": True}  # base.yaml, the preset

    assert main(["isoflop", "--print-config", *over]) == 0
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "sweep" / "printed.yaml").write_text(capsys.readouterr().out)
    assert load_config(conf, "printed").sections() == load_config(CONF, "isoflop", over).sections()


def test_loggers_are_checked_at_load_time_and_do_not_change_the_sweep():
    from sweeps.plan import sweep_id

    a = load_config(CONF, "isoflop")
    assert a.train.logger == "none"  # DuckDB is the record; a logger is the user's choice
    b = load_config(CONF, "isoflop", ["train.logger=tensorboard"])  # its package is checked where runs train
    assert sweep_id(a, "isoflop") == sweep_id(b, "isoflop")
    with pytest.raises(ConfigError, match="train.logger must be one of none, csv, tensorboard, wandb, mlflow"):
        load_config(CONF, "isoflop", ["train.logger=neptune"])


def test_the_installed_presets_are_the_conf_folder():
    """Without --conf the CLI reads the presets through importlib.resources (sweeps/conf: this checkout's conf/
    here, copies inside a wheel: tests/test_install.py)."""
    from sweeps.__main__ import _conf

    with _conf(None) as conf:
        files = sorted(p.relative_to(conf) for p in conf.rglob("*.yaml"))
        assert files == sorted(p.relative_to(CONF) for p in CONF.rglob("*.yaml")) and files
        assert all((conf / f).read_bytes() == (CONF / f).read_bytes() for f in files)
