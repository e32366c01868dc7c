"""The stage DAGs' sensors: `LeaderCheckSensor` (first task of every DAG) and `WorkPendingSensor`.

`LeaderCheckSensor` gates every run on the leader lease (invariant 4 in docs/invariants.md, leader-gated work).

It asks the store who leads (`include.leader_check.check_leadership`, on the database clock):

- a live leader (or a single-node store, which always leads) → done; the epoch and the leader's
  node id go to XCom (`{"epoch": int, "owner": str | None}`) and every later task of the run
  works under that epoch, so its writes are fenced like the leader's own;
- no live leader → poke again every `poke_interval` until `timeout`, then **skip** (`soft_fail`):
  the whole run ends skipped, not failed — a standby cluster is a normal state, not an error.

Why a bounded wait and not an immediate skip: a failover completes within about one lease TTL,
and a few pokes let a run that started in the gap still do its work instead of leaving it to the
next run. Why bounded: the run holds a worker slot while it waits (poke mode; reschedule mode
would cost a scheduler round trip per poke), and with `max_active_runs=1` it holds back the next
run. The defaults (poke every 2 s, give up after 10 s) fit a DAG on a minutes interval; the
continuous stage DAGs poke every 0.5 s and wait up to a minute, because a skipped continuous run
is replaced at once and a short wait would only churn runs (docs/pipeline.md).

Errors are not leaderlessness: an unreachable store, a missing schema or a store of another
cluster fail the sensor (and Airflow's retries apply), so a misconfiguration is seen, not skipped.

Both sensors open the store once per task (`StagelineStoreHook`, in `execute`) and poke on it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseSensorOperator, PokeReturnValue

from include.leader_check import check_leadership, work_pending
from include.store.lease import read_lease
from include.store.stages import stage_named
from stageline_airflow.hooks import StagelineStoreHook

if TYPE_CHECKING:
    from airflow.sdk import Context

DEFAULT_POKE_INTERVAL = timedelta(seconds=2)
DEFAULT_TIMEOUT = timedelta(seconds=10)


class _StoreSensor(BaseSensorOperator):
    """A sensor that pokes on one store for its whole task: the hook is made in `execute`, its
    store opened at the first poke and closed when the task ends.

    Both sensors poke (a worker slot held, no scheduler round trip a poke) and skip when the wait
    runs out; a subclass names only its own default interval and timeout.
    """

    default_poke_interval: timedelta = DEFAULT_POKE_INTERVAL
    default_timeout: timedelta = DEFAULT_TIMEOUT

    def __init__(
        self,
        *,
        config_path: str | None = None,
        poke_interval: timedelta | float | None = None,
        timeout: timedelta | float | None = None,
        soft_fail: bool = True,
        mode: str = "poke",
        **kwargs: Any,
    ) -> None:
        super().__init__(
            poke_interval=self.default_poke_interval if poke_interval is None else poke_interval,
            timeout=self.default_timeout if timeout is None else timeout,
            soft_fail=soft_fail,
            mode=mode,
            **kwargs,
        )
        self.config_path = config_path
        self._hook: StagelineStoreHook | None = None

    def execute(self, context: Context) -> Any:
        self._hook = StagelineStoreHook(config_path=self.config_path)
        try:
            return super().execute(context)
        finally:
            hook, self._hook = self._hook, None
            hook.close()

    @property
    def hook(self) -> StagelineStoreHook:
        if self._hook is None:
            raise RuntimeError("poke() outside execute()")
        return self._hook


class LeaderCheckSensor(_StoreSensor):
    """Proceed only under a live leader lease; push its epoch to XCom, else end the run skipped.

    :param config_path: the service config (`stageline.toml`); default `$STAGELINE_CONFIG`, then
        `./stageline.toml`, resolved when the task runs, never at parse time.
    :param poke_interval: time between lease reads while no leader is live.
    :param timeout: how long to wait for a live leader before the run is skipped (0: one read).
    """

    template_fields = ("config_path",)
    ui_color = "#fde9c4"

    def poke(self, context: Context) -> PokeReturnValue:
        check = check_leadership(self.hook.get_conn(), self.hook.config.cluster)
        self.log.info("leader check: %s", check.reason)
        return PokeReturnValue(is_done=check.proceed, xcom_value=check.as_xcom() if check.proceed else None)


class WorkPendingSensor(_StoreSensor):
    """Hold a continuous stage run until work is due in its stage or on its way there, so runs do
    not spin empty.

    Polls `include.leader_check.work_pending(ahead=True)` on the task's one store: done as soon as a
    row is due in this stage or an earlier one (a message staged inbound wakes all three stages at
    once, so each job task has started by the time the message reaches its table); **skipped** when
    the wait times out (an idle period: the next run starts at once and waits again). A change of
    leader does not end the wait: while no lease is live it waits on, and under a new epoch it
    watches that epoch's work — the job task then follows the new leader itself
    (`include/stage_loop.py`: recovery, then claims under the new epoch), which saves the seconds of
    scheduling a new run would cost in the middle of a failover.

    :param stage: the stage whose work this is (`route`: due rows in its input, `stage_inbound`).
    :param leader: the leader check's XCom (`leader_check.output`).
    :param config_path: as for `LeaderCheckSensor`.
    """

    template_fields = ("leader", "config_path")
    ui_color = "#e4f0e8"
    default_poke_interval = timedelta(seconds=1)
    default_timeout = timedelta(minutes=5)

    def __init__(self, *, stage: str, leader: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        stage_named(stage)  # refuse an unknown stage when the DAG is parsed, not when it runs
        self.stage = stage
        self.leader = leader
        self._epoch: int | None = None

    def poke(self, context: Context) -> bool:
        store, clustered = self.hook.get_conn(), self.hook.config.cluster.enabled
        if self._epoch is None:
            self._epoch = int(self.leader["epoch"])
        due = work_pending(store, self._epoch, self.stage, require_live=clustered, ahead=True)
        if due is None:  # leadership moved or lapsed
            lease = read_lease(store)
            if clustered and not lease.live:
                self.log.info("no live leader (epoch %s lapsed): waiting on", lease.epoch)
                return False
            self.log.info("leadership moved from epoch %s to %s: the job follows it", self._epoch, lease.epoch)
            self._epoch = lease.epoch
            return bool(work_pending(store, self._epoch, self.stage, require_live=clustered, ahead=True))
        return due
