"""Airflow's connections UI offers the `stageline` connection type with its form: a real api-server
(started as tests/test_airflow_view.py starts one: throwaway AIRFLOW_HOME, free port, the
SimpleAuthManager; no store behind it) answers `/ui/connections/hook_meta`, the metadata the UI
builds its connection form from, out of the installed `stageline` provider's info. The view is
still found once, from the plugins folder, with no plugin import error beside it. The providers
manager's side, in process: tests/dags/test_provider.py."""

from __future__ import annotations

import pytest
from stageline_airflow.provider_info import STORE_FORM

from tests.test_airflow_view import ApiServer, http, migrated_airflow_home, token_for

STANDARD_FIELDS = {"host": "host", "port": "port", "login": "login", "password": "password", "schema": "url_schema"}
"""A connection's field → its key in the hook metadata's `standard_fields`."""


@pytest.fixture(scope="module")
def api_server(tmp_path_factory):
    var = tmp_path_factory.mktemp("airflow-provider")
    server = ApiServer(migrated_airflow_home(var), var / "stageline.toml", var / "api-server.log")
    try:
        yield server.start()
    finally:
        server.stop()


def test_the_connections_form_offers_the_stageline_type_with_its_fields(api_server):
    status, meta, _ = http(
        api_server.port, "GET", "/ui/connections/hook_meta", token=token_for(api_server.port, "admin")
    )
    assert status == 200, meta
    by_type = {m["connection_type"]: m for m in meta}
    assert "stageline" in by_type, sorted(by_type)
    stageline = by_type["stageline"]
    assert (stageline["hook_class_name"], stageline["hook_name"]) == (
        "stageline_airflow.hooks.StagelineStoreHook",
        "Stageline store",
    )

    shown = {field: stageline["standard_fields"][key] for field, key in STANDARD_FIELDS.items()}
    assert shown == {
        field: {
            "hidden": False,
            "title": STORE_FORM["relabeling"].get(field),
            "placeholder": STORE_FORM["placeholders"][field],
        }
        for field in STANDARD_FIELDS
    }
    assert shown["schema"]["title"] == "Database"  # the store's database, not its PostgreSQL schema
    assert stageline["extra_fields"] is None


def test_the_view_is_loaded_once_and_no_plugin_fails(api_server):
    token = token_for(api_server.port, "admin")
    status, plugins, _ = http(api_server.port, "GET", "/api/v2/plugins", token=token)
    assert status == 200, plugins
    assert [p["name"] for p in plugins["plugins"]].count("stageline") == 1, plugins
    status, errors, _ = http(api_server.port, "GET", "/api/v2/plugins/importErrors", token=token)
    assert (status, errors["total_entries"]) == (200, 0), errors
