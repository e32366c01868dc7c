"""Stageline's Airflow extensions: everything the DAG files use, so they stay configuration.

    hooks.py      `StagelineStoreHook`: the store for one task (service config + Airflow connection)
    sensors.py    `LeaderCheckSensor` (first task of every DAG) and `WorkPendingSensor`
    tasks.py      what the DAGs' tasks do: recovery, reclaim, retention, the stage jobs' loops
    stage_dag.py  the one shape of the three stage DAGs
    view.py       `StagelineViewPlugin`: the Stageline view in the Airflow UI (served by the api-server)
    view_html.py  the view's page

Plain modules under `plugins/` (Airflow puts the folder on `sys.path`); no `AirflowPlugin` is
needed for an operator or a hook — only the view is one (Airflow finds it by scanning the folder). The logic they call lives below, in `include/` (leader check,
housekeeping, stage loop, store) and `spark_jobs/` (the jobs); this package adapts it to Airflow.
"""
