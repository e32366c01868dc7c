"""What every `stageline` command shares: loading the service config, opening a checked store
(quickly, without creating one, and saying why not), and the errors with their exit codes.

Exit codes, the same for every command (docs/operations.md): 0 done; 1 the command failed on its
way (a statement refused, a store error mid-command); 2 bad input (a flag, a file, the service
config); 3 the store cannot be reached (server down, login refused, no such database); 4 the store
is there but not one this node may use (no store file, no schema, another schema version, another
cluster's store).
"""

from __future__ import annotations

import os

import click

from include import config as cfgmod
from include.store import Store
from include.store.migrate import ClusterIdentityError, SchemaError, check_identity
from include.store.reach import NO_STORE, NOT_A_STORE, StoreUnavailable, probe

CONNECT_TIMEOUT_ENV = "STAGELINE_CONNECT_TIMEOUT"
CONNECT_TIMEOUT_SECONDS = 5.0
"""How long a command waits for the store's server to answer before it says it cannot reach it."""
_TIMEOUT_KEY = "stageline.connect_timeout"


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


class InputError(click.ClickException):
    """Bad input on the command line (a CSV file, a table name): "Error: ..." on stderr like every
    other failure here, but exit code 2, like click's own usage errors."""

    exit_code = 2


class StoreUnreachable(click.ClickException):
    """The store's server cannot be reached, refused the login, or has no such database."""

    exit_code = 3


class StoreNotUsable(click.ClickException):
    """The store is reachable but is not one this node may use: no file, no schema, another
    schema version, another cluster's."""

    exit_code = 4


def set_connect_timeout(ctx: click.Context, seconds: float) -> None:
    ctx.meta[_TIMEOUT_KEY] = seconds


def connect_timeout() -> float:
    ctx = click.get_current_context(silent=True)
    return float(ctx.meta.get(_TIMEOUT_KEY, CONNECT_TIMEOUT_SECONDS)) if ctx else CONNECT_TIMEOUT_SECONDS


def reachable_store(cfg: cfgmod.ServiceConfig, *, create: bool = False) -> Store:
    """A `Store` on a server that answered just now (`include.store.reach`). Only `create` (the
    migration) may start a SQLite store where there is none."""
    try:
        probe(cfg.store, timeout_seconds=connect_timeout())
    except StoreUnavailable as exc:
        if not (create and exc.cause == NO_STORE):
            if exc.cause in (NO_STORE, NOT_A_STORE):
                raise StoreNotUsable(f"{exc}; {_where_from(cfg)}") from None
            raise StoreUnreachable(str(exc)) from None
    return Store(cfg.store)


def _where_from(cfg: cfgmod.ServiceConfig) -> str:
    """Which config named the SQLite path, and how to get a store there."""
    if cfg.source is not None and cfg.source.exists():
        named = f"the [store].path of {cfg.source}"
    elif os.environ.get(cfgmod.CONFIG_ENV):
        named = f"the [store].path of ${cfgmod.CONFIG_ENV}"
    else:
        here = os.getcwd()
        named = f"the default [store].path: there is no {cfgmod.DEFAULT_CONFIG} in {here} and no --service-config"
    return (
        f"looked there as {named}. Create a store with `stageline db migrate`, "
        f"or name your {cfgmod.DEFAULT_CONFIG} with --service-config or ${cfgmod.CONFIG_ENV}"
    )


def _open_checked(cfg: cfgmod.ServiceConfig) -> tuple[Store, dict]:
    """The store, reachable, migrated and this cluster's; with its identity row."""
    store = reachable_store(cfg)
    try:
        return store, check_identity(store, cluster_name=cfg.cluster.cluster_name)
    except (ClusterIdentityError, SchemaError) as exc:
        store.close()
        raise StoreNotUsable(str(exc)) from None
