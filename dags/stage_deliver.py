"""stage_deliver: the deliver stage's DAG (its page in the Airflow UI says what it does).

The stage is the record `include.store.stages.DELIVER`; every stage DAG has the one shape of
`stageline_airflow.stage_dag` (leader_check → recover → wait_for_work → deliver).
"""

from __future__ import annotations

from stageline_airflow.stage_dag import stage_dag

from include.store.stages import DELIVER

dag = stage_dag(DELIVER)
