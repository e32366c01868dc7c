"""stage_transform: the transform stage's DAG (its page in the Airflow UI says what it does).

The stage is the record `include.store.stages.TRANSFORM`; every stage DAG has the one shape of
`stageline_airflow.stage_dag` (leader_check → recover → wait_for_work → transform).
"""

from __future__ import annotations

from stageline_airflow.stage_dag import stage_dag

from include.store.stages import TRANSFORM

dag = stage_dag(TRANSFORM)
