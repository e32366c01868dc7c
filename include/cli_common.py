"""What every `stageline` command shares: loading the service config, opening a checked store,
printing JSON, and the error for bad input."""
from __future__ import annotations

import json

import click

from include import config as cfgmod
from include.store import Store
from include.store.migrate import ClusterIdentityError, SchemaError, check_identity


def _load(path: str | None) -> cfgmod.ServiceConfig:
    try:
        return cfgmod.load(path)
    except cfgmod.ConfigError as exc:
        raise click.ClickException(f"config: {exc}") from exc


def _open_checked(cfg: cfgmod.ServiceConfig) -> tuple[Store, dict]:
    store = Store(cfg.store)
    try:
        return store, check_identity(store, cluster_name=cfg.cluster.cluster_name)
    except (ClusterIdentityError, SchemaError) as exc:
        store.close()
        raise click.ClickException(str(exc)) from exc


def _emit(doc: dict) -> None:
    click.echo(json.dumps(doc, indent=2))


class InputError(click.ClickException):
    """Bad input on the command line (a CSV file, a table name): "Error: ..." on stderr like every
    other failure here, but exit code 2, like click's own usage errors."""

    exit_code = 2
