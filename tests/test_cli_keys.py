"""`stageline messages find --key` and the keys in `stageline messages show`, as a real subprocess
against real stores (SQLite and PostgreSQL)."""

from __future__ import annotations

import json

from include.app.cli_messages import os_user
from include.keys_config import parse_keys
from include.store import Store
from include.store import keys as K
from include.store.lease import acquire_permanent
from tests.dags.stores import write_service_config
from tests.support.staging import insert_inbound
from tests.test_cli import run


def body(control: str, mrn: str) -> str:
    return f"MSH|^~\\&|ADT1|HOSP|EHR|CITY|20261127120000||ADT^A08|{control}|P|2.5\rPID|1||{mrn}^^^HOSP^MR||DOE^JANE\r"


def staged(config, messages: list[tuple[str, str, str]], keys: dict[str, str] | None = None) -> list[int]:
    """Stage (connection, MRN, trailing segments) messages `CTL0`, `CTL1`, … under a permanent lease,
    index `keys` if given; their inbound ids."""
    store = Store(config)
    try:
        epoch = acquire_permanent(store, node_id="solo:1:aa")
        with store.transaction() as tx:
            ids = [
                insert_inbound(
                    tx,
                    epoch=epoch,
                    node_id="solo:1:aa",
                    message_id=f"m{n}",
                    control_id=f"CTL{n}",
                    connection=connection,
                    payload=body(f"CTL{n}", mrn) + more,
                )
                for n, (connection, mrn, more) in enumerate(messages)
            ]
        if keys:
            K.index(store, parse_keys({"keys": keys}), ids)
    finally:
        store.close()
    return ids


def test_messages_find_by_key_exact_and_prefix_and_show_lists_the_keys(tmp_path, store_config):
    ids = staged(
        store_config,
        [("adt-in", mrn, "") for mrn in ("P77", "P770", "Q1", "P77")],
        {"mrn": "PID-3.1", "event": "MSH-9.2"},
    )
    cfg = write_service_config(tmp_path, store_config, cluster=False)

    found = json.loads(run(cfg, "messages", "find", "--key", "mrn=P77", "--json").stdout)
    assert [(r["id"], r["control_id"], r["key_value"], r["tier"]) for r in found] == [
        (ids[3], "CTL3", "P77", "hot"),
        (ids[0], "CTL0", "P77", "hot"),
    ]
    table = run(cfg, "messages", "find", "--key", "mrn=P7*", "--limit", "2").stdout.splitlines()
    assert table[0].split() == [
        "id",
        "received",
        "(UTC)",
        "connection",
        "control",
        "id",
        "key",
        "value",
        "status",
        "where",
    ]
    assert [line.split()[0] for line in table[1:3]] == [str(ids[3]), str(ids[1])]
    assert table[2].split()[-4:] == ["mrn", "P770", "pending", "hot"] and table[3] == f"(more: --before-id {ids[1]})"
    assert run(cfg, "messages", "find", "--key", "mrn=nobody").stdout == "no messages match\n"

    shown = run(cfg, "messages", "show", "CTL1").stdout
    assert "  keys: event=A08, mrn=P770\n" in shown

    for args, said in (
        (["--key", "mrn"], "NAME=VALUE"),
        (["--key", "mrn=*"], "needs a value"),
        (["--key", "mrn=P77", "--status", "dead"], "--key combines with"),
        (["--key", "mrn=P77", "--since", "yesterday"], "not an ISO date"),
    ):
        failed = run(cfg, "messages", "find", *args, ok=False)
        assert said in failed.stderr and "Traceback" not in failed.stderr


def test_messages_find_by_content_and_hl7_condition_within_a_window(tmp_path, sqlite_config_fresh):
    ids = staged(
        sqlite_config_fresh, [("adt-in", mrn, f"PV1|1|{cls}\r") for mrn, cls in [("P1", "I"), ("P2", "O"), ("P3", "I")]]
    )
    cfg = write_service_config(tmp_path, sqlite_config_fresh, cluster=False)

    def ids_of(*args: str) -> list[int]:
        return [r["id"] for r in json.loads(run(cfg, "messages", "find", *args, "--json").stdout)]

    assert ids_of("--contains", "P2^^^HOSP") == [ids[1]]
    assert ids_of("--where", 'PV1-2 = "I"') == [ids[2], ids[0]]
    assert ids_of("--where", 'PV1-2 = "I"', "--where", "PID-3.1 ~ ^P[12]$") == [ids[0]]
    assert ids_of("--contains", "DOE", "--where", 'PV1-2 != "I"', "--connection", "adt-in") == [ids[1]]
    assert ids_of("--contains", "DOE", "--since", "2000-01-01", "--until", "2000-01-02") == []
    table = run(cfg, "messages", "find", "--contains", "JANE", "--limit", "1").stdout.splitlines()
    assert table[0].split() == ["id", "received", "(UTC)", "connection", "control", "id", "status"]
    assert table[2] == f"(more: --before-id {ids[2]})"
    assert "JANE" not in run(cfg, "messages", "find", "--contains", "JANE").stdout  # no body is shown
    for args, said in (
        (["--contains", "x", "--since", "2026-01-01", "--until", "2026-02-01"], "at most 7 days"),
        (["--where", "PID-8 == F"], "expected PATH"),
        (["--contains", "x", "--status", "dead"], "--contains/--where combine with"),
        (["--contains", ""], "--contains takes"),
    ):
        failed = run(cfg, "messages", "find", *args, ok=False)
        assert said in failed.stderr and "Traceback" not in failed.stderr


def test_saved_searches_are_saved_listed_run_and_deleted_through_the_cli(tmp_path, sqlite_config_fresh):
    ids = staged(
        sqlite_config_fresh,
        [(conn, mrn, "") for mrn, conn in [("P1", "adt-in"), ("P2", "lab-in"), ("P1", "lab-in")]],
        {"mrn": "PID-3.1"},
    )
    cfg = write_service_config(tmp_path, sqlite_config_fresh, cluster=False)

    assert (
        "saved search p1-lab"
        in run(cfg, "searches", "save", "p1-lab", "--contains", "P1^", "--connection", "lab-in").stdout
    )
    run(cfg, "searches", "save", "mrn-p1", "--key", "mrn=P1")
    run(cfg, "searches", "save", "janes", "--where", 'PID-5.2 = "JANE"', "--where", "PID-3.1 exists")
    listed = json.loads(run(cfg, "searches", "list", "--json").stdout)
    assert [(s["name"], s["query"]) for s in listed] == [
        ("janes", {"where": ['PID-5.2 = "JANE"', "PID-3.1 exists"]}),
        ("mrn-p1", {"key": "mrn=P1"}),
        ("p1-lab", {"contains": "P1^", "connection": "lab-in"}),
    ]
    assert listed[1]["saved_by"] == f"cli {os_user()}"  # who runs the CLI, not a name given to it
    assert "--actor" in run(cfg, "searches", "save", "x", "--key", "mrn=1", "--actor", "jdoe", ok=False).stderr
    paged = run(cfg, "searches", "list", "--limit", "2").stdout.splitlines()
    assert [line.split()[0] for line in paged[1:3]] == ["janes", "mrn-p1"] and paged[3] == "(more: --after mrn-p1)"
    assert [s["name"] for s in json.loads(run(cfg, "searches", "list", "--after", "mrn-p1", "--json").stdout)] == [
        "p1-lab"
    ]

    def ran(name: str, *args: str) -> list[int]:
        return [r["id"] for r in json.loads(run(cfg, "searches", "run", name, *args, "--json").stdout)]

    assert ran("p1-lab") == [ids[2]]
    assert ran("mrn-p1") == [ids[2], ids[0]] and ran("mrn-p1", "--limit", "1") == [ids[2]]
    assert ran("janes") == [ids[2], ids[1], ids[0]]
    # saving over a name is refused unless --replace says so; deleting removes
    refused = run(cfg, "searches", "save", "mrn-p1", "--key", "mrn=P2", ok=False)
    assert "a saved search mrn-p1 exists: replace it on purpose (--replace)" in refused.stderr
    assert ran("mrn-p1") == [ids[2], ids[0]]
    run(cfg, "searches", "save", "mrn-p1", "--key", "mrn=P2", "--replace")
    assert ran("mrn-p1") == [ids[1]]
    assert run(cfg, "searches", "delete", "mrn-p1").stdout == "deleted saved search mrn-p1\n"
    for args, said in (
        (["run", "mrn-p1"], "no saved search 'mrn-p1'"),
        (["delete", "mrn-p1"], "no saved search 'mrn-p1'"),
        (["save", "x"], "at least one criterion"),
        (["save", "bad name", "--key", "mrn=1"], "a saved search's name"),
        (["save", "x", "--key", "mrn"], "NAME=VALUE"),
        (["save", "x", "--key", "mrn=1", "--status", "dead"], "--key combines with"),
        (["save", "x", "--where", "PID-8 == F"], "expected PATH"),
    ):
        failed = run(cfg, "searches", *args, ok=False)
        assert said in failed.stderr and "Traceback" not in failed.stderr
    assert [s["name"] for s in json.loads(run(cfg, "searches", "list", "--json").stdout)] == ["janes", "p1-lab"]


def test_a_read_command_is_stopped_at_its_timeout_with_an_error_naming_it(tmp_path, store_config):
    """Reads by `stageline` commands are bounded on the store (`[store] read_timeout_seconds`,
    `--timeout`): a count over 200,000 rows takes longer than a millisecond on either store."""
    from tests.store.test_search import bulk

    store = Store(store_config)
    try:
        bulk(store, 200_000)
    finally:
        store.close()
    cfg = write_service_config(tmp_path, store_config, cluster=False)

    said = "the read ran past 0.001 s and was stopped ([store] read_timeout_seconds / --timeout)"
    for args in (["stages"], ["stages", "--by", "connection"]):
        stopped = run(cfg, *args, "--timeout", "0.001", ok=False)
        assert said in stopped.stderr and "give a longer --timeout" in stopped.stderr, stopped.stderr
        assert stopped.returncode == 1 and "Traceback" not in stopped.stderr
    assert json.loads(run(cfg, "stages", "--json").stdout)["inbound"]["backlog"] == 200_000  # 60 s by default
    cfg.write_text(cfg.read_text().replace("[store]\n", "[store]\nread_timeout_seconds = 0.001\n"))
    assert said in run(cfg, "stages", ok=False).stderr
    assert json.loads(run(cfg, "stages", "--timeout", "60", "--json").stdout)["inbound"]["backlog"] == 200_000
    assert "0<x<=86400" in run(cfg, "stages", "--timeout", "0", ok=False).stderr


def test_a_timeout_out_of_range_is_refused_with_the_range_nan_too(tmp_path, sqlite_config_fresh):
    cfg = write_service_config(tmp_path, sqlite_config_fresh, cluster=False)
    for bad in ("0", "-1", "inf", "nan", "NaN"):
        refused = run(cfg, "messages", "find", "--timeout", bad, ok=False)
        assert refused.returncode == 2 and "0<x<=86400" in refused.stderr, (bad, refused.stderr)
        assert "convert" not in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
