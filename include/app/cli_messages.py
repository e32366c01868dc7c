"""`stageline messages …` and `stageline stages`: the operator's questions — where is message X,
why did it fail, send it again, what is stuck and since when (`include/store/operator.py`)."""

from __future__ import annotations

import getpass
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import click

from include.app.cli_common import InputError, _load, _open_checked
from include.app.cli_output import Column, answer, echo_json, json_option, table, when_ms
from include.profiles.check import stored_count
from include.store import keys, saved_searches, search, stats
from include.store import operator as ops
from include.store.db import ReadTimedOut
from include.store.parquet_archive import ParquetArchive


def _store(service_config: str | None, timeout: float | None = None) -> Any:
    """The store, its reads bounded by `timeout` (`--timeout`), else `[store] read_timeout_seconds`."""
    config = _load(service_config)
    store = _open_checked(config)[0]
    store.read_timeout = timeout if timeout is not None else config.store.read_timeout_seconds
    return store


class _Seconds(click.FloatRange):
    """A FloatRange that refuses NaN with the range's own message (NaN compares false to both ends,
    so the range alone lets it through to fail later as a conversion error)."""

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        seconds = super().convert(value, param, ctx)
        if seconds != seconds:
            self.fail(f"{value!r} is not in the range {self._describe_range()}.", param, ctx)
        return seconds


timeout_option = click.option(
    "--timeout",
    type=_Seconds(min=0, min_open=True, max=86_400),
    help="Stop a read that runs longer than this many seconds (default: [store] read_timeout_seconds, 60).",
)


class ReadStopped(click.ClickException):
    """A read ran past its bound: say which bound, and what to do."""

    def __init__(self, exc: ReadTimedOut) -> None:
        super().__init__(f"{exc}: narrow the question (--since/--until, --limit) or give a longer --timeout")


def page_options(command: Any) -> Any:
    """The window, page and time bound of every command that lists messages (`find`, `searches run`)."""
    for option in reversed(
        (
            click.option("--since", help="ISO time (UTC unless given), inclusive."),
            click.option("--until", help="ISO time, exclusive."),
            click.option("--before-id", type=int, help="Page on: the last id of the previous page."),
            click.option("--limit", type=int, default=ops.FIND_LIMIT, show_default=True),
            timeout_option,
        )
    ):
        command = option(command)
    return command


@contextmanager
def _opened(service_config: str | None, timeout: float | None = None) -> Iterator[Any]:
    """The store for one command, closed when it is done, its reads bounded (`_store`); a
    ValueError in it (what the store refuses of the command's input) is the command's InputError,
    a read that ran past its bound ReadStopped."""
    store = _store(service_config, timeout)
    try:
        yield store
    except ValueError as exc:
        raise InputError(str(exc)) from exc
    except ReadTimedOut as exc:
        raise ReadStopped(exc) from None
    finally:
        store.close()


_when = when_ms


def _ms(text: str | None) -> int | None:
    """An ISO time (UTC unless it says otherwise) as epoch milliseconds."""
    if text is None:
        return None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError as exc:
        raise InputError(f"not an ISO date/time: {text!r} (e.g. 2026-11-24T08:00)") from exc
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1000)


def os_user() -> str:
    """The real user this process runs as (its uid, not $USER): who a body read is recorded against."""
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError):
        return getpass.getuser()


def _readable(payload: str | None) -> str:
    """An HL7 body one segment a line (segments end with CR)."""
    if payload is None:
        return "    (no body: purged by retention without an archive)"
    return "\n".join(
        f"    {segment}" for segment in payload.replace("\r\n", "\r").replace("\n", "\r").split("\r") if segment
    )


actor_option = click.option(
    "--actor", default=getpass.getuser, show_default="the OS user", help="Who does this (recorded in the audit trail)."
)
reason_option = click.option("--reason", required=True, help="Why (recorded in the audit trail).")


@click.group()
def messages() -> None:
    """Find, show, replay and requeue messages (audit events name who and why)."""


@messages.command("find")
@click.option(
    "--key",
    "key_search",
    metavar="NAME=VALUE",
    help="A business key of keys.toml: exact (mrn=12345) or a prefix (mrn=123*). Hot, archived and in Parquet.",
)
@click.option(
    "--contains",
    metavar="TEXT",
    help="Bodies holding TEXT (case-sensitive, no wildcards) within --since/--until (a day when not given, 7 at most).",
)
@click.option(
    "--where",
    "where_clauses",
    multiple=True,
    metavar="CONDITION",
    help="""An HL7 condition on the body, e.g. 'PID-8 = "F"' (also !=, ~ regex, in (..), exists; repeatable).""",
)
@click.option("--control-id")
@click.option("--message-id")
@click.option("--lane", "lane_key", help="Lane (e.g. the patient id the connection's lane_key reads).")
@click.option("--connection", help="Inbound connection name.")
@click.option("--destination")
@click.option("--status", type=click.Choice(ops.STATUSES), help="In any stage.")
@page_options
@json_option
@click.pass_obj
def find_cmd(
    service_config: str | None,
    key_search: str | None,
    contains: str | None,
    where_clauses: tuple[str, ...],
    control_id: str | None,
    message_id: str | None,
    lane_key: str | None,
    connection: str | None,
    destination: str | None,
    status: str | None,
    **page: Any,
) -> None:
    """Messages, newest first, narrowed by any of the options (--key: by a business key, with
    --since, --until, --before-id and --limit only; --contains/--where: the bodies of a window)."""
    wanted = {
        "key": key_search,
        "contains": contains,
        "where": list(where_clauses),
        "control_id": control_id,
        "message_id": message_id,
        "lane_key": lane_key,
        "connection": connection,
        "destination": destination,
        "status": status,
    }
    run_find(service_config, wanted, **page)


def run_find(
    service_config: str | None,
    wanted: dict[str, Any],
    *,
    since: str | None,
    until: str | None,
    before_id: int | None,
    limit: int,
    timeout: float | None,
    as_json: bool,
) -> None:
    """`messages find` (and `searches run`) of `wanted`, `messages find`'s criteria by name, over the
    window and page of `page_options`."""
    query = _queries(wanted, _ms(since), _ms(until), before_id, limit)
    with _opened(service_config, timeout) as store:
        rows = saved_searches.run(store, query)
    if as_json:
        echo_json(rows)
        return
    if not rows:
        click.echo("no messages match")
        return
    columns = {keys.KeyQuery: KEY_COLUMNS, search.ContentQuery: CONTENT_COLUMNS}.get(type(query), FIND_COLUMNS)
    click.echo(table(rows, columns))
    if len(rows) == limit:
        click.echo(f"(more: --before-id {rows[-1]['id']})")


def _queries(
    wanted: dict[str, Any], since_ms: int | None, until_ms: int | None, before_id: int | None, limit: int
) -> saved_searches.Query:
    """The one search `wanted` asks for; InputError for criteria that do not go together or are bad."""
    try:
        return saved_searches.query_for(wanted, since_ms=since_ms, until_ms=until_ms, before_id=before_id, limit=limit)
    except ValueError as exc:
        raise InputError(str(exc)) from exc


FIND_COLUMNS = (
    Column("id", "id", right=True),
    Column("created_ms", "received (UTC)", show=when_ms),
    Column("connection", "connection"),
    Column("control_id", "control id"),
    Column("lane_key", "lane"),
    Column("status", "status"),
    Column("routed", "routed", right=True),
    Column("delivered", "delivered", right=True),
    Column("dead", "dead", right=True),
)
CONTENT_COLUMNS = (*FIND_COLUMNS[:4], Column("status", "status"))
KEY_COLUMNS = (
    *FIND_COLUMNS[:4],
    Column("name", "key"),
    Column("key_value", "value"),
    Column("status", "status"),
    Column("tier", "where"),
)


@messages.command("show")
@click.argument("ref")
@click.option(
    "--body",
    "bodies",
    is_flag=True,
    help="Also its bodies (PHI): recorded in the audit trail as a body_read event naming the OS user.",
)
@timeout_option
@json_option
@click.pass_obj
def show_cmd(service_config: str | None, ref: str, bodies: bool, timeout: float | None, as_json: bool) -> None:
    """One message in every stage and its whole audit trail; with --body its bodies too. REF: row id,
    message id or control id.

    Hot, in the archive tables or in the Parquet archive (`[retention] archive_path`) alike. The
    store's credentials (the service config) are what lets this command read at all; --body asks
    for the content on purpose and each such read is an audit event (who: the OS user)."""
    config = _load(service_config)
    parquet = ParquetArchive(config.retention.archive_path) if config.retention.archive_path else None
    reader = ops.Reader(os_user(), "cli") if bodies else None
    try:
        with _opened(service_config, timeout) as store:
            story = ops.show(store, ops.resolve(store, ref, parquet=parquet), parquet=parquet, reader=reader)
    except LookupError as exc:
        raise InputError(str(exc)) from exc
    if as_json:
        echo_json(story.__dict__)
        return
    i = story.inbound
    click.echo(
        f"message {i['message_id']} (inbound row {i['id']}), control id {i['control_id'] or '-'}\n"
        f"  received {_when(i['created_ms'])} on {i['connection']}, lane {i['lane_key'] or '-'}, "
        f"charset {i['charset'] or '-'}; status {i['status']} after {i['attempts']} attempt(s)"
        + (f"; last error: {i['last_error']}" if i["last_error"] else "")
        + (f"; archived {_when(i['archived_ms'])}" if i.get("archived_ms") is not None else "")
    )
    if story.keys:
        click.echo("  keys: " + ", ".join(f"{k['name']}={k['key_value']}" for k in story.keys))
    if i.get("batch_id") is not None:
        click.echo(_hl7_batch_line(i, story.hl7_batch))
    for line in _findings_lines(i.get("findings")):
        click.echo(line)
    if bodies:
        click.echo("  as received:")
        click.echo(_readable(i["payload"]))
    for r in story.routed:
        click.echo(
            f"  routed row {r['id']} → {r['destination']} (route {r['route_name'] or '-'}): {r['status']}, "
            f"{r['attempts']} attempt(s)" + _row_tail(r)
        )
    for o in story.outbound:
        click.echo(
            f"  outbound row {o['id']} → {o['destination']}: {o['status']}, {o['attempts']} attempt(s), "
            f"updated {_when(o['updated_ms'])}, key {o['idempotency_key']}" + _row_tail(o)
        )
        if bodies:
            click.echo(_readable(o["payload"]))
    for b in story.batches:
        click.echo(
            f"  moved by {b['stage']} batch {b['owner']} ({b['dag_id']}, run {b['run_id']}, try "
            f"{b['try_number']}): {_when(b['started_ms'])} → {_when(b['finished_ms'])}, claimed {b['claimed']}"
        )
    click.echo("  audit trail:")
    for e in story.trail:
        click.echo(
            f"    {_when(e['at_ms'])}  {e['stage']:<8} row {e['row_id']:<6} {e['event']:<10} "
            f"{(e['from_status'] or '-')}→{e['to_status']}"
            + (f" [{e['destination']}]" if e["destination"] else "")
            + (f" epoch {e['epoch']}" if e["epoch"] is not None else "")
            + (f" by {e['node_id']}" if e["node_id"] else "")
            + (f": {e['detail']}" if e["detail"] else "")
            + (" (archived)" if e.get("archived_ms") is not None else "")
        )
    if not bodies:
        click.echo("  (bodies not shown: add --body; each read of them is recorded in the audit trail)")


def _row_tail(row: dict) -> str:
    """What ends a staged row's line in `messages show`: its last error, and whether it is archived."""
    return (f"; {row['last_error']}" if row["last_error"] else "") + (
        " (archived)" if row.get("archived_ms") is not None else ""
    )


def _hl7_batch_line(inbound: dict[str, Any], batch: dict[str, Any] | None) -> str:
    """`in batch <id>: message k of n`, with what the sender said of the batch (FHS-11, BHS-11, BTS-1)."""
    line = f"  in batch {inbound['batch_id']}: message {inbound['batch_seq']}"
    if batch is None:  # its record is in neither table (an operator removed it from the archive)
        return line
    return (
        line
        + f" of {batch['message_count']}"
        + (f" (declared {batch['declared_count']})" if batch["declared_count"] is not None else "")
        + f", FHS {batch['fhs_control_id'] or '-'}, BHS {batch['bhs_control_id'] or '-'}, "
        f"received {_when(batch['created_ms'])} on {batch['connection']}"
        + (f"; archived {_when(batch['archived_ms'])}" if batch["archived_ms"] is not None else "")
    )


@messages.command("replay")
@click.argument("refs", nargs=-1, required=True)
@click.option(
    "--from",
    "source",
    type=click.Choice(ops.REPLAY_FROM),
    required=True,
    help="inbound: stage it again (today's routes, transforms, destinations; behind its lane's queue). "
    "outbound: send the same bytes again (its place in its lane).",
)
@actor_option
@reason_option
@json_option
@click.pass_obj
def replay_cmd(
    service_config: str | None, refs: tuple[str, ...], source: str, actor: str, reason: str, as_json: bool = False
) -> None:
    """Run messages again from a stage: a new attempt, recorded in the audit trail; history stays."""
    store = _store(service_config)
    try:
        ids = [ops.resolve(store, ref) for ref in refs]
        moved = ops.replay(store, ids, source=source, actor=actor, reason=reason)
    except LookupError as exc:
        raise InputError(str(exc)) from exc
    finally:
        store.close()
    what = "new inbound row(s)" if source == "inbound" else "outbound row(s) back to pending"
    answer(
        as_json,
        {"from": source, "messages": ids, "rows": moved},
        lambda: f"replayed {len(ids)} message(s) from {source}: {what} {', '.join(map(str, moved)) or 'none'}",
    )


@messages.command("requeue")
@click.argument("ids", nargs=-1, type=int)
@click.option(
    "--stage",
    type=click.Choice(["inbound", "routed", "outbound"]),
    default="outbound",
    show_default=True,
    help="Whose dead letters (row ids are this stage's).",
)
@click.option("--destination", help="Every dead letter of this destination.")
@click.option("--lane", "lane_key", help="Every dead letter of this lane.")
@actor_option
@reason_option
@json_option
@click.pass_obj
def requeue_cmd(
    service_config: str | None,
    ids: tuple[int, ...],
    stage: str,
    destination: str | None,
    lane_key: str | None,
    actor: str,
    reason: str,
    as_json: bool = False,
) -> None:
    """Dead letters back to pending (attempts reset, same bytes, same place in their lane, so a dead
    lane drains in order). By row IDS, or all of a --destination and/or --lane."""
    if not ids and destination is None and lane_key is None:
        raise InputError("name the dead letters: row IDS, --destination or --lane")
    table = ops.table_of(stage)
    with _opened(service_config) as store:
        chosen = list(ids) or ops.dead_ids(store, table, destination=destination, lane_key=lane_key)
        moved = ops.requeue(store, table, chosen, actor=actor, reason=reason)
    skipped = sorted(set(chosen) - set(moved))
    answer(
        as_json,
        {"stage": stage, "requeued": list(moved), "left_alone": skipped},
        lambda: (
            f"requeued {len(moved)} {stage} row(s)"
            + (f": {', '.join(map(str, moved))}" if moved else "")
            + (f"; not dead, left alone: {', '.join(map(str, skipped))}" if skipped else "")
        ),
    )


@messages.command("content-index")
@click.option("--drop", is_flag=True, help="Remove it: searches read their window's bodies again.")
@click.pass_obj
def content_index_cmd(service_config: str | None, drop: bool) -> None:
    """Make (or --drop) the index `messages find --contains` uses where the store has one: PostgreSQL's
    pg_trgm index (built concurrently), SQLite's FTS5 trigram index (kept by triggers on every body
    written from then on: ingest pays for it). docs/operations.md, "Content search"."""
    with _opened(service_config) as store:
        if drop:
            search.drop_index(store)
            click.echo("content index dropped: a content search reads its window's bodies")
            return
        started = time.monotonic()
        n = search.create_index(store)
    what = f" over {n:,} bodies" if n >= 0 else ""
    click.echo(f"content index made{what} in {time.monotonic() - started:.1f} s")


@messages.command("dead")
@timeout_option
@json_option
@click.pass_obj
def dead_cmd(service_config: str | None, timeout: float | None, as_json: bool) -> None:
    """Dead letters grouped by stage, destination and reason."""
    with _opened(service_config, timeout) as store:
        groups = ops.dead_letters(store)
    if as_json:
        echo_json(groups)
        return
    if not groups:
        click.echo("no dead letters")
        return
    click.echo(table(groups, DEAD_COLUMNS))
    click.echo("requeue with: stageline messages requeue --stage STAGE --destination NAME --reason WHY")


DEAD_COLUMNS = (
    Column("n", "dead", right=True),
    Column("stage", "stage"),
    Column("destination", "destination"),
    Column("oldest_ms", "oldest (UTC)", show=when_ms),
    Column("reason", "reason"),
)


@click.command("stages")
@click.option("--batches", "recent", type=int, default=0, help="Also the latest N micro-batches (stage_batches).")
@click.option(
    "--by",
    type=click.Choice(stats.BY),
    help="Per destination or per inbound connection instead of per stage: received, filtered, queued, "
    "retrying, in flight, sent, dead, delivery latency p50/p95 (last 5 min and hour).",
)
@timeout_option
@json_option
@click.pass_obj
def stages(service_config: str | None, recent: int, by: str | None, timeout: float | None, as_json: bool) -> None:
    """Per stage: backlog, oldest pending age, in flight, dead letters, finished per minute (last 5 min).
    With --by: each destination's or connection's health."""
    if by is not None:
        with _opened(service_config, timeout) as store:
            doc = stats.health(store, by=by)
        answer(as_json, doc, lambda: _health_text(doc))
        return
    try:
        with _opened(service_config, timeout) as store:
            overview = ops.stages(store)
            batches = ops.recent_batches(store, limit=recent) if recent > 0 else []
    except InputError as exc:
        raise InputError(f"--batches: {exc.message}") from exc
    if as_json:
        echo_json({**overview, **({"batches": batches} if recent > 0 else {})})
        return
    click.echo(table([{"stage": stage, **s} for stage, s in overview.items()], STAGE_COLUMNS))
    if batches:
        click.echo()
        click.echo(
            table(
                [{**b, "seconds": (int(b["finished_ms"]) - int(b["started_ms"])) / 1000} for b in batches],
                BATCH_COLUMNS,
            )
        )


STAGE_COLUMNS = (
    Column("stage", "stage"),
    Column("backlog", "backlog", right=True),
    Column("oldest_pending_seconds", "oldest s", right=True, show=lambda v: "-" if v is None else f"{v:.1f}"),
    Column("in_flight", "in flight", right=True),
    Column("dead", "dead", right=True),
    Column("finished_per_minute", "done/min", right=True),
)
BATCH_COLUMNS = (
    Column("finished_ms", "finished (UTC)", show=when_ms),
    Column("stage", "stage"),
    Column("seconds", "took s", right=True, show=lambda v: f"{v:.2f}"),
    Column("claimed", "claimed", right=True),
    Column("dag_id", "dag"),
    Column("run_id", "run"),
    Column("try_number", "try", right=True),
    Column("counts", "counts"),
)


def _seconds(v: Any) -> str:
    return "-" if v is None else f"{v:.2f}"


def _health_text(doc: dict[str, Any]) -> str:
    """One line per destination (or connection): its rows open now, then the last 5 minutes and
    hour (`~` before a p95 computed from the newest deliveries only: docs/operations.md)."""
    by = doc["by"]
    if not doc["rows"]:
        return f"(no {by} has had traffic in the last hour, nor has rows open)"
    rows = []
    for r in doc["rows"]:
        w5, w1 = r["windows"]["5m"], r["windows"]["1h"]
        flat = {k: v for k, v in r.items() if k != "windows"}
        flat.update({f"{k}_5m": v for k, v in w5.items()}, **{f"{k}_1h": v for k, v in w1.items()})
        flat["p95_1h"] = ("~" if w1["sampled"] else "") + _seconds(w1["p95_seconds"])
        rows.append(flat)
    counts = ["received_5m", *(["filtered_5m"] if by == "connection" else []), "sent_5m", "dead_5m"]
    return table(
        rows,
        (
            Column(by, by),
            *HEALTH_NOW,
            *(Column(k, k.replace("received", "recv").replace("filtered", "filt"), right=True) for k in counts),
            Column("p50_seconds_5m", "p50_5m", right=True, show=_seconds),
            Column("p95_seconds_5m", "p95_5m", right=True, show=_seconds),
            *(Column(k, k.replace("received", "recv"), right=True) for k in ("received_1h", "sent_1h", "dead_1h")),
            Column("p95_1h", "p95_1h", right=True),
        ),
    )


HEALTH_NOW = (
    Column("queued", "queued", right=True),
    Column("retrying", "retrying", right=True),
    Column("in_flight", "in_flight", right=True),
    Column("dead", "dead", right=True),
    Column("oldest_queued_seconds", "oldest_s", right=True, show=lambda v: "-" if v is None else f"{v:.1f}"),
)


@click.group()
def searches() -> None:
    """Saved searches: a name for `messages find`'s criteria, shared with the API and the Stageline view."""


@searches.command("save")
@click.argument("name")
@click.option("--key", "key_search", metavar="NAME=VALUE")
@click.option("--contains", metavar="TEXT")
@click.option("--where", "where_clauses", multiple=True, metavar="CONDITION")
@click.option("--control-id")
@click.option("--message-id")
@click.option("--lane", "lane_key")
@click.option("--connection")
@click.option("--destination")
@click.option("--status", type=click.Choice(ops.STATUSES))
@click.option("--replace", is_flag=True, help="Save over the search NAME if there is one (refused otherwise).")
@click.pass_obj
def save_search_cmd(
    service_config: str | None, name: str, key_search: str | None, replace: bool, **options: Any
) -> None:
    """Save `messages find`'s criteria as NAME (a name that is taken needs --replace), recorded as
    saved by the OS user running this. The window and the page are given when it runs."""
    where = list(options.pop("where_clauses"))
    wanted = {"key": key_search, **options, "where": where}
    _queries(wanted, None, None, None, ops.FIND_LIMIT)  # refuse what messages find would refuse
    with _opened(service_config) as store:
        saved = saved_searches.save(store, name, wanted, actor=f"cli {os_user()}", replace=replace)
    click.echo(f"saved search {name}: {json.dumps(saved, ensure_ascii=True)}")


@searches.command("list")
@click.option("--limit", type=int, default=saved_searches.LIST_LIMIT, show_default=True)
@click.option("--after", metavar="NAME", help="Page on: the last name of the previous page.")
@timeout_option
@json_option
@click.pass_obj
def list_searches_cmd(
    service_config: str | None, limit: int, after: str | None, timeout: float | None, as_json: bool
) -> None:
    """The saved searches, by name, a page at a time."""
    with _opened(service_config, timeout) as store:
        rows = saved_searches.list_all(store, saved_searches.Page(limit, after))
    if as_json:
        echo_json(rows)
        return
    if not rows:
        click.echo("no saved searches" + (f" after {after}" if after else ""))
        return
    click.echo(
        table(
            [{**r, "query": json.dumps(r["query"], ensure_ascii=True)} for r in rows],
            (
                Column("name", "name"),
                Column("query", "criteria"),
                Column("saved_by", "saved by"),
                Column("saved_ms", "saved (UTC)", show=when_ms),
            ),
        )
    )
    if len(rows) == limit:
        click.echo(f"(more: --after {rows[-1]['name']})")


@searches.command("run")
@click.argument("name")
@page_options
@json_option
@click.pass_obj
def run_search_cmd(service_config: str | None, name: str, **page: Any) -> None:
    """Run the saved search NAME as `messages find` would, over this window and page."""
    with _opened(service_config, page["timeout"]) as store:
        found = saved_searches.get(store, name)
    if found is None:
        raise InputError(f"no saved search {name!r} (stageline searches list)")
    run_find(service_config, found["query"], **page)


@searches.command("delete")
@click.argument("name")
@click.pass_obj
def delete_search_cmd(service_config: str | None, name: str) -> None:
    """Delete the saved search NAME."""
    with _opened(service_config) as store:
        gone = saved_searches.delete(store, name)
    if not gone:
        raise InputError(f"no saved search {name!r} (stageline searches list)")
    click.echo(f"deleted saved search {name}")


def _findings_lines(stored: str | None) -> list[str]:
    """A flagging profile's findings (code, place, rule; no values, so no PHI), one a line."""
    try:
        found = json.loads(stored) if stored else []
    except ValueError:
        return ["  profile findings: (unreadable)"]
    lines = [f"  profile findings: {stored_count(found)}"] if found else []
    return lines + [f"    {f.get('code')} {f.get('where')}  {f.get('text')}" for f in found if isinstance(f, dict)]
