"""The PostgreSQL test server and Optuna's RDB storage on it: a queue two processes pop without taking a trial
twice, a stale trial retried with its parameters and attributes, and connection errors that name no password."""

import json
import subprocess
import sys
import time
import warnings

import optuna
import pytest
import sqlalchemy
from sqlalchemy.engine import make_url

from tests.pg import USER, _free_port

psycopg = pytest.importorskip("psycopg", reason="the postgres extra (psycopg) is not installed")

WAITING, RUNNING = optuna.trial.TrialState.WAITING, optuna.trial.TrialState.RUNNING
Retry = optuna.storages.RetryHeartbeatStaleTrialCallback  # Optuna >= 4.9; RetryFailedTrialCallback before


def storage(url: str, **kw) -> optuna.storages.RDBStorage:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RDBStorage(url, heartbeat_interval=1, grace_period=2, **kw)


def retry_callback(max_retry: int) -> Retry:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return Retry(max_retry=max_retry)


def test_server_takes_the_password_and_no_other(postgres):
    url = make_url(postgres.new_db())
    dsn = f"host=127.0.0.1 port={postgres.port} user={USER} dbname={url.database}"
    with psycopg.connect(f"{dsn} password={postgres.password}") as con:
        assert con.execute("SELECT current_user").fetchone() == (USER,)
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(f"{dsn} password=not-{postgres.password}")


POP = """
import json, sys, time, warnings
import optuna
warnings.simplefilter("ignore")
url, go = sys.argv[1], float(sys.argv[2])
storage = optuna.storages.RDBStorage(url, heartbeat_interval=1, grace_period=2)
study = optuna.load_study(study_name="queue", storage=storage)
time.sleep(max(0.0, go - time.time()))  # both processes start popping at once
popped = []
WAITING, RUNNING = optuna.trial.TrialState.WAITING, optuna.trial.TrialState.RUNNING
while True:  # pop the first WAITING trial another process has not taken (how study.ask takes one)
    waiting = study.get_trials(deepcopy=False, states=(WAITING,))
    tid = next((t._trial_id for t in waiting if storage.set_trial_state_values(t._trial_id, RUNNING)), None)
    if tid is None:
        break
    storage.record_heartbeat(tid)
    trial = optuna.Trial(study, tid)
    trial.set_user_attr("result", {"curve": list(range(500))})
    study.tell(trial, trial.suggest_int("i", 0, 100))
    popped.append(tid)
print(json.dumps(popped))
"""


def test_two_processes_pop_each_queued_trial_once(postgres, cli_env):
    url = postgres.new_db()
    study = optuna.create_study(study_name="queue", storage=storage(url))
    for i in range(16):
        study.enqueue_trial({"i": i})
    go = str(time.time() + 4)
    procs = [
        subprocess.Popen([sys.executable, "-c", POP, url, go], stdout=subprocess.PIPE, text=True, env=cli_env)
        for _ in range(2)
    ]
    popped = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert all(popped) and len(set(popped[0]) | set(popped[1])) == sum(map(len, popped)) == 16, popped
    trials = study.get_trials()
    assert len(trials) == 16 and {t.state for t in trials} == {optuna.trial.TrialState.COMPLETE}
    assert sorted(t.value for t in trials) == list(range(16))
    assert all(t.user_attrs["result"]["curve"][-1] == 499 for t in trials)


def test_a_stale_trial_is_retried_with_its_params_and_attributes(postgres):
    """A RUNNING trial whose heartbeat is older than the grace period is failed by fail_stale_trials, and the
    retry callback queues a new WAITING trial carrying its params, user attrs and (system) fixed params."""
    st = storage(postgres.new_db(), heartbeat_stale_trial_callback=retry_callback(1))
    study = optuna.create_study(study_name="stale", storage=st)
    study.enqueue_trial({"run_id": "r1"})
    (t,) = study.get_trials(deepcopy=False, states=(WAITING,))
    assert st.set_trial_state_values(t._trial_id, RUNNING)
    assert not st.set_trial_state_values(t._trial_id, RUNNING)  # taken: a second pop of it fails
    st.record_heartbeat(t._trial_id)
    trial = optuna.Trial(study, t._trial_id)
    trial.suggest_categorical("run_id", ["r1", "r2"])
    trial.set_user_attr("host", "dead-worker")
    time.sleep(3.2)  # past grace_period=2 s of the server's clock
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    dead, retry = study.get_trials()
    assert dead.state == optuna.trial.TrialState.FAIL and retry.state == WAITING
    assert retry.params == {"run_id": "r1"} and retry.user_attrs == {"host": "dead-worker"}
    assert retry.system_attrs["fixed_params"] == {"run_id": "r1"}
    assert retry.system_attrs["failed_trial"] == 0 and retry.system_attrs["retry_history"] == [0]


def _no_password(e: BaseException, password: str) -> str:
    """Every message of ``e``'s chain, checked to hold no ``password``; joined."""
    texts = []
    while e is not None:
        texts.append(str(e))
        e = e.__cause__ or e.__context__
    assert not any(password in t for t in texts), texts
    return " | ".join(texts)


def _with(url: str, **parts) -> str:
    return make_url(url).set(**parts).render_as_string(hide_password=False)


@pytest.mark.parametrize(
    "make,error,needle",
    [
        (lambda url: _with(url, password="wrong-secret"), sqlalchemy.exc.OperationalError, "password authentication"),
        (lambda url: _with(url, database="no_such_db"), sqlalchemy.exc.OperationalError, '"no_such_db" does not exist'),
        (lambda url: _with(url, port=_free_port()), sqlalchemy.exc.OperationalError, "Connection refused"),
        (lambda url: _with(url, drivername="foo"), sqlalchemy.exc.NoSuchModuleError, "dialects:foo"),
    ],
    ids=["wrong password", "missing database", "unreachable port", "unknown scheme"],
)
def test_bad_storage_urls_fail_naming_no_password(postgres, make, error, needle):
    url = make(postgres.new_db())
    with pytest.raises(error) as e:
        storage(url)
    password = make_url(url).password
    assert needle in _no_password(e.value, password)
    shown = make_url(url).render_as_string(hide_password=True)
    assert password not in shown and "***" in shown
