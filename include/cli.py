"""`stageline` command line: store migration and cluster views."""
from __future__ import annotations

import json
import sys

import click

from include import config as cfgmod
from include.store import Store
from include.store.lease import read_lease
from include.store.membership import NodeIdentity, cluster_nodes, cluster_status, single_node_nodes
from include.store.migrate import ClusterIdentityError, SchemaError, check_identity, migrate


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


@click.group()
@click.option("--service-config", "service_config", envvar=cfgmod.CONFIG_ENV, default=None,
              help="Path to stageline.toml (default: ./stageline.toml, or $STAGELINE_CONFIG).")
@click.pass_context
def cli(ctx: click.Context, service_config: str | None) -> None:
    """Stageline: HL7-style integration engine on staged SQL tables, Airflow and Spark."""
    ctx.obj = service_config


@cli.group()
def db() -> None:
    """The staged store."""


@db.command("migrate")
@click.pass_obj
def db_migrate(service_config: str | None) -> None:
    """Create or upgrade the schema (idempotent) and pin the store to this cluster."""
    cfg = _load(service_config)
    store = Store(cfg.store)
    try:
        report = migrate(store, cluster_name=cfg.cluster.cluster_name)
    except ClusterIdentityError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        store.close()
    where = cfg.store.path if cfg.store.backend == "sqlite" else f"{cfg.store.server}:{cfg.store.effective_port}/{cfg.store.database}"
    applied = ", ".join(map(str, report.applied)) or "none (already current)"
    click.echo(f"store {cfg.store.backend} at {where}: schema version {report.version}; applied: {applied}; "
               f"cluster {report.cluster_name!r} ({report.cluster_id})")


@cli.group()
def cluster() -> None:
    """Membership and leadership, as served on /cluster/status and /cluster/nodes."""


@cluster.command("status")
@click.pass_obj
def cluster_status_cmd(service_config: str | None) -> None:
    """This node's posture (node id from the config; leader if it holds the live lease)."""
    cfg = _load(service_config)
    store, identity = _open_checked(cfg)
    try:
        lease = read_lease(store)
    finally:
        store.close()
    is_leader = lease.live and lease.owner == cfg.cluster.node_id
    _emit(cluster_status(node_id=cfg.cluster.node_id, clustered=cfg.cluster.enabled, is_leader=is_leader,
                         config_version=identity["config_version"]))


@cluster.command("nodes")
@click.pass_obj
def cluster_nodes_cmd(service_config: str | None) -> None:
    """All nodes and the derived live leader."""
    cfg = _load(service_config)
    if not cfg.cluster.enabled:
        _emit(single_node_nodes(NodeIdentity.of(cfg.cluster.node_id)))
        return
    store, _ = _open_checked(cfg)
    try:
        _emit(cluster_nodes(store, node_timeout_seconds=cfg.cluster.node_timeout_seconds))
    finally:
        store.close()


@cli.command("up")
@click.option("--no-stack", is_flag=True, help="Only migrate the store and show the cluster (no processes).")
@click.pass_obj
def up(service_config: str | None, no_stack: bool) -> None:
    """Run Stageline on this node's config: the store, Spark Connect, Airflow and listenerd."""
    ctx = click.get_current_context()
    ctx.invoke(db_migrate)
    ctx.invoke(cluster_status_cmd)
    if no_stack:
        return
    from pathlib import Path

    from include.embedded import up as run_stack

    cfg = _load(service_config)
    sys.exit(run_stack(cfg, Path(cfg.source or "stageline.toml").resolve(), echo=click.echo))


@cli.group()
def demo() -> None:
    """Sample traffic for a first look."""


@demo.command("send")
@click.option("--host", default="127.0.0.1")
@click.option("--port", default=2575, show_default=True)
@click.option("--count", default=5, show_default=True, help="messages of each kind")
def demo_send(host: str, port: int, count: int) -> None:
    """Send sample ADT, ORU and ORM messages over MLLP and show each ACK."""
    from include.demo import send_samples

    for control_id, kind, code in send_samples(host, port, count=count):
        click.echo(f"{control_id:<14} {kind:<8} {code}")


def main() -> None:
    cli(prog_name="stageline")


if __name__ == "__main__":
    sys.exit(main())
