"""Stageline's Airflow extensions: the leader-check sensor that opens every stage DAG and the
work-pending sensor that holds a continuous stage run until it has rows to move.

Plain modules under `plugins/` (Airflow puts the folder on `sys.path`); no `AirflowPlugin` is
needed for an operator. Logic lives in `include/`; this package only adapts it to Airflow.
"""
from __future__ import annotations

from stageline_airflow.sensors import LeaderCheckSensor, WorkPendingSensor

__all__ = ["LeaderCheckSensor", "WorkPendingSensor"]
