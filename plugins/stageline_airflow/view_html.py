"""The Stageline view's one page, rendered on the server (`view.py` reads the store): the cluster,
the stages, each destination's health with a chart of its last hour (inline SVG: nothing fetched
from anywhere else), dead letters with requeue, message search with one message's story and replay, the
latest micro-batches. Every value from the store is escaped. The only script posts the action
forms as JSON to the view's own endpoints (a cross-site form cannot send JSON) and reloads.
A message's bodies (PHI) are on the page only when asked for (`&body=1`) by a user who may read
them; the link says that the read is recorded."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from html import escape
from typing import Any
from urllib.parse import quote, urlencode

from include.profiles.check import stored_count
from include.store.operator import STATUSES, Filters, Story


@dataclass
class PageData:
    user: str
    may_operate: bool
    cluster: dict[str, Any]
    stages: dict[str, dict[str, Any]]
    dead: list[dict[str, Any]]
    messages: list[dict[str, Any]]
    filters: Filters
    shown: Story | None
    shown_ref: str | None
    batches: list[dict[str, Any]]
    done: str | None
    may_read_bodies: bool = False
    destinations: list[dict[str, Any]] | None = None
    """`include.store.stats.health(by="destination", chart=True)`'s rows."""
    key: str = ""
    """The business-key search asked for (`mrn=12345`, `mrn=123*`): `messages` are its hits."""
    siblings: list[dict[str, Any]] = field(default_factory=list)
    """The messages sharing a business key with the shown one (`include.store.keys.find` rows)."""


def e(value: Any) -> str:
    return escape("-" if value is None or value == "" else str(value))


def when_ms(ms: Any) -> str:
    if ms is None:
        return "-"
    return datetime.fromtimestamp(int(ms) / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def when_s(seconds: Any) -> str:
    return "-" if seconds is None else when_ms(float(seconds) * 1000)


def archived(row: dict[str, Any]) -> str:
    """ " (archived)" for a row retention has moved to the archive (`archived_ms`), else ""."""
    return ' <span class="muted">(archived)</span>' if row.get("archived_ms") is not None else ""


def archived_since(row: dict[str, Any]) -> str:
    return f"; archived {when_ms(row['archived_ms'])}" if row.get("archived_ms") is not None else ""


def hl7(payload: str | None) -> str:
    """An HL7 body one segment a line."""
    if payload is None:
        return "(no body: purged by retention without an archive)"
    return "\n".join(s for s in payload.replace("\r\n", "\r").replace("\n", "\r").split("\r") if s)


BATCH_SUFFIX = re.compile(r"#\d+\.\d+$")
"""A batch's run id is its DAG run's id plus `#<try>.<n>` (`include.stage_loop`)."""


def run_link(batch: dict[str, Any]) -> str:
    """The Airflow DAG run that ran a batch (Airflow 3's UI route), opened in the whole window."""
    dag_run = BATCH_SUFFIX.sub("", str(batch["run_id"]))
    href = f"/dags/{quote(str(batch['dag_id']), safe='')}/runs/{quote(dag_run, safe='')}"
    return f'<a class="run" href="{escape(href)}" target="_top">{e(batch["dag_id"])} / {e(batch["run_id"])}</a>'


def action(url: str, fields: dict[str, Any], label: str, *, may: bool, extra: str = "") -> str:
    """A form the script posts as JSON: hidden `fields`, a reason box (required), a button."""
    if not may:
        return '<span class="muted">(OP role needed)</span>'
    hidden = f'<input type="hidden" name="payload" value="{escape(json.dumps(fields))}">'
    return (
        f'<form class="action" method="post" action="{escape(url)}">{hidden}{extra}'
        f'<input name="reason" placeholder="reason (audit trail)" required size="22">'
        f'<button type="submit">{escape(label)}</button></form>'
    )


def cluster_section(c: dict[str, Any]) -> str:
    now = c.get("db_now")
    expires = c.get("lease_expires_at")
    if c.get("lease_owner") is None:
        lease = '<span class="bad">no live leader</span>'
    elif expires is None:
        lease = "permanent (single node)"
    else:
        lease = f"{when_s(expires)} (in {max(0.0, float(expires) - float(now or expires)):.1f} s)"
    mismatch = c.get("config_mismatch") or []
    rows = "".join(
        f'<tr class="{"leader" if n["is_leader"] else ""}"><td>{e(n["node_id"])}</td><td>{e(n["host"])}</td>'
        f"<td>{e(n['pid'])}</td><td>{e(n['status'])}</td><td>{when_s(n['last_seen'])}</td>"
        f"<td>{'leader' if n['is_leader'] else ''}</td>"
        f"<td>{'<span class=bad>differs from the leader</span>' if n['node_id'] in mismatch else 'ok'}</td></tr>"
        for n in c.get("nodes", [])
    )
    return f"""<section id="cluster"><h2>Cluster <small>{e(c.get("cluster_name"))},
 {"clustered" if c.get("clustered") else "single node"}</small></h2>
<dl class="facts"><dt>leader</dt><dd id="leader">{e(c.get("leader_node_id"))}</dd>
<dt>epoch</dt><dd id="epoch">{e(c.get("epoch"))}</dd>
<dt>lease owner</dt><dd>{e(c.get("lease_owner"))}</dd><dt>lease expires</dt><dd>{lease}</dd>
<dt>config mismatch</dt><dd id="mismatch">{
        ('<span class="bad">' + e(", ".join(mismatch)) + "</span>") if mismatch else "none"
    }</dd></dl>
<table><thead><tr><th>node</th><th>host</th><th>pid</th><th>status</th><th>last seen</th><th></th><th>config</th>
</tr></thead><tbody>{rows or '<tr><td colspan="7">no node has joined this store yet</td></tr>'}</tbody></table>
</section>"""


def age(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f} s"


def stages_section(stages: dict[str, dict[str, Any]]) -> str:
    rows = "".join(
        f'<tr><td>{e(name)}</td><td class="n">{s["backlog"]}</td>'
        f'<td class="n">{age(s["oldest_pending_seconds"])}</td>'
        f'<td class="n">{s["in_flight"]}</td><td class="n{" bad" if s["dead"] else ""}">{s["dead"]}</td>'
        f'<td class="n">{s["finished_per_minute"]}</td></tr>'
        for name, s in stages.items()
    )
    return f"""<section id="stages"><h2>Stages</h2><table><thead><tr><th>stage</th><th>backlog</th>
<th>oldest pending</th><th>in flight</th><th>dead letters</th><th>done / min (5 min)</th></tr></thead>
<tbody>{rows}</tbody></table></section>"""


CHART_W, CHART_H, BAR = 180, 32, 3


def chart(name: str, minutes: list[dict[str, int]]) -> str:
    """A destination's last hour as inline SVG: one bar a minute, deliveries done (green) with the
    dead letters of that minute stacked on top (red), scaled to the busiest minute."""
    top = max([m["sent"] + m["dead"] for m in minutes] + [1])
    bars = []
    for i, m in enumerate(minutes):
        x = i * BAR
        sent_h = round(m["sent"] * CHART_H / top, 1)
        dead_h = round(m["dead"] * CHART_H / top, 1)
        if sent_h:
            bars.append(f'<rect class="sent" x="{x}" y="{CHART_H - sent_h}" width="{BAR - 1}" height="{sent_h}"/>')
        if dead_h:
            y = CHART_H - sent_h - dead_h
            bars.append(f'<rect class="dead" x="{x}" y="{y}" width="{BAR - 1}" height="{dead_h}"/>')
    sent, dead = sum(m["sent"] for m in minutes), sum(m["dead"] for m in minutes)
    label = e(f"{name}: {sent} delivered, {dead} dead-lettered in the last hour (busiest minute {top})")
    return (
        f'<svg class="chart" width="{CHART_W}" height="{CHART_H}" viewBox="0 0 {CHART_W} {CHART_H}" '
        f'role="img" aria-label="{label}"><title>{label}</title>'
        f'<line class="axis" x1="0" y1="{CHART_H - 0.5}" x2="{CHART_W}" y2="{CHART_H - 0.5}"/>{"".join(bars)}</svg>'
    )


def seconds(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} s"


def destination_row(r: dict[str, Any]) -> str:
    now, five, hour = r, r["windows"]["5m"], r["windows"]["1h"]

    def n(value: int, *, alarm: bool = False) -> str:
        return f'<td class="n{" bad" if alarm and value else ""}">{value}</td>'

    return (
        f'<tr data-destination="{e(r["destination"])}"><td>{e(r["destination"])}</td>'
        f"{n(now['queued'])}{n(now['retrying'], alarm=True)}{n(now['in_flight'])}{n(now['dead'], alarm=True)}"
        f'<td class="n">{age(now["oldest_queued_seconds"])}</td>'
        f"{n(five['received'])}{n(five['sent'])}{n(five['dead'], alarm=True)}"
        f'<td class="n">{seconds(five["p50_seconds"])} / {seconds(five["p95_seconds"])}</td>'
        f'{n(hour["sent"])}<td class="n">{seconds(hour["p95_seconds"])}</td>'
        f"<td>{chart(r['destination'], r.get('per_minute') or [])}</td></tr>"
    )


def destinations_section(rows: list[dict[str, Any]] | None) -> str:
    body = "".join(destination_row(r) for r in rows or []) or (
        '<tr><td colspan="13" class="muted">no destination has had traffic in the last hour</td></tr>'
    )
    return f"""<section id="destinations"><h2>Destinations</h2><table><thead>
<tr><th rowspan="2">destination</th><th colspan="5">now</th><th colspan="4">last 5 min</th>
<th colspan="2">last hour</th><th rowspan="2">per minute, last hour<br><small>delivered, dead</small></th></tr>
<tr><th>queued</th><th>retrying</th><th>in flight</th><th>dead</th><th>oldest</th><th>received</th>
<th>sent</th><th>dead</th><th>latency p50 / p95</th><th>sent</th><th>p95</th></tr></thead>
<tbody>{body}</tbody></table></section>"""


def dead_section(dead: list[dict[str, Any]], may: bool) -> str:
    rows = []
    for g in dead:
        if g["destination"]:
            act = action(
                "api/requeue",
                {"stage": g["stage"], "destination": g["destination"]},
                f"requeue all dead {g['stage']} → {g['destination']}",
                may=may,
            )
        else:
            act = (
                f'<a href="?{escape(urlencode({"status": "dead"}))}#search">find them</a>'
                ' <span class="muted">(requeue each from its message)</span>'
            )
        rows.append(
            f"<tr><td>{e(g['stage'])}</td><td>{e(g['destination'])}</td><td>{e(g['reason'])}</td>"
            f'<td class="n">{g["n"]}</td><td>{when_ms(g["oldest_ms"])}</td><td>{act}</td></tr>'
        )
    body = "".join(rows) or '<tr><td colspan="6">no dead letters</td></tr>'
    return f"""<section id="dead"><h2>Dead letters</h2><table><thead><tr><th>stage</th><th>destination</th>
<th>reason</th><th>n</th><th>since</th><th></th></tr></thead><tbody>{body}</tbody></table></section>"""


def search_section(data: PageData) -> str:
    f = data.filters
    fields = "".join(
        f'<label>{label} <input name="{name}" value="{escape(getattr(f, name) or "")}" size="14"></label>'
        for name, label in (
            ("control_id", "control id"),
            ("message_id", "message id"),
            ("lane_key", "lane"),
            ("connection", "connection"),
            ("destination", "destination"),
        )
    )
    options = "".join(f"<option{' selected' if f.status == s else ''}>{s}</option>" for s in STATUSES)
    key_form = (
        '<form method="get" class="key-search" id="key-search"><label>business key <input name="key" '
        f'value="{escape(data.key)}" size="24" placeholder="mrn=12345 or mrn=123*"></label>'
        '<button type="submit">find by key</button></form>'
    )
    if data.key:
        return f"""<section id="search"><h2>Messages</h2>{key_form}
<h3>with {e(data.key)}</h3>{key_table(data.messages, "no messages have this key")}
<p class="muted">newest first, at most {f.limit}; hot, in the archive tables or only in Parquet (where)</p></section>"""
    rows = "".join(
        f'<tr><td><a href="?{escape(urlencode({"show": m["id"]}))}#message">{m["id"]}</a></td>'
        f"<td>{when_ms(m['created_ms'])}</td><td>{e(m['connection'])}</td><td>{e(m['control_id'])}</td>"
        f'<td>{e(m["lane_key"])}</td><td>{e(m["status"])}</td><td class="n">{m["routed"]}</td>'
        f'<td class="n">{m["delivered"]}</td><td class="n{" bad" if m["dead"] else ""}">{m["dead"]}</td></tr>'
        for m in data.messages
    )
    return f"""<section id="search"><h2>Messages</h2>
<form method="get" class="search">{fields}<label>status <select name="status"><option value="">any</option>
{options}</select></label><button type="submit">find</button></form>{key_form}
<table><thead><tr><th>id</th><th>received</th><th>connection</th><th>control id</th><th>lane</th><th>status</th>
<th>routed</th><th>delivered</th><th>dead</th></tr></thead>
<tbody>{rows or '<tr><td colspan="9">no messages match</td></tr>'}</tbody></table>
<p class="muted">newest first, at most {f.limit}; a row id, message id or control id opens one message</p></section>"""


def key_table(rows: list[dict[str, Any]], empty: str) -> str:
    """Messages found by a business key (`include.store.keys.find` rows), each a link to it."""
    body = "".join(
        f'<tr><td><a href="?{escape(urlencode({"show": m["id"]}))}#message">{m["id"]}</a></td>'
        f"<td>{when_ms(m['created_ms'])}</td><td>{e(m['connection'])}</td><td>{e(m['control_id'])}</td>"
        f"<td>{e(m['name'])}={e(m['key_value'])}</td><td>{e(m['status'])}</td><td>{e(m['tier'])}</td></tr>"
        for m in rows
    )
    return (
        '<table class="keyed"><thead><tr><th>id</th><th>received</th><th>connection</th><th>control id</th>'
        f"<th>key</th><th>status</th><th>where</th></tr></thead><tbody>"
        f"{body or f'<tr><td colspan=7>{e(empty)}</td></tr>'}</tbody></table>"
    )


def keys_line(story: Story) -> str:
    """A message's business keys, each a link to the search by it."""
    if not story.keys:
        return ""
    links = ", ".join(
        f'<a href="?{escape(urlencode({"key": k["name"] + "=" + str(k["key_value"])}))}#search">'
        f"{e(k['name'])}={e(k['key_value'])}</a>"
        for k in story.keys
    )
    return f'<p class="keys">keys: {links}</p>'


BATCHES_TABLE = (
    "<h3>Moved by these micro-batches</h3><table><thead><tr><th>stage</th><th>batch owner</th>"
    "<th>Airflow run</th><th>try</th><th>started</th><th>finished</th><th>claimed</th></tr></thead>"
    "<tbody>{batches}</tbody></table>"
)


def message_section(data: PageData) -> str:
    if data.shown is None:
        return (
            f'<section id="message"><h2>Message</h2><p class="bad">no message {e(data.shown_ref)}</p></section>'
            if data.shown_ref
            else ""
        )
    s, may = data.shown, data.may_operate
    i = s.inbound
    ref = str(i["id"])
    replays = action(f"api/messages/{quote(ref)}/replay", {"from": "inbound"}, "replay from inbound", may=may) + action(
        f"api/messages/{quote(ref)}/replay", {"from": "outbound"}, "replay from outbound (same bytes)", may=may
    )
    stage_rows = [
        f"<tr><td>inbound{archived(i)}</td><td>{i['id']}</td><td>-</td><td>{e(i['status'])}</td><td>{i['attempts']}</td>"
        f"<td>{when_ms(i['updated_ms'])}</td><td>{e(i['last_error'])}</td>"
        f"<td>{dead_row_action('inbound', i, may)}</td></tr>"
    ]
    for stage, rows in (("routed", s.routed), ("outbound", s.outbound)):
        stage_rows += [
            f"<tr><td>{stage}{archived(r)}</td><td>{r['id']}</td><td>{e(r['destination'])}</td><td>{e(r['status'])}</td>"
            f"<td>{r['attempts']}</td><td>{when_ms(r['updated_ms'])}</td><td>{e(r['last_error'])}</td>"
            f"<td>{dead_row_action(stage, r, may)}</td></tr>"
            for r in rows
        ]
    delivered = "".join(
        f"<h4>as delivered to {e(o['destination'])} (outbound row {o['id']})</h4>"
        f'<pre class="hl7">{escape(hl7(o.get("payload")))}</pre>'
        for o in s.outbound
    )
    batches = "".join(
        f"<tr><td>{e(b['stage'])}</td><td>{e(b['owner'])}</td><td>{run_link(b)}</td><td>{b['try_number']}</td>"
        f'<td>{when_ms(b["started_ms"])}</td><td>{when_ms(b["finished_ms"])}</td><td class="n">{b["claimed"]}</td></tr>'
        for b in s.batches
    )
    trail = "".join(
        f"<tr><td>{when_ms(t['at_ms'])}{archived(t)}</td><td>{e(t['stage'])}</td><td>{e(t['row_id'])}</td>"
        f'<td class="event">{e(t["event"])}</td><td>{e(t["from_status"])} → {e(t["to_status"])}</td>'
        f"<td>{e(t['destination'])}</td><td>{e(t['epoch'])}</td><td>{e(t['node_id'])}</td><td>{e(t['detail'])}</td></tr>"
        for t in s.trail
    )
    return f"""<section id="message" data-id="{i["id"]}"><h2>Message {e(i["message_id"])} <small>inbound row {i["id"]},
 control id {e(i["control_id"])}</small></h2>
<p>received {when_ms(i["created_ms"])} on <b>{e(i["connection"])}</b>, lane {e(i["lane_key"])},
 charset {e(i["charset"])}; status <b>{e(i["status"])}</b>{archived_since(i)}</p>
{keys_line(s)}{findings_part(i.get("findings"))}<div class="actions">{replays}</div>
<table><thead><tr><th>stage</th><th>row</th><th>destination</th><th>status</th><th>attempts</th><th>updated</th>
<th>last error</th><th></th></tr></thead><tbody>{"".join(stage_rows)}</tbody></table>
<h3>History (message_events)</h3>
<table id="trail"><thead><tr><th>at</th><th>stage</th><th>row</th><th>event</th><th>status</th><th>destination</th>
<th>epoch</th><th>by</th><th>detail</th></tr></thead><tbody>{trail}</tbody></table>
{BATCHES_TABLE.format(batches=batches) if batches else ""}
{siblings_part(data)}
<h3>Bodies</h3>{bodies_part(data, delivered)}
</section>"""


def findings_part(stored: str | None) -> str:
    """A flagging profile's findings: table 0357 code, place, the rule broken (no values: no PHI)."""
    try:
        found = json.loads(stored) if stored else []
    except ValueError:
        return '<p id="findings">profile findings: (unreadable)</p>'
    rows = "".join(
        f"<tr><td>{e(f.get('code'))}</td><td>{e(f.get('where'))}</td><td>{e(f.get('text'))}</td></tr>"
        for f in found
        if isinstance(f, dict)
    )
    if not rows:
        return ""
    return (
        f'<h3>Profile findings ({stored_count(found)})</h3><table id="findings"><thead><tr><th>code</th><th>where</th>'
        f"<th>rule</th></tr></thead><tbody>{rows}</tbody></table>"
    )


def siblings_part(data: PageData) -> str:
    """The messages that share a key with the shown one (only for a user who may read bodies)."""
    if not data.siblings:
        return ""
    return f'<h3>Siblings (messages sharing a key)</h3><div id="siblings">{key_table(data.siblings, "")}</div>'


def bodies_part(data: PageData, delivered: str) -> str:
    """The bodies when the story has them (asked for, allowed, recorded); else how to ask, or why not."""
    assert data.shown is not None
    i = data.shown.inbound
    if "payload" in i:
        return f'<h4>as received</h4><pre class="hl7">{escape(hl7(i["payload"]))}</pre>{delivered}'
    if data.may_read_bodies:
        link = escape(urlencode({"show": i["id"], "body": 1}))
        return (
            f'<p><a id="show-bodies" href="?{link}#message">show the bodies</a> '
            '<span class="muted">(patient data: your read is recorded in the audit trail)</span></p>'
        )
    return '<p class="muted">bodies (patient data) need the OP or ADMIN role</p>'


def dead_row_action(stage: str, row: dict[str, Any], may: bool) -> str:
    if row["status"] != "dead":
        return ""
    return action("api/requeue", {"stage": stage, "ids": [row["id"]]}, "requeue", may=may)


def batches_section(batches: list[dict[str, Any]]) -> str:
    rows = "".join(
        f"<tr><td>{when_ms(b['finished_ms'])}</td><td>{e(b['stage'])}</td>"
        f'<td class="n">{(int(b["finished_ms"]) - int(b["started_ms"])) / 1000:.2f} s</td>'
        f'<td class="n">{b["claimed"]}</td><td>{run_link(b)}</td><td>{b["try_number"]}</td><td>{e(b["epoch"])}</td>'
        f"<td><code>{e(b['counts'])}</code></td></tr>"
        for b in batches
    )
    return f"""<section id="batches"><h2>Recent micro-batches</h2><table><thead><tr><th>finished</th><th>stage</th>
<th>took</th><th>claimed</th><th>Airflow run</th><th>try</th><th>epoch</th><th>counts</th></tr></thead>
<tbody>{rows or '<tr><td colspan="8">no micro-batch has run yet</td></tr>'}</tbody></table></section>"""


STYLE = """
body { font: 13px/1.4 system-ui, sans-serif; margin: 0 16px 24px; color: #1b1f24; background: #fff; }
h1 { font-size: 18px; margin: 12px 0 4px; } h2 { font-size: 15px; margin: 18px 0 6px; border-bottom: 1px solid #ddd; }
h3 { font-size: 13px; margin: 12px 0 4px; } h4 { font-size: 12px; margin: 8px 0 2px; color: #555; }
small, .muted { color: #667; font-weight: normal; } table { border-collapse: collapse; margin: 4px 0; }
th, td { border: 1px solid #dde; padding: 2px 6px; text-align: left; vertical-align: top; }
th { background: #f3f5f8; } td.n { text-align: right; } tr.leader td { background: #eef8ee; }
.bad { color: #b3261e; font-weight: 600; } .banner { background: #e8f1fe; padding: 6px 10px; margin: 8px 0; }
.facts { display: grid; grid-template-columns: max-content auto; gap: 2px 12px; margin: 4px 0; }
.facts dt { color: #556; } .facts dd { margin: 0; }
pre.hl7 { background: #f7f7f9; padding: 6px; margin: 2px 0; white-space: pre-wrap; word-break: break-all; }
form.action { display: inline-flex; gap: 4px; margin: 2px 6px 2px 0; }
form.search label, form.key-search label { margin-right: 8px; }
.actions { margin: 6px 0; } nav a { margin-right: 12px; }
svg.chart { display: block; } svg.chart rect.sent { fill: #2e7d32; } svg.chart rect.dead { fill: #b3261e; }
svg.chart line.axis { stroke: #bbc; stroke-width: 1; }
"""

SCRIPT = """
document.querySelectorAll('form.action').forEach(function (form) {
  form.addEventListener('submit', async function (ev) {
    ev.preventDefault();
    const body = JSON.parse(form.elements.payload.value);
    body.reason = form.elements.reason.value;
    const resp = await fetch(form.action, {method: 'POST', credentials: 'same-origin',
      headers: {'Content-Type': 'application/json'}, body: JSON.stringify(body)});
    const doc = await resp.json().catch(function () { return {}; });
    const said = !resp.ok ? ('refused (' + resp.status + '): ' + (doc.detail || '')) :
      Object.entries(doc).map(function ([what, ids]) {
        return what + ' ' + ids.length + ' row(s)' + (ids.length ? ': ' + ids.join(', ') : '');
      }).join('; ');
    const url = new URL(window.location.href);
    url.searchParams.set('done', said);
    const shown = document.getElementById('message');  // stay on this message (a control id's
    if (shown && shown.dataset.id) url.searchParams.set('show', shown.dataset.id);  // newest may be the replay)
    window.location.href = url.toString();
  });
});
"""


def render(data: PageData) -> str:
    banner = f'<p class="banner" id="done">{e(data.done)}</p>' if data.done else ""
    return f"""<!doctype html><html lang="en"><head><meta charset="utf-8"><title>Stageline</title>
<style>{STYLE}</style></head><body>
<h1>Stageline <small>signed in to Airflow as {e(data.user)}{"" if data.may_operate else " (read only)"}</small></h1>
<nav><a href="#cluster">cluster</a><a href="#stages">stages</a><a href="#destinations">destinations</a>
<a href="#dead">dead letters</a>
<a href="#search">messages</a><a href="#batches">micro-batches</a><a href="./">refresh</a></nav>{banner}
{cluster_section(data.cluster)}{stages_section(data.stages)}{destinations_section(data.destinations)}
{dead_section(data.dead, data.may_operate)}
{search_section(data)}{message_section(data)}{batches_section(data.batches)}
<script>{SCRIPT}</script></body></html>"""
