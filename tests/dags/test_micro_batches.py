"""The stage task's micro-batch loop (include.stage_loop.run_stage), on a fake clock: it keeps
claiming while work comes, lingers while idle, stops at its budget, stops claiming under an epoch
the moment leadership moves and follows the new leader (or ends when none is live). The jobs it
runs and the real ClaimKeeper are tested on real stores elsewhere; here they are stand-ins."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

from include import stage_loop
from include.store.finalize import StaleEpoch


@dataclass(frozen=True)
class Outcome:
    claimed: tuple[int, ...] = ()
    done: tuple[int, ...] = ()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class FakeKeeper:
    """The ClaimKeeper's surface on the fake clock: `stop_at` is when leadership moves."""

    def __init__(self, clock: Clock, stop_at: float | None = None) -> None:
        self.clock, self.stop_at = clock, stop_at
        self.owner: str | None = None
        self.owners_seen: list[str | None] = []
        self.recovered: list[tuple[str, str]] = []
        self.reason: str | None = None
        self.stopped = threading.Event()
        self.terms: list[int] = []
        self.moved_unseen = False
        """Leadership moved on in the first term but the keeper's own checks have not seen it (they
        failed while the store was away): only a `check()` finds it."""

    def __call__(self, config, store, epoch):
        self.terms.append(epoch)
        self.stopped.clear()
        return self

    def stopping(self) -> bool:
        self._tick()
        return self.stopped.is_set()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def recover_abandoned(self, *, prefix: str, keep: str) -> int:
        self.recovered.append((prefix, keep))
        return 0

    def check(self) -> bool:
        self._tick()
        if self.moved_unseen and len(self.terms) == 1:
            self.reason = "epoch 7 is no longer current (now 8)"
            self.stopped.set()
        return self.stopped.is_set()

    def _tick(self) -> None:
        if self.stop_at is not None and self.clock.now >= self.stop_at and len(self.terms) == 1:
            self.reason = "epoch 7 is no longer current (now 8)"
            self.stopped.set()

    def wait(self, seconds: float) -> bool:
        self._tick()
        if not self.stopped.is_set():
            self.clock.now += seconds
            self._tick()
        return self.stopped.is_set()


def loop(
    job,
    clock: Clock,
    monkeypatch,
    linger: float = 3.0,
    keeper: FakeKeeper | None = None,
    next_leader: int | None = None,
):
    """Run the loop from epoch 7; when it stops, `next_leader` is the epoch the follow step finds."""
    monkeypatch.setenv(stage_loop.LINGER_ENV, str(linger))
    keeper = keeper or FakeKeeper(clock)
    epochs: list[int] = []

    def with_owner_check(batch: stage_loop.Batch):
        assert keeper.owner == batch.owner  # the keeper renews the claim in flight
        epochs.append(batch.epoch)
        return job(batch.store, batch.owner, batch.run_id)

    def follow(config, store, epoch, watch):
        assert watch.stopping() or watch.reason
        return next_leader

    result = stage_loop.run_stage(
        "route",
        "stage_route",
        "run1",
        1,
        7,
        with_owner_check,
        config=None,
        store="store",
        clock=clock,
        keeper=keeper,
        follow=follow,
    )
    result["_batch_epochs"] = epochs
    return result


def test_it_keeps_claiming_while_work_comes_and_stops_after_lingering_idle(monkeypatch):
    clock, owners = Clock(), []
    arrivals = {0.0: 3, 1.0: 2, 2.5: 4}  # batches of work, at these times

    def job(store, owner, job_run_id):
        owners.append(owner)
        clock.now += 0.5  # a batch takes half a second
        due = [t for t in arrivals if t <= clock.now]
        if not due:
            return Outcome()
        n = arrivals.pop(due[0])
        return Outcome(claimed=tuple(range(n)), done=tuple(range(n)))

    result = loop(job, clock, monkeypatch)
    assert result == {
        "run_id": "run1#1",
        "epoch": 7,
        "epochs": [7],
        "stale_epoch": False,
        "batches": 3,
        "claimed": 9,
        "done": 9,
        "_batch_epochs": [7] * len(owners),
    }
    assert len(set(owners)) == len(owners)  # each batch claims as its own owner
    assert owners[0] == "airflow:stage_route:run1#1.0" and owners[1] == "airflow:stage_route:run1#1.1"
    assert 3.0 <= clock.now - 3.0 <= 4.0  # ended one linger after the last batch (at ~3.0 s)


def test_it_stops_at_its_time_budget_under_steady_work(monkeypatch):
    clock = Clock()

    def job(store, owner, job_run_id):
        clock.now += 10.0
        return Outcome(claimed=(1,), done=(1,))

    result = loop(job, clock, monkeypatch)
    assert clock.now == stage_loop.STAGE_TIME_BUDGET_SECONDS
    assert result["batches"] == stage_loop.STAGE_TIME_BUDGET_SECONDS / 10


def test_a_stale_epoch_with_no_live_leader_to_follow_ends_the_run_at_once(monkeypatch):
    clock, calls = Clock(), []

    def job(store, owner, job_run_id):
        calls.append(owner)
        if len(calls) == 2:
            raise StaleEpoch("moved")
        return Outcome(claimed=(1, 2), done=(1, 2))

    result = loop(job, clock, monkeypatch)
    assert result == {
        "run_id": "run1#1",
        "epoch": 7,
        "epochs": [7],
        "stale_epoch": True,
        "batches": 1,
        "claimed": 2,
        "done": 2,
        "stopped": "epoch 7 is no longer current",
        "_batch_epochs": [7, 7],
    }
    assert len(calls) == 2


def test_with_no_linger_an_idle_run_ends_after_one_empty_claim(monkeypatch):
    clock, calls = Clock(), []

    def job(store, owner, job_run_id):
        calls.append(owner)
        return Outcome()

    assert loop(job, clock, monkeypatch, linger=0)["batches"] == 0
    assert len(calls) == 1


def test_a_failing_batch_is_retried_in_the_loop_and_too_many_in_a_row_fail_the_task(monkeypatch):
    clock, calls = Clock(), []

    def flaky(store, owner, job_run_id):
        calls.append(owner)
        if len(calls) in (1, 2):
            raise RuntimeError("database is locked")
        return Outcome(claimed=(1,), done=(1,)) if len(calls) == 3 else Outcome()

    assert loop(flaky, clock, monkeypatch, linger=0)["claimed"] == 1
    assert len(calls) == 4

    def broken(store, owner, job_run_id):
        raise RuntimeError("spark is down")

    with pytest.raises(RuntimeError, match="spark is down"):
        loop(broken, Clock(), monkeypatch)


class SparkConnectGrpcException(Exception):
    """Named like pyspark's: what a batch meets when its Spark Connect server went away."""


class FakeSession:
    def __init__(self, renews: bool) -> None:
        self.spark, self.renews, self.renewed = "session-1", renews, 0

    def renew(self) -> bool:
        self.renewed += 1
        if self.renews:
            self.spark = f"session-{self.renewed + 1}"
        return self.renews


def test_a_lost_spark_session_is_renewed_in_the_task_and_the_next_batch_uses_the_new_one(monkeypatch):
    monkeypatch.setenv(stage_loop.LINGER_ENV, "0")
    seen: list[str] = []

    def job(batch: stage_loop.Batch):
        seen.append(batch.spark)
        if len(seen) == 1:
            raise SparkConnectGrpcException("UNAVAILABLE: failed to connect")
        return Outcome(claimed=(1,), done=(1,)) if len(seen) == 2 else Outcome()

    session = FakeSession(renews=True)
    clock = Clock()
    result = stage_loop.run_stage(
        "route",
        "stage_route",
        "run1",
        1,
        7,
        job,
        config=None,
        store="store",
        clock=clock,
        keeper=FakeKeeper(clock),
        session=session,
    )
    assert result["claimed"] == 1 and session.renewed == 1
    assert seen == ["session-1", "session-2", "session-2"]

    seen.clear()
    gone = FakeSession(renews=False)  # the server stayed away: the task fails, Airflow retries it
    with pytest.raises(SparkConnectGrpcException):
        stage_loop.run_stage(
            "route",
            "stage_route",
            "run1",
            1,
            7,
            job,
            config=None,
            store="store",
            clock=clock,
            keeper=FakeKeeper(clock),
            session=gone,
        )


def test_a_leadership_change_seen_while_idle_ends_the_run_within_a_poll_not_a_linger(monkeypatch):
    clock, calls = Clock(), []
    keeper = FakeKeeper(clock, stop_at=1.2)

    def job(store, owner, job_run_id):
        calls.append(clock.now)
        return Outcome()

    result = loop(job, clock, monkeypatch, linger=30.0, keeper=keeper)
    assert result["stale_epoch"] is True and result["stopped"] == "epoch 7 is no longer current (now 8)"
    assert clock.now <= 1.2 + stage_loop.POLL_SECONDS  # not the 30 s linger
    assert calls and max(calls) < 1.2  # no claim after the change was seen


def test_a_leadership_change_seen_during_a_batch_ends_the_run_before_the_next_claim(monkeypatch):
    clock, calls = Clock(), []
    keeper = FakeKeeper(clock)

    def job(store, owner, job_run_id):
        calls.append(owner)
        keeper.stopped.set()  # seen by the keeper while this batch runs
        return Outcome(claimed=(1, 2), done=(1, 2))

    result = loop(job, clock, monkeypatch, keeper=keeper)
    assert len(calls) == 1 and result["stale_epoch"] is True and result["claimed"] == 2


def test_the_task_first_recovers_claims_its_dag_left_behind_but_never_its_own(monkeypatch):
    clock, keeper = Clock(), FakeKeeper(Clock())
    loop(lambda *a: Outcome(), clock, monkeypatch, linger=0, keeper=keeper)
    assert keeper.recovered == [("airflow:stage_route:", "airflow:stage_route:run1#1.")]


def test_after_a_leadership_change_the_task_carries_on_under_the_new_epoch_with_a_fresh_watch(monkeypatch):
    clock, seen = Clock(), []
    keeper = FakeKeeper(clock, stop_at=1.0)

    def job(store, owner, job_run_id):
        seen.append(owner)
        clock.now += 0.5
        return Outcome(claimed=(1,), done=(1,)) if len(seen) < 6 else Outcome()

    result = loop(job, clock, monkeypatch, linger=0, keeper=keeper, next_leader=8)
    assert keeper.terms == [7, 8] and result["epochs"] == [7, 8]
    assert result["_batch_epochs"][:2] == [7, 7] and set(result["_batch_epochs"][2:]) == {8}
    assert len(keeper.recovered) == 2  # each term re-checks for abandoned claims
    assert result["stale_epoch"] is False and result["batches"] == 5


def test_each_batch_that_claimed_is_handed_to_the_history_with_its_owner_and_duration(monkeypatch):
    monkeypatch.setenv(stage_loop.LINGER_ENV, "0")
    clock, recorded = Clock(), []
    n = [0]

    def job(batch: stage_loop.Batch):
        n[0] += 1
        clock.now += 0.25  # the batch's own time
        return Outcome(claimed=(1, 2), done=(1, 2)) if n[0] == 1 else Outcome()

    def history(**batch):
        recorded.append(batch)
        raise RuntimeError("the history table is gone")  # must not fail the stage

    result = stage_loop.run_stage(
        "route",
        "stage_route",
        "run1",
        2,
        7,
        job,
        config=None,
        store="store",
        clock=clock,
        keeper=FakeKeeper(clock),
        history=history,
    )
    assert result["claimed"] == 2
    assert [
        (b["stage"], b["owner"], b["run_id"], b["epoch"], b["seconds"], b["counts"]["claimed"]) for b in recorded
    ] == [("route", "airflow:stage_route:run1#2.0", "run1#2.0", 7, 0.25, 2)]


def test_a_budget_from_the_environment_shortens_the_run_but_never_lengthens_it(monkeypatch):
    monkeypatch.setenv(stage_loop.BUDGET_ENV, "60")
    assert stage_loop.budget_seconds() == 60.0
    monkeypatch.setenv(stage_loop.BUDGET_ENV, str(10 * stage_loop.STAGE_TIME_BUDGET_SECONDS))
    assert stage_loop.budget_seconds() == stage_loop.STAGE_TIME_BUDGET_SECONDS
    for bad in ("0", "-5", "nan", "inf", "ten"):
        monkeypatch.setenv(stage_loop.BUDGET_ENV, bad)
        with pytest.raises(ValueError):
            stage_loop.budget_seconds()


def test_the_run_ends_when_the_pipeline_config_changes_on_disk(monkeypatch):
    """Runs last hours, so a changed routes.toml must end one: the next run loads and checks it."""
    monkeypatch.setenv(stage_loop.LINGER_ENV, "600")
    clock, keeper, asked = Clock(), FakeKeeper(Clock()), []

    def changed() -> bool:
        asked.append(clock.now)
        return clock.now >= 30.0

    def job(batch):
        clock.now += 1.0
        return Outcome(claimed=(1,), done=(1,))

    result = stage_loop.run_stage(
        "route",
        "stage_route",
        "run1",
        1,
        7,
        job,
        config=None,
        store="store",
        clock=clock,
        keeper=keeper,
        changed=changed,
    )
    assert result["stopped"] == "pipeline config changed"
    assert 30.0 <= clock.now <= 30.0 + stage_loop.CONFIG_CHECK_SECONDS + 1.0
    assert all(b - a >= stage_loop.CONFIG_CHECK_SECONDS for a, b in zip(asked, asked[1:]))  # a stat call every few s


class TimedStore:
    """A store that says how long each batch's longest write transaction held it."""

    def __init__(self, held: list[float]) -> None:
        self.held, self.asked = held, 0

    def longest_write(self) -> float:
        self.asked += 1
        # asked twice a batch: before the job (reset), after it (this batch's figure)
        return self.held.pop(0) if self.asked % 2 == 0 and self.held else 0.0


def test_a_batch_that_held_the_store_too_long_makes_the_next_claim_smaller(monkeypatch):
    """The cap by time: a 10,000-row batch whose finalize held SQLite's lock for 0.5 s is followed by
    a claim of ~2,000 rows (0.1 s' worth), and the limit grows back once batches run fast."""
    monkeypatch.setenv(stage_loop.LINGER_ENV, "0")
    from include.batch_size import BatchSize

    size = BatchSize(most=10_000, target_seconds=0.1)
    store = TimedStore(held=[0.5, 0.02, 0.02, 0.02, 0.02])
    limits: list[int | None] = []
    backlog = [10_000, 5_000, 5_000, 5_000, 5_000]

    def job(batch):
        limits.append(batch.limit)
        if not backlog:
            return Outcome()
        n = min(backlog.pop(0), batch.limit or 10_000)
        return Outcome(claimed=tuple(range(n)))

    stage_loop.run_stage(
        "route",
        "stage_route",
        "run1",
        1,
        7,
        job,
        config=None,
        store=store,
        clock=Clock(),
        keeper=FakeKeeper(Clock()),
        size=size,
    )
    assert limits[0] == 10_000
    assert limits[1] == 2_000
    assert limits[1] < limits[2] < limits[3] < limits[4] <= 10_000


def test_batch_size_never_drops_below_its_floor_nor_grows_past_its_cap():
    from include.batch_size import BatchSize

    size = BatchSize(most=5_000, target_seconds=0.1, least=200)
    assert size.observe(rows=5_000, held_seconds=100.0) == 200  # a pathological stall: the floor
    assert size.observe(rows=0, held_seconds=9.0) == 200  # an empty batch says nothing
    for _ in range(50):
        size.observe(rows=size.limit, held_seconds=0.001)
    assert size.limit == 5_000
    assert size.observe(rows=50, held_seconds=0.001) == 5_000  # a trickle neither grows nor shrinks it
    assert BatchSize.for_backend("sqlite", most=10_000).target_seconds == 0.1


def test_a_task_whose_batch_hung_ends_even_if_it_ignores_sigterm(tmp_path):
    """`tasks.end_hung_task`: SIGTERM first (Airflow fails the try and retries it); a process that
    ignores it (a call that never returns to Python) exits on its own a little later."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = (
        "import signal, sys, time; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/plugins'];"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        "from stageline_airflow import tasks; tasks.HUNG_EXIT_SECONDS = 0.5;"
        "tasks.end_hung_task('airflow:stage_route:r#1.7'); time.sleep(30)"
    )
    done = subprocess.run([sys.executable, "-c", script, str(root)], capture_output=True, timeout=60)
    assert done.returncode == 70, done.stderr.decode()[-2000:]
    ignored = subprocess.run(
        [sys.executable, "-c", script.replace("signal.SIG_IGN", "signal.SIG_DFL"), str(root)],
        capture_output=True,
        timeout=60,
    )
    assert ignored.returncode == -signal.SIGTERM


def test_a_claim_that_waited_out_a_store_failover_is_not_idleness_the_task_follows_the_new_leader(monkeypatch):
    clock, calls = Clock(), []
    keeper = FakeKeeper(clock)

    def job(store, owner, job_run_id):
        calls.append(clock.now)
        if len(calls) == 2:  # this claim waits 10 s for a connection; meanwhile epoch 8 is elected
            clock.now += 10.0
            keeper.moved_unseen = True
        return Outcome()  # empty: under epoch 7 nothing is claimable any more

    result = loop(job, clock, monkeypatch, linger=5.0, keeper=keeper, next_leader=8)
    assert keeper.terms == [7, 8] and result["epochs"] == [7, 8], "the run ended instead of following epoch 8"
    assert result["stale_epoch"] is False
    assert clock.now >= 10.0 + 5.0  # under epoch 8 it lingered its full 5 s before ending
