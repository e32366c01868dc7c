"""Saved searches: a name for what `stageline messages find` is asked (a key, a text, conditions,
filters), kept in the store (`saved_searches`, migration 0016) so the CLI, the API and the Stageline
view share them. The time window and the page are not part of one: each run gives its own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from include.conditions import ConditionError
from include.hl7match import parse_where
from include.store import keys, search
from include.store import operator as ops
from include.store.db import Store

Query = keys.KeyQuery | search.ContentQuery | ops.Filters

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
FIELDS = ("key", "contains", "where", "control_id", "message_id", "lane_key", "connection", "destination", "status")
"""What a saved search may hold: `messages find`'s criteria (`where` a list of clauses, the rest text)."""
MAX_TEXT = 1000
LIST_LIMIT = 100
HIDDEN = "…"
"""What a saved search's criteria values read as for someone who may not read bodies."""


def criteria(doc: Mapping[str, Any]) -> dict[str, Any]:
    """`doc` as a saved search's criteria, or ValueError naming what is wrong (unknown field, wrong
    type, too long, empty); None and empty fields are left out."""
    if not isinstance(doc, Mapping):
        raise ValueError("a saved search is a JSON object of messages find's criteria")
    unknown = sorted(set(doc) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}; a saved search holds {', '.join(FIELDS)}")
    out: dict[str, Any] = {}
    for name in FIELDS:
        value = doc.get(name)
        if value is None or value == "" or value == [] or value == ():
            continue
        if name == "where":
            clauses = [value] if isinstance(value, str) else value
            if not isinstance(clauses, (list, tuple)) or not all(isinstance(c, str) for c in clauses):
                raise ValueError("where must be a list of condition texts")
            if sum(len(c) for c in clauses) > MAX_TEXT:
                raise ValueError(f"where is at most {MAX_TEXT} characters")
            out[name] = list(clauses)
        elif not isinstance(value, str) or len(value) > MAX_TEXT or "\x00" in value:
            raise ValueError(f"{name} must be text of at most {MAX_TEXT} characters")
        else:
            out[name] = value
    if not out:
        raise ValueError("a saved search needs at least one criterion")
    return out


def hidden(search: Mapping[str, Any]) -> dict[str, Any]:
    """A saved search as someone who may not read bodies sees it: which criteria it has, not their
    values (an MRN, a name, a text) — a key's name stays (`mrn=…`)."""
    query = dict(search["query"])
    for field in ("lane_key", "contains"):
        if query.get(field):
            query[field] = HIDDEN
    if query.get("key"):
        query["key"] = str(query["key"]).split("=", 1)[0] + "=" + HIDDEN
    if query.get("where"):
        query["where"] = [HIDDEN for _ in query["where"]]
    return {**search, "query": query}


def reveals(wanted: Mapping[str, Any]) -> str | None:
    """What in `wanted` (messages find's criteria) only someone who may read bodies may search by,
    or None: a lane (usually the MRN), a business key or a body's content would each tell whether a
    guessed patient or text is in the store."""
    if wanted.get("lane_key"):
        return "lane filters"
    if any(wanted.get(k) for k in ("key", "contains", "where")):
        return "key and content searches"
    return None


def _name(name: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(
            "a saved search's name is 1-64 letters, digits, '.', '_' or '-' (starting with a letter or digit)"
        )
    return name


class SearchExists(ValueError):
    """A saved search of that name exists and the caller did not say to replace it."""


def save(store: Store, name: str, doc: Mapping[str, Any], *, actor: str, replace: bool = False) -> dict[str, Any]:
    """Save the search `name`; its checked criteria. A name that is taken is SearchExists unless
    `replace`: saving over someone's search is said on purpose, never by a typo. A name taken but for
    case is SearchExists even with `replace` (which saves over that same name only). `actor` is who the
    caller authenticated as (the OS user, the Airflow user), never a name the caller typed."""
    checked = criteria(doc)
    params = {"name": _name(name), "query": json.dumps(checked), "actor": str(actor)[:200]}
    with store.transaction() as tx:
        twin = tx.one("search_case_twin", params)
        if twin is not None:  # `s1` beside `S1` would be told apart by case alone, in a list read by people
            taken = twin["name"]
            raise SearchExists(f"a saved search {taken} exists (names are compared ignoring case): choose another")
        if replace:
            tx.execute("search_save", params)
        elif tx.execute("search_add", params) == 0:
            raise SearchExists(f"a saved search {name} exists: replace it on purpose (--replace)")
    return checked


def _row(row: dict[str, Any]) -> dict[str, Any]:
    return {**row, "query": json.loads(row["query"])}


@dataclass(frozen=True)
class Page:
    """A page of the saved searches by name: up to `limit` after the name `after` (the last of the
    previous page)."""

    limit: int = LIST_LIMIT
    after: str | None = None

    @classmethod
    def from_query(cls, args: Mapping[str, str]) -> Page:
        """`limit` and `after` of a query string (the API's `GET /searches`); ValueError for others."""
        try:
            limit = int(args["limit"]) if args.get("limit") else LIST_LIMIT
        except ValueError:
            raise ValueError("limit must be a whole number") from None
        return cls(limit, args.get("after") or None)

    def params(self) -> dict[str, Any]:
        if not 1 <= self.limit <= ops.MAX_FIND_LIMIT:
            raise ValueError(f"limit must be 1..{ops.MAX_FIND_LIMIT} (page on with after), got {self.limit}")
        return {"limit": self.limit, "after": _name(self.after) if self.after is not None else ""}


def list_all(store: Store, page: Page = Page()) -> list[dict[str, Any]]:
    """A page of the saved searches, by name."""
    params = page.params()
    with store.transaction(write=False) as tx:
        return [_row(r) for r in tx.all("search_list", params)]


def get(store: Store, name: str) -> dict[str, Any] | None:
    with store.transaction(write=False) as tx:
        row = tx.one("search_get", {"name": _name(name)})
    return _row(row) if row is not None else None


def delete(store: Store, name: str) -> bool:
    with store.transaction() as tx:
        return tx.execute("search_delete", {"name": _name(name)}) > 0


def query_for(
    wanted: Mapping[str, Any],
    *,
    since_ms: int | None = None,
    until_ms: int | None = None,
    before_id: int | None = None,
    limit: int = ops.FIND_LIMIT,
) -> Query:
    """The one search `wanted` (`messages find`'s criteria by name) asks for over this window and
    page: by key, by content, or by the filters; ValueError for criteria that do not go together."""
    given = {k for k, v in wanted.items() if v is not None and v != []}
    filters = {"control_id", "message_id", "lane_key", "connection", "destination", "status"}
    if "key" in given:
        if given - {"key"}:
            raise ValueError("--key combines with --since, --until, --before-id and --limit only")
        query = keys.KeyQuery.parse(
            wanted["key"], since_ms=since_ms, until_ms=until_ms, before_id=before_id, limit=limit
        )
        query.params()
        return query
    if given & {"contains", "where"}:
        if given & (filters - {"connection"}):
            raise ValueError("--contains/--where combine with --connection, --since, --until, --before-id, --limit")
        where = wanted.get("where") or []
        clauses = [where] if isinstance(where, str) else list(where)
        try:
            condition = parse_where(" and ".join(clauses)) if clauses else None
        except ConditionError as exc:
            raise ValueError(_at(clauses, exc)) from None
        return search.ContentQuery(
            since_ms, until_ms, wanted.get("contains"), condition, wanted.get("connection"), before_id, limit
        )
    return ops.Filters(
        control_id=wanted.get("control_id"),
        message_id=wanted.get("message_id"),
        lane_key=wanted.get("lane_key"),
        connection=wanted.get("connection"),
        destination=wanted.get("destination"),
        status=wanted.get("status"),
        since_ms=since_ms,
        until_ms=until_ms,
        before_id=before_id,
        limit=limit,
    )


def _at(clauses: list[str], exc: ConditionError) -> str:
    """`exc`, led by which of several `where` clauses it is about (the first that fails alone)."""
    if len(clauses) > 1:
        for number, clause in enumerate(clauses, 1):
            try:
                parse_where(clause)
            except ConditionError:
                return f"where clause {number} of {len(clauses)}: {exc}"
    return str(exc)


def run(store: Store, query: Query) -> list[dict[str, Any]]:
    """The messages `query` finds, newest first."""
    if isinstance(query, search.ContentQuery):
        return search.find(store, query)
    if isinstance(query, keys.KeyQuery):
        return keys.find(store, query)
    return ops.find(store, query)
