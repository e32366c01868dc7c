"""`WorkPendingSensor` across a change of leader, on a real PostgreSQL cluster lease: it waits on
while no lease is live and, under a new epoch, watches that epoch's work — the run is not ended
(the job task follows the new leader itself), so a failover costs no new DAG run."""

from __future__ import annotations

from stageline_airflow.hooks import StagelineStoreHook
from stageline_airflow.sensors import WorkPendingSensor

from tests.dags.stores import elector, seed_inbound, write_service_config


def test_the_wait_for_work_outlives_a_change_of_leader_and_watches_the_new_epoch(pg_config_fresh, tmp_path):
    hook = StagelineStoreHook(config_path=write_service_config(tmp_path, pg_config_fresh, cluster=True))
    store = hook.get_conn()
    try:
        old = elector(store, "node-a")
        first = old.step().epoch
        sensor = WorkPendingSensor(task_id="wait_for_work", stage="route", leader={"epoch": first})
        sensor._hook = hook  # as `execute` sets it; the pokes below are the ones it would make
        assert sensor.poke({}) is False  # nothing due yet
        old.release()  # the leader stops: nobody leads for a moment
        seed_inbound(store, 1)
        assert sensor.poke({}) is False  # waits on: no skip, no new run
        new = elector(store, "node-b")
        second = new.step().epoch
        assert second == first + 1
        assert sensor.poke({}) is True  # due under the new leader's epoch
        assert sensor._epoch == second
    finally:
        hook.close()
