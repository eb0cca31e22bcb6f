"""analysis publish: one sweep's rows as Parquet with its provenance, read back by every command as if the store."""

import datetime as dt
import json
import shutil

import duckdb
import pytest

from analysis.__main__ import main
from analysis.pipeline import OUTPUT_NAMES
from analysis.synthetic import fake_runs
from mixdepth.results import SHAPE_KEY, add_run, add_sweep, connect, put_alone_rate, put_usage
from mixdepth.usage import PARTS

PROVENANCE = {"planned": 30, "version": "0.9", "commit": "abc1234", "command": "python3 -m sweeps isoflop --preset x"}


def usage_row(started, wall=100.0, flops=1e16, runs=4, util=0.101, commit=None, command=None, **parts) -> dict:
    """One command's ``sweep_usage`` row of sweep s1 on one GPU under MPS, its parts equal; ``parts``: more of them
    (``stopped``, ``interrupted``)."""
    return {
        "sweep_id": "s1", "started_at": started, "wall_s": wall, "gpus": 1, "peak_flops": 9.895e14,
        "train_flops": flops, "runs": runs, "utilisation": util,
        "parts": {**dict.fromkeys(PARTS, wall / len(PARTS)), "sharing": "mps", **parts},
        "commit": commit, "command": command,
    }  # fmt: skip


@pytest.fixture
def store(tmp_path):
    db = tmp_path / "results.db"
    con = connect(db)
    add_sweep(con, "s1", "iso", "isoflop_h200", {"sweep": {"budgets": [1e15]}}, PROVENANCE)
    add_sweep(con, "other", "iso", "isoflop", {}, {})
    budgets = (1e15, 1e16, 1e17)
    for arch, scale in (("dense", 1.0), ("mod", 0.6)):
        for row in fake_runs("s1", arch, budgets=budgets, sizes_per_budget=5, flops_scale=scale):
            rate = 1e6 / scale**1.3  # tokens/s: MoD's cheaper tokens run faster than their FLOPs alone say
            row |= {"device": "NVIDIA H200", "precision": "bf16-mixed", "versions": {"torch": "2.11.0"},
                    "tokens_per_s": rate, "wall_s": 5.0 + row["tokens"] / rate,
                    "config": {"model": {"arch": arch, "n": row["params_nonembed"]}}}  # fmt: skip
            add_run(con, row, [{"step": s, "tokens": 10 * s, "flops": 1.0 * s, "train_loss": 5.0 / s, "lr": 1e-3}
                               for s in (1, 2)])  # fmt: skip
    for row in fake_runs("other", "dense", budgets=(1e15,), sizes_per_budget=3):
        add_run(con, row, [{"step": 1, "tokens": 10, "flops": 1.0, "train_loss": 5.0, "lr": 1e-3}])
    for shape, arch in con.execute(f"SELECT DISTINCT {SHAPE_KEY}, arch FROM runs WHERE sweep_id = 's1'").fetchall():
        put_alone_rate(con, {"sweep_id": "s1", "shape": shape, "arch": arch, "steps": 100, "tokens_per_s": 4e6,
                             "device": "NVIDIA H200"})  # fmt: skip
    put_usage(con, usage_row(dt.datetime(2026, 12, 2, 17, 39), 300.0, 4e16, 30, 0.133))
    con.close()
    return db


def test_publish_writes_the_sweeps_rows_and_its_provenance(store, tmp_path, capsys):
    out = tmp_path / "published"
    assert main(["publish", "--db", str(store), "--sweep", "s1", "--out", str(out)]) == 0
    assert capsys.readouterr().out == (
        f"published sweep s1 to {out}: 1 sweeps, 30 runs, 60 curves, 1 sweep_usage, 30 alone_rates\n"
    )
    count = lambda t: duckdb.sql(f"SELECT count(*) FROM '{out / t}.parquet'").fetchall()[0][0]  # noqa: E731
    assert [count(t) for t in ("sweeps", "runs", "curves", "sweep_usage", "alone_rates")] == [1, 30, 60, 1, 30]
    assert duckdb.sql(f"SELECT DISTINCT sweep_id FROM '{out}/runs.parquet'").fetchall() == [("s1",)]
    readme = (out / "README.md").read_text()
    for fact in ("# Sweep s1", "Preset `isoflop_h200`", "commit abc1234", "`python3 -m sweeps isoflop --preset x`",
                 "| NVIDIA H200 | bf16-mixed | torch 2.11.0 | 30 |", "--db {this folder} --sweep s1"):  # fmt: skip
        assert fact in readme, fact


def test_every_reading_command_takes_the_folder_as_the_store(store, tmp_path, capsys):
    out = tmp_path / "published"
    assert main(["publish", "--db", str(store), "--sweep", "s1", "--out", str(out)]) == 0
    for db, report in ((store, tmp_path / "from_db"), (out, tmp_path / "from_files")):
        assert main(["report", "--db", str(db), "--sweep", "s1", "--out", str(report)]) == 0
    original = json.loads((tmp_path / "from_db" / "fits.json").read_text())
    assert json.loads((tmp_path / "from_files" / "fits.json").read_text()) == original
    assert original["archs"][0]["isoflop"]["n_opt"] is not None  # a real fit was compared
    text = (tmp_path / "from_files" / "report.md").read_text()
    assert "abc1234" in text and "13.3%" in text  # provenance and the stored utilisation came along
    assert "steady rate trained alone on the device" in text  # and the rates alone
    old = tmp_path / "old_folder"  # published before the table existed
    shutil.copytree(out, old)
    (old / "alone_rates.parquet").unlink()
    assert main(["report", "--db", str(old), "--sweep", "s1", "--out", str(tmp_path / "old")]) == 0
    assert "**These runs shared a GPU**" in (tmp_path / "old" / "report.md").read_text()
    capsys.readouterr()
    assert main(["query", "--db", str(out), "SELECT count(*) AS n FROM frontier"]) == 0
    assert "6" in capsys.readouterr().out  # 2 archs x 3 budgets: the views work on the loaded rows


def test_a_published_folder_is_read_only(store, tmp_path, capsys):
    out = tmp_path / "published"
    assert main(["publish", "--db", str(store), "--sweep", "s1", "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert main(["report", "--db", str(out), "--out", str(tmp_path / "r"), "--store"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: {out} is a published sweep (read-only): fits are not stored there; drop --store"]
    assert main(["fit", "--db", str(out)]) == 1
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_folder_that_is_not_a_published_sweep(tmp_path, capsys):
    (tmp_path / "runs.parquet").write_text("not parquet")
    assert main(["report", "--db", str(tmp_path), "--out", str(tmp_path / "r")]) == 1
    assert capsys.readouterr().err.splitlines() == [f"error: database {tmp_path} is not a file"]


def test_the_report_shows_the_runs_against_time(store, tmp_path):
    """The time-matched view: seconds per PFLOP against dense's, each arch's best loss with its time, the figure;
    each run at its shape's rate alone where measured, else at its own rate with a warning when the GPU was shared."""

    def section(out):
        assert main(["report", "--db", str(store), "--sweep", "s1", "--out", str(out)]) == 0
        text = (out / "report.md").read_text()
        part = text[text.index("## Time-matched view") :].split("\n## ")[0]
        rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in part.splitlines() if line[:2] == "| "}
        return text, part, rows

    text, part, rows = section(tmp_path / "alone")
    assert "trained alone on the device" in part and "shared a GPU" not in part
    assert rows["mod"][3] == "1.000" and rows["mod"][1] == "15"  # every shape at 4e6 tokens/s alone
    con = connect(store)
    con.execute("DELETE FROM alone_rates")
    con.close()
    text, part, rows = section(tmp_path / "r")
    assert "**These runs shared a GPU**" in part  # the stored usage says the runs shared it under MPS
    # the same tokens and training FLOPs per (budget, N) for both archs (fake_runs), MoD at 0.6**-1.3 x dense's rate
    assert float(rows["mod"][3]) == pytest.approx(0.6**1.3, abs=1e-3) and rows["dense"][3] == "1.000"
    assert (tmp_path / "r" / "time_frontier.png").stat().st_size > 10_000
    assert "![time_plot](time_frontier.png)" in text
    assert {p.name for p in (tmp_path / "r").iterdir()} <= set(OUTPUT_NAMES)  # the CLI guards each of them


def test_a_store_older_than_a_table_publishes_without_it(store, tmp_path, capsys):
    """A store written before ``alone_rates`` existed (publish opens it read-only: no migration) publishes the
    tables it has, and the folder reads back."""
    con = connect(store)
    con.execute("DROP TABLE alone_rates")
    con.close()
    out = tmp_path / "published"
    assert main(["publish", "--db", str(store), "--sweep", "s1", "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"published sweep s1 to {out}: 1 sweeps, 30 runs, 60 curves, 1 sweep_usage\n"
    assert not (out / "alone_rates.parquet").exists()
    assert main(["report", "--db", str(out), "--sweep", "s1", "--out", str(tmp_path / "r")]) == 0


def test_the_published_reference_study_reads_back_with_every_optimum_bracketed():
    """README's reference study: its folder holds the 110 runs of 7 variants x 3 budgets, and by the rule the sweep
    brackets with, every (arch, budget)'s vertex is a minimum inside its sampled sizes."""
    from pathlib import Path

    from analysis.published import load
    from sweeps.bracket import INSIDE, side, stored

    folder = Path(__file__).resolve().parents[1] / "docs" / "results" / "reference_h200"
    con = duckdb.connect(str(load(folder)), read_only=True)
    ((sid,),) = con.execute("SELECT sweep_id FROM sweeps").fetchall()
    assert con.execute("SELECT count(*) FROM runs WHERE sweep_id = ? AND status = 'ok'", [sid]).fetchone() == (110,)
    by_key = stored(con, sid)
    assert {arch for arch, _ in by_key} == {"dense", "mod", "mod_random", "moda", "moda_attn", "mode",
                                            "mode_integrated"}  # fmt: skip
    assert {budget for _, budget in by_key} == {2e14, 6e14, 2e15}
    outside = {key: side(runs, key[1]) for key, runs in by_key.items() if side(runs, key[1])[0] != INSIDE}
    assert not outside


def test_each_command_of_a_resumed_sweep_keeps_its_own_commit(store, tmp_path, capsys):
    """A sweep resumed by a later command on other code: the sweeps row names the latest command, the report and
    the published README name every command's commit and command line; a store older than those columns gets them
    (NULL before) and reads as "not recorded"."""
    con = connect(store)
    con.execute("ALTER TABLE sweep_usage DROP COLUMN commit")  # the store of an older mixdepth
    con.execute("ALTER TABLE sweep_usage DROP COLUMN command")
    con.close()
    con = connect(store)  # a writer adds them
    command = "python -m sweeps isoflop --preset x --db r.db"
    put_usage(con, usage_row(dt.datetime(2026, 12, 3, 9, 0), commit="def5678-dirty", command=command))
    con.close()
    out = tmp_path / "published"
    assert main(["publish", "--db", str(store), "--sweep", "s1", "--out", str(out)]) == 0
    readme = (out / "README.md").read_text()
    assert "| 2026-12-02 17:39 | 30 | 300 | not recorded | not recorded |" in readme
    assert "| 2026-12-03 09:00 | 4 | 100 | def5678-dirty | `python -m sweeps isoflop --preset x --db r.db` |" in readme
    for db in (store, out):
        assert main(["report", "--db", str(db), "--sweep", "s1", "--out", str(tmp_path / "r")]) == 0
        text = (tmp_path / "r" / "report.md").read_text()
        assert "- git commit: abc1234 (its latest command's; each command's under Device use)" in text
        assert "  commit not recorded: command line not recorded" in text
        assert "  commit def5678-dirty: `python -m sweeps isoflop --preset x --db r.db`" in text


def test_the_published_commands_say_how_each_ended(store, tmp_path):
    """A command stopped at its time limit, one interrupted or killed before its report (whose wall-clock is then only
    up to its stop or last finished run, as the README says), and one that reported."""
    con = connect(store)
    for hour, stopped in ((9, "time limit"), (10, "interrupted")):
        put_usage(con, usage_row(dt.datetime(2026, 12, 3, hour, 0), interrupted=True, stopped=stopped))
    con.close()
    out = tmp_path / "published"
    assert main(["publish", "--db", str(store), "--sweep", "s1", "--out", str(out)]) == 0
    readme = (out / "README.md").read_text()
    assert "| 2026-12-02 17:39 | 30 | 300 | not recorded | not recorded | with its report |" in readme
    assert (
        "| 2026-12-03 09:00 | 4 | 100 | not recorded | not recorded | stopped at its time limit, before its report |"
        in readme
    )
    assert "| 2026-12-03 10:00 | 4 | 100 | not recorded | not recorded | interrupted before its report |" in readme
    assert "killed outright (a job's end, a device's limit), up to its last finished run." in readme
