"""What Airflow learns about Stageline as a provider: `get_provider_info`, the `stageline`
distribution's `apache_airflow_provider` entry point (pyproject.toml).

Installing the distribution is what registers the `stageline` connection type: Airflow's providers
manager reads this dict, so the type can be picked in the connections UI, with its form, and
`airflow providers hooks` names the hook that reads it (`StagelineStoreHook`).

The form is declared here (`conn-fields`, `ui-field-behaviour`) rather than by the hook's
`get_connection_form_widgets` / `get_ui_field_behaviour`: Airflow 3.2 deprecated those methods, and
the api-server builds the connections form from this dict alone, without importing the hook (and
with it the store). A field left empty takes the service config's value (`StagelineStoreHook`), so
the placeholders say where that comes from; `extra` is hidden because nothing reads it.

Plain data and no imports at module level: Airflow calls it in every process that lists providers.
"""

from __future__ import annotations

from typing import Any

PACKAGE = "stageline"
"""The distribution's name: Airflow refuses provider info whose package-name is not it."""

CONN_TYPE = "stageline"
"""`StagelineStoreHook.conn_type`; the test of this module checks the two agree."""

STORE_FORM = {
    "hidden-fields": ["extra"],
    "relabeling": {"host": "Server", "login": "Username", "schema": "Database"},
    "placeholders": {
        "host": "[store].server of stageline.toml",
        "port": "[store].port of stageline.toml (5432 PostgreSQL, 1433 SQL Server)",
        "login": "[store].username of stageline.toml",
        "schema": "[store].database of stageline.toml",
        "password": "$STAGELINE_STORE_PASSWORD",
    },
}
"""The `stageline` connection's form: the fields `store_settings` maps onto `[store]`, named as there."""


def get_provider_info() -> dict[str, Any]:
    """The provider info Airflow validates against its `provider_info.schema.json`."""
    from importlib.metadata import version

    return {
        "package-name": PACKAGE,
        "name": "Stageline",
        "description": "Stageline's stage DAGs' hooks and sensors, the `stageline` store connection type "
        "and the Stageline view in the Airflow UI.",
        "versions": [version(PACKAGE)],
        "integrations": [{"integration-name": "Stageline", "tags": ["software"]}],
        "hooks": [{"integration-name": "Stageline", "python-modules": ["stageline_airflow.hooks"]}],
        "sensors": [{"integration-name": "Stageline", "python-modules": ["stageline_airflow.sensors"]}],
        "connection-types": [
            {
                "connection-type": CONN_TYPE,
                "hook-class-name": "stageline_airflow.hooks.StagelineStoreHook",
                "hook-name": "Stageline store",
                "ui-field-behaviour": STORE_FORM,
            }
        ],
        "plugins": [{"name": "stageline", "plugin-class": "stageline_airflow.view.StagelineViewPlugin"}],
    }
