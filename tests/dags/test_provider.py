"""Stageline as an Airflow provider, read the way Airflow reads it: the installed `stageline`
distribution's `apache_airflow_provider` entry point, then Airflow's own providers manager — the
`stageline` connection type, its hook, its form — and the form checked against what
`StagelineStoreHook` does with each field. The connections UI's view of the same, through a real
api-server: tests/test_airflow_provider.py.

These read the installed distribution's metadata: after a change to pyproject.toml's entry points
or wheel packages, `uv sync` (scripts/setup.sh) reinstalls it."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import json
import re
import subprocess
import sys

from airflow.providers_manager import ProvidersManager
from airflow.sdk import Connection
from airflow.sdk.providers_manager_runtime import ProvidersManagerTaskRuntime
from stageline_airflow import provider_info
from stageline_airflow.hooks import StagelineStoreHook, store_settings

from include.config import PASSWORD_ENV, StoreConfig

ENTRY_POINT = "stageline_airflow.provider_info:get_provider_info"
STALE = "the installed `stageline` distribution predates this checkout's pyproject.toml: run `uv sync`"


def stageline_form() -> dict:
    """The `stageline` connection type's form as Airflow's connections UI gets it (no hook imported)."""
    metas = {m.connection_type: m for m in ProvidersManager().iter_connection_type_hook_ui_metadata()}
    assert "stageline" in metas, sorted(metas)
    return metas["stageline"].field_behaviour


def test_the_installed_distribution_hands_airflow_the_provider_info():
    points = [
        ep for ep in importlib.metadata.distribution("stageline").entry_points if ep.group == "apache_airflow_provider"
    ]
    assert [ep.value for ep in points] == [ENTRY_POINT], STALE
    assert points[0].load() is provider_info.get_provider_info


def test_the_package_comes_with_the_install_not_only_with_the_plugins_folder(tmp_path):
    """A worker whose Airflow has no plugins folder still imports `stageline_airflow` (the wheel maps it)."""
    probe = "import json, stageline_airflow.provider_info as m; print(json.dumps(m.__name__))"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # no PYTHONPATH, cwd outside the checkout
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, f"{STALE}\n{done.stderr[-2000:]}"
    assert json.loads(done.stdout) == "stageline_airflow.provider_info"


def test_airflow_lists_the_stageline_provider_its_connection_type_hook_and_view():
    provider = ProvidersManager().providers["stageline"]
    assert provider.version == importlib.metadata.version("stageline")
    assert provider.data["name"] == "Stageline"

    hook = ProvidersManagerTaskRuntime().hooks["stageline"]
    assert hook is not None, "Airflow could not import the stageline connection type's hook"
    assert (hook.hook_class_name, hook.connection_id_attribute_name, hook.hook_name, hook.package_name) == (
        "stageline_airflow.hooks.StagelineStoreHook",
        "stageline_conn_id",
        "Stageline store",
        "stageline",
    )

    plugins = {p.name: p.plugin_class for p in ProvidersManager().plugins}
    assert plugins.get("stageline") == "stageline_airflow.view.StagelineViewPlugin"


def test_each_connection_type_is_the_one_its_hook_declares():
    """Airflow only logs a mismatch between the provider info and the hook class; here it fails."""
    for entry in provider_info.get_provider_info()["connection-types"]:
        module, _, name = entry["hook-class-name"].rpartition(".")
        hook = getattr(importlib.import_module(module), name)
        assert (hook.conn_type, hook.hook_name) == (entry["connection-type"], entry["hook-name"])
        assert hook.default_conn_name and hook.conn_name_attr
    assert StagelineStoreHook.conn_type == provider_info.CONN_TYPE


def test_the_form_names_each_field_after_the_store_setting_it_fills():
    form = stageline_form()
    conn = Connection(
        conn_id="stageline_store",
        conn_type="stageline",
        host="db.example.org",
        port=15432,
        login="svc_stageline",
        schema="hl7",
        password="from-airflow-secrets",
    )
    default = StoreConfig()
    filled = store_settings(default, conn)
    landed = {
        f.name: getattr(filled, f.name)
        for f in dataclasses.fields(StoreConfig)
        if getattr(filled, f.name) != getattr(default, f.name)
    }
    assert set(landed) == {"server", "port", "username", "database", "password"}

    assert form["relabeling"] == {"host": "Server", "login": "Username", "schema": "Database"}
    for field, label in form["relabeling"].items():  # the label is the [store] key the field fills
        assert landed[label.lower()] == getattr(conn, field), field

    placeholders = dict(form["placeholders"])
    assert placeholders.pop("password") == f"${PASSWORD_ENV}"  # where an empty password comes from
    assert set(placeholders) == {"host", "port", "login", "schema"}
    for field, text in placeholders.items():  # an empty field: the file's value, the key it names
        key = re.match(r"\[store\]\.(\w+) of stageline\.toml", text)
        assert key, text
        assert landed[key.group(1)] == getattr(conn, field), field


def test_the_form_hides_only_what_the_hook_does_not_read():
    assert stageline_form()["hidden_fields"] == ["extra"]
    with_extra = Connection(
        conn_id="stageline_store",
        conn_type="stageline",
        extra=json.dumps({"server": "elsewhere", "backend": "postgres", "database": "other"}),
    )
    assert store_settings(StoreConfig(), with_extra) == StoreConfig()
