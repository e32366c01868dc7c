"""`stageline` command line: store migration, cluster views, lookup tables and the demo."""

from __future__ import annotations

import csv
import io
import math
import os
import socket
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import click

from include import config as cfgmod
from include.app.cli_common import (
    CONNECT_TIMEOUT_ENV,
    CONNECT_TIMEOUT_SECONDS,
    InputError,
    StoreNotUsable,
    _load,
    _open_checked,
    reachable_store,
    set_connect_timeout,
)
from include.app.cli_messages import messages, searches, stages
from include.app.cli_output import Column, answer, echo_json, json_option, table, when_s
from include.app.demo import RECEIVER_PORT
from include.store import Store
from include.store import lookups as lookup_tables
from include.store.membership import cluster_nodes
from include.store.migrate import ClusterIdentityError, migrate
from include.store.reach import describe

DEBUG_ENV = "STAGELINE_DEBUG"


class Commands(click.Group):
    """Every failure ends as one line on stderr and a nonzero exit, never a traceback (unless
    $STAGELINE_DEBUG is set): a store error in the middle of a command is exit code 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as exc:
            if os.environ.get(DEBUG_ENV):
                raise
            first = (str(exc).strip().splitlines() or [""])[0]
            raise click.ClickException(f"{type(exc).__name__}: {first} (${DEBUG_ENV}=1 shows the traceback)") from exc


def _finite(seconds: float) -> float:
    """FloatRange lets NaN through (every comparison with it is false)."""
    if math.isnan(seconds):
        raise click.BadParameter("must be a number of seconds, not nan")
    return seconds


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    try:
        version = metadata.version("stageline")
    except metadata.PackageNotFoundError:
        version = "unknown (not installed: run from a checkout without `uv sync`)"
    click.echo(f"stageline {version}")
    ctx.exit()


@click.group(cls=Commands)
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Print the installed version and exit.",
)
@click.option(
    "--service-config",
    "service_config",
    envvar=cfgmod.CONFIG_ENV,
    default=None,
    metavar="PATH",
    help="Path to stageline.toml (default: ./stageline.toml, or $STAGELINE_CONFIG).",
)
@click.option(
    "--connect-timeout",
    type=click.FloatRange(min=1, max=300),
    callback=lambda _ctx, _param, value: _finite(value),
    envvar=CONNECT_TIMEOUT_ENV,
    default=CONNECT_TIMEOUT_SECONDS,
    show_default=True,
    metavar="SECONDS",
    help=f"How long to wait for the store's server to answer (or ${CONNECT_TIMEOUT_ENV}).",
)
@click.pass_context
def cli(ctx: click.Context, service_config: str | None, connect_timeout: float) -> None:
    """Stageline: HL7-style integration engine on staged SQL tables, Airflow and Spark.

    Every command answers in text, or with --json as one JSON document. Exit codes: 0 done, 1 failed,
    2 bad input or config, 3 store not reachable, 4 store not usable (none, no schema, another cluster's)."""
    ctx.obj = service_config
    set_connect_timeout(ctx, connect_timeout)


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
@json_option
@click.pass_obj
def db_migrate(service_config: str | None, local_config: str | None = None, as_json: bool = False) -> None:
    """Create or upgrade the schema (idempotent) and pin the store to this cluster. The one command
    that creates a SQLite store where there is none."""
    cfg = _load(local_config or service_config)
    store = reachable_store(cfg, create=True)
    try:
        report = migrate(store, cluster_name=cfg.cluster.cluster_name)
    except ClusterIdentityError as exc:
        raise StoreNotUsable(str(exc)) from None
    finally:
        store.close()
    doc = {
        "backend": cfg.store.backend,
        "store": describe(cfg.store),
        "version": report.version,
        "applied": report.applied,
        "cluster_name": report.cluster_name,
        "cluster_id": report.cluster_id,
    }
    applied = ", ".join(map(str, report.applied)) or "none (already current)"
    answer(
        as_json,
        doc,
        lambda: (
            f"{doc['store']}: schema version {report.version}; applied: {applied}; "
            f"cluster {report.cluster_name!r} ({report.cluster_id})"
        ),
    )


@cli.group()
def cluster() -> None:
    """Membership and leadership, read from the store: the lease and every node's heartbeat."""


def _pinned_node_id(cfg: cfgmod.ServiceConfig) -> str | None:
    """[cluster].node_id when the config names one; None when it was derived for this very process
    (`host:pid:random`): the CLI is not a node, and must not report itself as one."""
    node_id = cfg.cluster.node_id
    return None if node_id.startswith(f"{socket.gethostname()}:{os.getpid()}:") else node_id


def _cluster_view(cfg: cfgmod.ServiceConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """The store's identity row and its `/cluster/nodes` view (lease, nodes, derived leader), each
    node marked `running` if it beat within [cluster].node_timeout_seconds."""
    timeout = cfg.cluster.node_timeout_seconds
    store, identity = _open_checked(cfg)
    try:
        view = cluster_nodes(store, node_timeout_seconds=timeout)
    finally:
        store.close()
    for node in view["nodes"]:  # heartbeat within the timeout, on the database's clock
        seen = node["last_seen"]
        node["running"] = node["status"] == "active" and seen is not None and seen > view["db_now"] - timeout
    return identity, view


@cluster.command("status")
@json_option
@click.pass_obj
def cluster_status_cmd(service_config: str | None, as_json: bool = False) -> None:
    """What the store says now: who holds the lease, which listenerd is running (a heartbeat within
    [cluster].node_timeout_seconds) and when one last beat; in a cluster, this node's role."""
    cfg = _load(service_config)
    identity, view = _cluster_view(cfg)
    running = [n for n in view["nodes"] if n["running"]]
    beats = [n for n in view["nodes"] if n["last_seen"] is not None]
    last = max(beats, key=lambda n: n["last_seen"]) if beats else None
    node_id = _pinned_node_id(cfg) if cfg.cluster.enabled else (running[0]["node_id"] if running else None)
    me = next((n for n in running if n["node_id"] == node_id), None)
    is_leader = bool(node_id) and view["lease_owner"] == node_id and me is not None
    if not cfg.cluster.enabled:
        role = "single-node" if running else "down"
    elif node_id is None:
        role = None
    else:
        role = "down" if me is None else ("primary" if is_leader else "standby")
    doc = {
        "cluster_name": cfg.cluster.cluster_name,
        "clustered": cfg.cluster.enabled,
        "node_id": node_id,
        "is_leader": is_leader,
        "role": role,
        "config_version": int(identity["config_version"]),
        "lease_owner": view["lease_owner"],
        "lease_expires_at": view["lease_expires_at"],
        "epoch": view["epoch"],
        "leader_node_id": view["leader_node_id"],
        "listenerd_running": [n["node_id"] for n in running],
        "last_heartbeat": None if last is None else {"node_id": last["node_id"], "at": last["last_seen"]},
        "db_now": view["db_now"],
    }
    answer(as_json, doc, lambda: _status_text(doc))


def _status_text(doc: dict[str, Any]) -> str:
    mode = "cluster" if doc["clustered"] else "single node"
    lines = [f"{mode} {doc['cluster_name']!r}, config version {doc['config_version']}"]
    if doc["clustered"]:
        lines.append(
            f"this node: {doc['node_id']}, {doc['role']}"
            if doc["node_id"]
            else "this node: none named ([cluster].node_id is not set: the CLI is not a node)"
        )
    owner = doc["lease_owner"]
    lease = "lease: free (no live owner)" if owner is None else f"lease: held by {owner}, epoch {doc['epoch']}"
    if owner is not None and doc["lease_expires_at"] is not None:
        lease += f", expires {when_s(doc['lease_expires_at'])}"
    lines.append(lease)
    running, last = doc["listenerd_running"], doc["last_heartbeat"]
    if running:
        lines.append(f"listenerd running: {', '.join(running)}")
    elif last is None:
        lines.append("listenerd: none running; none ever beat on this store")
    else:
        age = doc["db_now"] - last["at"]
        lines.append(
            f"listenerd: none running; last heartbeat {when_s(last['at'])} ({age:.0f} s ago) from {last['node_id']}"
        )
    return "\n".join(lines)


NODE_COLUMNS = (
    Column("node_id", "node"),
    Column("host", "host"),
    Column("pid", "pid", right=True),
    Column("status", "status"),
    Column("running", "running", show=lambda v: "yes" if v else "no"),
    Column("is_leader", "leader", show=lambda v: "yes" if v else ""),
    Column("started_at", "started (UTC)", show=when_s),
    Column("last_seen", "last heartbeat (UTC)", show=when_s),
)


@cluster.command("nodes")
@json_option
@click.pass_obj
def cluster_nodes_cmd(service_config: str | None, as_json: bool = False) -> None:
    """Every node that ever beat on this store, the lease and the derived live leader."""
    cfg = _load(service_config)
    _identity, view = _cluster_view(cfg)

    def text() -> str:
        if not view["nodes"]:
            return "no nodes: no listenerd ever ran on this store"
        owner = view["lease_owner"]
        return (
            table(view["nodes"], NODE_COLUMNS)
            + f"\nleader: {view['leader_node_id'] or 'none'}; lease: "
            + (f"{owner}, epoch {view['epoch']}" if owner else "free")
            + (
                f"; config differs from the leader's: {', '.join(view['config_mismatch'])}"
                if view["config_mismatch"]
                else ""
            )
        )

    answer(as_json, view, text)


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
@json_option
@click.pass_obj
def lookups_import(service_config: str | None, name: str, csv_file: Path, as_json: bool = False) -> None:
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
    answer(
        as_json,
        {"imported": [{"name": name, "entries": count, "file": str(csv_file)}]},
        lambda: f"lookup table {name!r}: {count} entries imported from {csv_file} (whole table replaced)",
    )


LOOKUP_COLUMNS = (
    Column("name", "table"),
    Column("entries", "entries", right=True),
    Column("updated_at", "updated (UTC)", show=when_s),
)


@lookups.command("list")
@json_option
@click.pass_obj
def lookups_list(service_config: str | None, as_json: bool = False) -> None:
    """Every table: name, entry count, last change (JSON: epoch seconds)."""
    store = _lookups_store(service_config)
    try:
        with store.transaction(write=False) as tx:
            rows = lookup_tables.list_tables(tx)
    finally:
        store.close()
    tables = [
        {"name": r["table_name"], "entries": int(r["entries"]), "updated_at": float(r["updated_at"])} for r in rows
    ]
    answer(
        as_json,
        {"tables": tables},
        lambda: table(tables, LOOKUP_COLUMNS) if tables else "no lookup tables (import one: stageline lookups import)",
    )


@lookups.command("show")
@click.argument("name")
@json_option
@click.pass_obj
def lookups_show(service_config: str | None, name: str, as_json: bool = False) -> None:
    """Table NAME as CSV (`code,value`, the format `import` reads) on stdout."""
    store = _lookups_store(service_config)
    try:
        with store.transaction(write=False) as tx:
            entries = lookup_tables.read_all(tx).get(name)
    finally:
        store.close()
    if entries is None:
        raise InputError(f"no lookup table {name!r} (see `stageline lookups list`)")
    rows = sorted(entries.items())
    if as_json:
        echo_json({"name": name, "entries": [{"code": c, "value": v} for c, v in rows]})
        return
    text = io.StringIO()
    out = csv.writer(text, lineterminator="\n")
    out.writerow(["code", "value"])
    out.writerows(rows)
    click.echo(text.getvalue(), nl=False)


@lookups.command("delete")
@click.argument("name")
@json_option
@click.pass_obj
def lookups_delete(service_config: str | None, name: str, as_json: bool = False) -> None:
    """Delete table NAME (a `map` rule naming it then fails its transform runs)."""
    store = _lookups_store(service_config)
    try:
        with store.transaction() as tx:
            count = lookup_tables.delete_table(tx, name)
    finally:
        store.close()
    if not count:
        raise InputError(f"no lookup table {name!r} (see `stageline lookups list`)")
    answer(
        as_json,
        {"deleted": {"name": name, "entries": count}},
        lambda: f"lookup table {name!r} deleted ({count} entries)",
    )


@lookups.command("sync")
@click.argument("directory", metavar="DIR", type=click.Path(exists=True, file_okay=False, path_type=Path))
@json_option
@click.pass_obj
def lookups_sync(service_config: str | None, directory: Path, as_json: bool = False) -> None:
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
    doc = {
        "imported": [
            {"name": name, "entries": count, "file": str(directory / (name + ".csv"))} for name, count in imported
        ]
    }
    answer(
        as_json,
        doc,
        lambda: "\n".join(
            f"lookup table {i['name']!r}: {i['entries']} entries imported from {i['file']}" for i in doc["imported"]
        ),
    )


@cli.group("config")
def config_group() -> None:
    """Check a config dir before running it, or print its JSON Schema (docs/config-reference.md)."""


def run_config_check(directory: Path | None, service_config: str | None, *, as_json: bool = False) -> int:
    """The check `listenerd` runs at start (`listeners.config_check`): prints every problem; the
    exit code, 0 when there is none. Without a directory, the pipeline dir beside the service config."""
    from listeners import config_check

    service = str(Path(service_config).resolve()) if service_config else None
    return config_check.main(
        [
            *([str(directory)] if directory else []),
            *(["--service-config", service] if service else []),
            *(["--json"] if as_json else []),
        ]
    )


@config_group.command("check")
@click.argument("directory", required=False, type=click.Path(path_type=Path))
@_service_config_here
@json_option
@click.pass_obj
def config_check(
    service_config: str | None, directory: Path | None, local_config: str | None = None, as_json: bool = False
) -> None:
    """Check a whole config dir: connections, routes, destinations, transforms, the lookup tables
    they name, and stageline.toml when --service-config names one. Prints every problem with its
    file and key; exits 2 if there is any. DIRECTORY defaults to the pipeline dir
    ($STAGELINE_PIPELINE_DIR, else config/ beside the service config)."""
    sys.exit(run_config_check(directory, local_config or service_config, as_json=as_json))


@config_group.command("schema")
@click.option(
    "--file",
    "name",
    type=click.Choice(["connections", "stageline", "routes", "destinations", "transforms"]),
    default=None,
    help="one file's schema (default: all five, as one JSON object by file)",
)
@json_option
def config_schema(name: str | None, as_json: bool = False) -> None:
    """Print the JSON Schema of the config files, from the models that check them, for an editor
    to validate TOML as it is typed (docs/config-reference.md: taplo's `#:schema` directive).
    JSON either way (--json is accepted, like everywhere)."""
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
            handover=True,
        )
    )


@cli.group()
def demo() -> None:
    """Sample traffic, and a demo receiver for the deliveries, for a first look."""


@demo.command("send")
@click.option("--host", default="127.0.0.1")
@click.option("--port", default=2575, show_default=True)
@click.option("--count", default=5, show_default=True, type=click.IntRange(1, 10_000), help="messages of each kind")
@json_option
def demo_send(host: str, port: int, count: int, as_json: bool = False) -> None:
    """Send sample ADT, ORU and ORM messages over MLLP and show each ACK."""
    from include.app.demo import send_samples

    try:
        acks = [{"control_id": c, "kind": k, "ack": a} for c, k, a in send_samples(host, port, count=count)]
    except OSError as exc:
        raise click.ClickException(
            f"cannot send to {host}:{port} ({exc.strerror or exc}): is listenerd running (`stageline up`)?"
        ) from None
    answer(
        as_json,
        {"acks": acks},
        lambda: (
            table(acks, (Column("control_id", "control id"), Column("kind", "kind"), Column("ack", "ACK")))
            + "\n"
            + _deliveries_hint()
        ),
    )


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
cli.add_command(searches)
cli.add_command(stages)


@cli.group()
def lab() -> None:
    """A two-node cluster on this machine, from processes (to watch a failover locally)."""


@lab.command("up")
@click.option("--schedulers", default=2, show_default=True, help="Airflow schedulers (HA: one per node).")
@click.option("--spark-workers", default=2, show_default=True, help="Spark standalone workers (0: local[*]).")
@click.option("--keep", is_flag=True, help="Keep the lab's work dir (logs, data) after Ctrl-C.")
@click.option(
    "--replicated-store",
    is_flag=True,
    help="The store on two PostgreSQL under Patroni (synchronous), three etcd members and HAProxy.",
)
def lab_up(schedulers: int, spark_workers: int, keep: bool, replicated_store: bool) -> None:
    """PostgreSQL, two listenerd nodes behind HAProxy (the VIP), Airflow on PostgreSQL with
    SCHEDULERS schedulers, a Spark standalone cluster with Spark Connect, and a receiver that
    records deliveries. Prints where everything is; Ctrl-C stops everything it started.

    With --replicated-store the PostgreSQL is a Patroni pair (docs/deployment.md): every client
    reaches the primary through HAProxy, and a commit waits for the synchronous standby."""
    import signal
    import threading

    from include.app.lab.two_nodes import Lab

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    the_lab = Lab(
        schedulers=schedulers,
        spark_workers=spark_workers,
        keep_workdir=keep,
        replicated_store=replicated_store,
        echo=click.echo,
    )
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
