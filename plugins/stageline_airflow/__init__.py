"""Stageline's Airflow extensions: everything the DAG files use, so they stay configuration.

    hooks.py          `StagelineStoreHook`: the store for one task (service config + Airflow connection)
    sensors.py        `LeaderCheckSensor` (first task of every DAG) and `WorkPendingSensor`
    tasks.py          what the DAGs' tasks do: recovery, reclaim, retention, the stage jobs' loops
    stage_dag.py      the one shape of the three stage DAGs
    view.py           `StagelineViewPlugin`: the Stageline view in the Airflow UI (served by the api-server)
    view_html.py      the view's page
    provider_info.py  `get_provider_info`: the `stageline` connection type and its form, the hooks, the view

One package, two ways in. As Airflow's plugins folder (`plugins/`, which Airflow puts on `sys.path`;
the embedded stack, the compose cluster and the DAG tests point `[core] plugins_folder` at it),
Airflow finds the view by scanning the folder; no `AirflowPlugin` is needed for an operator or a
hook. As the `stageline_airflow` package of the `stageline` wheel (pyproject.toml maps the folder),
it is also an Airflow provider: the `apache_airflow_provider` entry point hands Airflow
`provider_info.get_provider_info`, which is what registers the `stageline` connection type. The
logic they call lives below, in `include/` (leader check, housekeeping, stage loop, store) and
`spark_jobs/` (the jobs); this package adapts it to Airflow.
"""
