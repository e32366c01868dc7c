"""`stageline` command line: store migration, cluster views, lookup tables and the demo."""

from __future__ import annotations

import csv
import io
import sys
from pathlib import Path

import click

from include import config as cfgmod
from include.app.cli_common import InputError, _emit, _load, _open_checked
from include.app.cli_messages import messages, stages
from include.app.demo import RECEIVER_PORT
from include.store import Store
from include.store import lookups as lookup_tables
from include.store.lease import read_lease
from include.store.membership import NodeIdentity, cluster_nodes, cluster_status, single_node_nodes
from include.store.migrate import ClusterIdentityError, migrate


@click.group()
@click.option(
    "--service-config",
    "service_config",
    envvar=cfgmod.CONFIG_ENV,
    default=None,
    help="Path to stageline.toml (default: ./stageline.toml, or $STAGELINE_CONFIG).",
)
@click.pass_context
def cli(ctx: click.Context, service_config: str | None) -> None:
    """Stageline: HL7-style integration engine on staged SQL tables, Airflow and Spark."""
    ctx.obj = service_config


@cli.group()
def db() -> None:
    """The staged store."""


def _service_config_here(f):
    """`--service-config` after the subcommand too (`stageline db migrate --service-config X`);
    given in both places, the later one wins."""
    return click.option(
        "--service-config",
        "local_config",
        default=None,
        metavar="PATH",
        help="Path to stageline.toml (same as before the command).",
    )(f)


@db.command("migrate")
@_service_config_here
@click.pass_obj
def db_migrate(service_config: str | None, local_config: str | None = None) -> None:
    """Create or upgrade the schema (idempotent) and pin the store to this cluster."""
    cfg = _load(local_config or service_config)
    store = Store(cfg.store)
    try:
        report = migrate(store, cluster_name=cfg.cluster.cluster_name)
    except ClusterIdentityError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        store.close()
    where = (
        cfg.store.path
        if cfg.store.backend == "sqlite"
        else f"{cfg.store.server}:{cfg.store.effective_port}/{cfg.store.database}"
    )
    applied = ", ".join(map(str, report.applied)) or "none (already current)"
    click.echo(
        f"store {cfg.store.backend} at {where}: schema version {report.version}; applied: {applied}; "
        f"cluster {report.cluster_name!r} ({report.cluster_id})"
    )


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
    _emit(
        cluster_status(
            node_id=cfg.cluster.node_id,
            clustered=cfg.cluster.enabled,
            is_leader=is_leader,
            config_version=identity["config_version"],
        )
    )


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


@cli.group()
def lookups() -> None:
    """Lookup tables in the store: the code tables transform `map` rules translate through.

    A table is a CSV file with the header line `code,value`; importing replaces the whole table
    in one transaction, so a transform run sees either the old table or the new one.
    """


def _lookups_store(service_config: str | None) -> Store:
    store, _ = _open_checked(_load(service_config))
    return store


@lookups.command("import")
@click.argument("name")
@click.argument("csv_file", metavar="FILE.csv", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.pass_obj
def lookups_import(service_config: str | None, name: str, csv_file: Path) -> None:
    """Replace lookup table NAME with the `code,value` rows of FILE.csv."""
    try:
        entries = lookup_tables.read_table_file(name, csv_file)
    except lookup_tables.LookupTableError as exc:
        raise InputError(str(exc)) from None
    store = _lookups_store(service_config)
    try:
        with store.transaction() as tx:
            count = lookup_tables.replace_table(tx, name, entries)
    except lookup_tables.LookupTableError as exc:
        raise InputError(f"{csv_file}: {exc}") from None
    finally:
        store.close()
    click.echo(f"lookup table {name!r}: {count} entries imported from {csv_file} (whole table replaced)")


@lookups.command("list")
@click.pass_obj
def lookups_list(service_config: str | None) -> None:
    """Every table: name, entry count, last change (epoch seconds)."""
    store = _lookups_store(service_config)
    try:
        with store.transaction(write=False) as tx:
            rows = lookup_tables.list_tables(tx)
    finally:
        store.close()
    _emit(
        {
            "tables": [
                {"name": r["table_name"], "entries": int(r["entries"]), "updated_at": float(r["updated_at"])}
                for r in rows
            ]
        }
    )


@lookups.command("show")
@click.argument("name")
@click.pass_obj
def lookups_show(service_config: str | None, name: str) -> None:
    """Table NAME as CSV (`code,value`, the format `import` reads) on stdout."""
    store = _lookups_store(service_config)
    try:
        with store.transaction(write=False) as tx:
            entries = lookup_tables.read_all(tx).get(name)
    finally:
        store.close()
    if entries is None:
        raise InputError(f"no lookup table {name!r} (see `stageline lookups list`)")
    text = io.StringIO()
    out = csv.writer(text, lineterminator="\n")
    out.writerow(["code", "value"])
    out.writerows(sorted(entries.items()))
    click.echo(text.getvalue(), nl=False)


@lookups.command("delete")
@click.argument("name")
@click.pass_obj
def lookups_delete(service_config: str | None, name: str) -> None:
    """Delete table NAME (a `map` rule naming it then fails its transform runs)."""
    store = _lookups_store(service_config)
    try:
        with store.transaction() as tx:
            count = lookup_tables.delete_table(tx, name)
    finally:
        store.close()
    if not count:
        raise InputError(f"no lookup table {name!r} (see `stageline lookups list`)")
    click.echo(f"lookup table {name!r} deleted ({count} entries)")


@lookups.command("sync")
@click.argument("directory", metavar="DIR", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.pass_obj
def lookups_sync(service_config: str | None, directory: Path) -> None:
    """Import every DIR/*.csv as the table named by its file stem (patient_class.csv → patient_class),
    all in one transaction. Tables without a file in DIR are left as they are."""
    if not any(directory.glob("*.csv")):
        raise InputError(f"no *.csv files in {directory}")
    store = _lookups_store(service_config)
    try:
        imported = lookup_tables.import_dir(store, directory)
    except lookup_tables.LookupTableError as exc:
        raise InputError(str(exc)) from None
    finally:
        store.close()
    for name, count in imported:
        click.echo(f"lookup table {name!r}: {count} entries imported from {directory / (name + '.csv')}")


@cli.group("config")
def config_group() -> None:
    """Check a config dir before running it, or print its JSON Schema (docs/config-reference.md)."""


def run_config_check(directory: Path | None, service_config: str | None) -> int:
    """The check `listenerd` runs at start (`listeners.config_check`): prints every problem; the
    exit code, 0 when there is none. Without a directory, the pipeline dir beside the service config."""
    from listeners import config_check

    service = str(Path(service_config).resolve()) if service_config else None
    return config_check.main(
        [*([str(directory)] if directory else []), *(["--service-config", service] if service else [])]
    )


@config_group.command("check")
@click.argument("directory", required=False, type=click.Path(path_type=Path))
@_service_config_here
@click.pass_obj
def config_check(service_config: str | None, directory: Path | None, local_config: str | None = None) -> None:
    """Check a whole config dir: connections, routes, destinations, transforms, the lookup tables
    they name, and stageline.toml when --service-config names one. Prints every problem with its
    file and key; exits 2 if there is any. DIRECTORY defaults to the pipeline dir
    ($STAGELINE_PIPELINE_DIR, else config/ beside the service config)."""
    sys.exit(run_config_check(directory, local_config or service_config))


@config_group.command("schema")
@click.option(
    "--file",
    "name",
    type=click.Choice(["connections", "stageline", "routes", "destinations", "transforms"]),
    default=None,
    help="one file's schema (default: all five, as one JSON object by file)",
)
def config_schema(name: str | None) -> None:
    """Print the JSON Schema of the config files, from the models that check them, for an editor
    to validate TOML as it is typed (docs/config-reference.md: taplo's `#:schema` directive)."""
    import json

    from include.schema.json_schema import FILES, schema, schema_text

    if name:
        click.echo(schema_text(name), nl=False)
    else:
        click.echo(json.dumps({f: schema(f) for f in FILES}, indent=2, sort_keys=True))


@cli.command("up")
@click.option("--no-stack", is_flag=True, help="Only migrate the store and show the cluster (no processes).")
@click.option(
    "--config",
    "config_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Config dir: listenerd's connections and the pipeline (routes, transforms, destinations, "
    "lookups). Default: the checkout's config/.",
)
@click.option(
    "--show-secrets",
    is_flag=True,
    help="Print the Airflow admin password and the API token in the banner (default: say which files hold them).",
)
@_service_config_here
@click.pass_obj
def up(
    service_config: str | None,
    no_stack: bool,
    config_dir: Path | None,
    local_config: str | None = None,
    show_secrets: bool = False,
) -> None:
    """Run Stageline on this node's config: the store, Spark Connect, Airflow and listenerd."""
    ctx = click.get_current_context()
    service_config = local_config or service_config
    ctx.obj = service_config
    from include.app.demo import PIPELINE_DIR

    if run_config_check(config_dir or PIPELINE_DIR, service_config):
        raise click.ClickException("the config dir has problems (listed above); nothing was started")
    ctx.invoke(db_migrate)
    ctx.invoke(cluster_status_cmd)
    if no_stack:
        return
    from include.app.embedded import up as run_stack

    cfg = _load(service_config)
    sys.exit(
        run_stack(
            cfg,
            Path(cfg.source or "stageline.toml").resolve(),
            config_dir=config_dir,
            echo=click.echo,
            show_secrets=show_secrets,
        )
    )


@cli.group()
def demo() -> None:
    """Sample traffic, and a demo receiver for the deliveries, for a first look."""


@demo.command("send")
@click.option("--host", default="127.0.0.1")
@click.option("--port", default=2575, show_default=True)
@click.option("--count", default=5, show_default=True, help="messages of each kind")
def demo_send(host: str, port: int, count: int) -> None:
    """Send sample ADT, ORU and ORM messages over MLLP and show each ACK."""
    from include.app.demo import send_samples

    for control_id, kind, code in send_samples(host, port, count=count):
        click.echo(f"{control_id:<14} {kind:<8} {code}")
    click.echo(_deliveries_hint())


def _deliveries_hint() -> str:
    """Where `stageline up`'s deliveries land, in one line."""
    from include.app.demo import delivery_locations
    from include.app.embedded import AIRFLOW_PORT
    from include.config import var_dir
    from include.stage_config import PipelineConfigError

    try:
        where = ", ".join(f"{name} → {place}" for name, place in delivery_locations(var_dir()))
    except PipelineConfigError as exc:
        where = f"see config/destinations.toml ({exc})"
    return (
        f"deliveries (within about a minute): {where}; the stage runs are in the Airflow UI "
        f"http://127.0.0.1:{AIRFLOW_PORT}"
    )


@demo.command("receive")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=RECEIVER_PORT, show_default=True, help="0: any free port (printed at start)")
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="directory for received.hl7 (created if missing)",
)
def demo_receive(host: str, port: int, out_dir: Path) -> None:
    """A demo MLLP receiver (the EHR of the example config): ACKs every message with AA and
    appends it to OUT/received.hl7 — one segment per line, a blank line after each message, a
    re-delivered MSH-10 is ACKed but not written twice. Runs until Ctrl-C / SIGTERM."""
    from include.app.demo import run_receiver

    try:
        run_receiver(host, port, out_dir, echo=click.echo)
    except OSError as exc:
        raise click.ClickException(f"demo receiver on {host}:{port}: {exc}") from exc


cli.add_command(messages)
cli.add_command(stages)


@cli.group()
def lab() -> None:
    """A two-node cluster on this machine, from processes (to watch a failover locally)."""


@lab.command("up")
@click.option("--schedulers", default=2, show_default=True, help="Airflow schedulers (HA: one per node).")
@click.option("--spark-workers", default=2, show_default=True, help="Spark standalone workers (0: local[*]).")
@click.option("--keep", is_flag=True, help="Keep the lab's work dir (logs, data) after Ctrl-C.")
def lab_up(schedulers: int, spark_workers: int, keep: bool) -> None:
    """PostgreSQL, two listenerd nodes behind HAProxy (the VIP), Airflow on PostgreSQL with
    SCHEDULERS schedulers, a Spark standalone cluster with Spark Connect, and a receiver that
    records deliveries. Prints where everything is; Ctrl-C stops everything it started."""
    import signal
    import threading

    from include.app.lab.two_nodes import Lab

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    the_lab = Lab(schedulers=schedulers, spark_workers=spark_workers, keep_workdir=keep, echo=click.echo)
    try:
        the_lab.start()
        click.echo(
            "\n" + the_lab.summary() + "\n\nsend: uv run stageline demo send --port "
            f"{the_lab.vip_port}   (the VIP)\nCtrl-C stops everything."
        )
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        click.echo("stopping the lab ...")
        the_lab.stop()


def main() -> None:
    cli(prog_name="stageline")


if __name__ == "__main__":
    main()
