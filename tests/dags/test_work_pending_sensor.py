"""`WorkPendingSensor` across a change of leader, on a real PostgreSQL cluster lease: it waits on
while no lease is live and, under a new epoch, watches that epoch's work — the run is not ended
(the job task follows the new leader itself), so a failover costs no new DAG run."""
from __future__ import annotations

from stageline_airflow.sensors import WorkPendingSensor

from include.store import Store
from tests.dags.stores import seed_inbound
from tests.dags.test_leadership import elector


def test_the_wait_for_work_outlives_a_change_of_leader_and_watches_the_new_epoch(pg_config_fresh):
    store = Store(pg_config_fresh)
    try:
        old = elector(store, "node-a")
        first = old.step().epoch
        sensor = WorkPendingSensor(task_id="wait_for_work", stage="inbound", leader={"epoch": first})
        sensor._store, sensor._clustered = store, True
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
        store.close()
