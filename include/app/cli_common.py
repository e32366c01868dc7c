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
        raise ConfigInvalid(exc) from None


class ConfigInvalid(click.ClickException):
    """The service config breaks the schema: every problem on its own line (file, key, what is
    wrong) and exit code 2, like `stageline config check` and listenerd."""

    exit_code = 2

    def __init__(self, exc: cfgmod.ConfigError) -> None:
        super().__init__("the service config has problems:\n" + "\n".join(f"  {p}" for p in exc.problems))


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
