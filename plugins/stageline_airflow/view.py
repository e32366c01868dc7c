"""The Stageline view in the Airflow UI: an Airflow plugin (`StagelineViewPlugin`) whose FastAPI app
Airflow's own api-server serves under `/stageline/`, with a "Stageline" entry in the UI's nav.

    GET  /stageline/                          the page (server-rendered HTML, `view_html.py`)
    GET  /stageline/api/cluster               nodes, leader, epoch, lease expiry, config mismatch
    GET  /stageline/api/stages                per stage: backlog, oldest pending age, in flight, dead
    GET  /stageline/api/destinations?by=…     each destination's (or connection's) health, with each
                                              destination's deliveries per minute (`include/store/stats.py`)
    GET  /stageline/api/messages?control_id=… find (the `Filters.from_query` fields; `key=mrn=12345` or
                                              `mrn=123*`: by business key; `contains=…&where=…`: content)
    GET  /stageline/api/searches?limit=&after= the saved searches by name; POST {"name", "query"[, "replace": true]}
                                              saves one (a name that is taken: 409 unless replace),
    DELETE /stageline/api/searches/{name}     deletes it; GET …/{name}/run?since_ms=… runs it
    GET  /stageline/api/messages/{ref}        one message in every stage with its trail and batches;
                                              `?body=1`: with its bodies (PHI; a `body_read` audit event)
    GET  /stageline/api/dead                  dead letters by stage, destination and reason
    GET  /stageline/api/batches?stage=…       the latest micro-batches (`stage_batches`)
    POST /stageline/api/messages/{ref}/replay {"from": "inbound"|"outbound", "reason": …}
    POST /stageline/api/requeue               {"stage", "ids" | "destination" | "lane", "reason"}

Everything here is what `stageline messages|stages|cluster` and listenerd's API do, through the
same functions (`include/store/operator.py`, `include/store/membership.py`); this module only
adds Airflow's authentication and roles. Every request needs an Airflow user: the UI's session
cookie (or `Authorization: Bearer <JWT>` from `POST /auth/token`), checked by the api-server's own
`get_user`; none → 401 (the page redirects to Airflow's login instead). Reading needs the auth
manager's custom view "Stageline" (GET); replay and requeue need it for POST and, under the
SimpleAuthManager (whose custom-view check ignores the method), the OP or ADMIN role. The audit
events name the Airflow user (`operator:airflow <username>`). Nothing of a message is logged.

Bodies are PHI: a message reads without them (metadata: what the search lists, its stage rows, its
trail) unless asked for (`body=1`) by a user who may read them: the auth manager's custom view
"Stageline message bodies" (GET) and, under the SimpleAuthManager (which grants every custom view
to VIEWER), the OP or ADMIN role. So Airflow's Viewer and User see metadata only; Op and Admin may
read bodies, and each read is a `body_read` event naming the user (`reader:airflow <username>`).
For a user who may not read bodies a lane key (usually the MRN) shows as a keyed digest
(`lane:<12 hex>`, `include.store.operator.LaneMask`), and so does a business key's value; a lane
filter, a search by key and a content search are refused (403): each would tell whether a guessed
MRN or text is in the store.

The store is the service config's (`$STAGELINE_CONFIG` of the api-server's environment) via
`StagelineStoreHook`, opened at the first request and kept for the process. Airflow builds every
plugin in every component it starts, so the app is built at its first request, not at import.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from airflow.plugins_manager import AirflowPlugin
from fastapi import HTTPException, Request  # here: FastAPI resolves the handlers' annotations in this module

if TYPE_CHECKING:
    from fastapi import FastAPI

    from stageline_airflow.hooks import StagelineStoreHook

log = logging.getLogger(__name__)
T = TypeVar("T")

URL_PREFIX = "/stageline"
RESOURCE = "Stageline"
"""The custom view's resource name, as auth managers see it (`is_authorized_custom_view`)."""
BODY_RESOURCE = "Stageline message bodies"
"""The custom view a user needs (GET) to read message bodies (PHI)."""
OPERATOR_ROLES = ("OP", "ADMIN")
"""SimpleAuthManager roles that may replay and requeue, and read bodies (its other roles: VIEWER, USER)."""


def create_app(hook: StagelineStoreHook | None = None) -> FastAPI:
    """The view's FastAPI app (mount it at `URL_PREFIX`); `hook` reaches the store (default: a
    `StagelineStoreHook` on the service config)."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager
    from airflow.api_fastapi.core_api.security import get_user
    from fastapi import Body, Depends, FastAPI
    from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

    from include.store import operator as ops
    from include.store import saved_searches, stats
    from include.store.membership import cluster_nodes
    from include.store.parquet_archive import ParquetArchive
    from stageline_airflow import view_html
    from stageline_airflow.hooks import StagelineStoreHook

    store_hook = hook or StagelineStoreHook()
    app = FastAPI(title="Stageline", docs_url=None, redoc_url=None, openapi_url=None)

    def may(user: Any, method: Literal["GET", "POST"]) -> bool:
        manager = get_auth_manager()
        if not manager.is_authorized_custom_view(method=method, resource_name=RESOURCE, user=user):
            return False
        if method != "GET" and isinstance(manager, SimpleAuthManager):
            return str(getattr(user, "role", "") or "").upper() in OPERATOR_ROLES
        return True

    def may_read_bodies(user: Any) -> bool:
        manager = get_auth_manager()
        if not (
            may(user, "GET") and manager.is_authorized_custom_view(method="GET", resource_name=BODY_RESOURCE, user=user)
        ):
            return False
        if isinstance(manager, SimpleAuthManager):
            return str(getattr(user, "role", "") or "").upper() in OPERATOR_ROLES
        return True

    lanes = ops.LaneMask()  # lane keys (usually the MRN) for users who may not read bodies (docs/api.md)

    def for_user(user: Any, doc: Any) -> Any:
        """`doc` with lane keys masked unless `user` may read bodies."""
        return doc if may_read_bodies(user) else lanes.apply(doc)

    def lane_filter(user: Any, filters: ops.Filters) -> ops.Filters:
        """`filters`; 403 for a lane filter from a user who may not read bodies (it would tell
        whether a guessed MRN has messages)."""
        if filters.lane_key is not None and not may_read_bodies(user):
            raise HTTPException(403, "lane filters need the OP or ADMIN role")
        return filters

    def searching(user: Any, args: Any) -> saved_searches.Query:
        """The search a query string asks for (`Filters.from_query`'s fields, `key`, `contains`,
        `where`); 403 for a lane, key or content search from a user who may not read bodies."""
        wanted = {k: args.get(k) or None for k in saved_searches.FIELDS if k != "where"}
        wanted["where"] = [w for w in args.getlist("where") if w] if hasattr(args, "getlist") else []
        return checked_search(user, wanted, args)

    def checked_search(user: Any, wanted: dict[str, Any], args: Any) -> saved_searches.Query:
        refused = saved_searches.reveals(wanted)
        if refused and not may_read_bodies(user):
            raise HTTPException(403, f"{refused} need the OP or ADMIN role")
        try:
            page = {k: int(args[k]) for k in ("since_ms", "until_ms", "before_id", "limit") if args.get(k)}
        except ValueError as exc:
            raise ValueError(f"not a number: {exc}") from None
        return saved_searches.query_for(wanted, **page)

    def body_reader(user: Any, asked: str | None) -> ops.Reader | None:
        """The audit trail's reader when bodies are asked for (`body=1`) and allowed; 403 when not allowed."""
        if not _flag(asked):
            return None
        if not may_read_bodies(user):
            raise HTTPException(403, "message bodies need the OP or ADMIN role")
        return ops.Reader(user.get_name(), "airflow")

    def reader(user: Any = Depends(get_user)) -> Any:
        if not may(user, "GET"):
            raise HTTPException(403, "the Stageline view is not permitted to this user")
        return user

    def operator(user: Any = Depends(get_user)) -> Any:
        if not may(user, "POST"):
            raise HTTPException(403, "replay and requeue need the OP or ADMIN role")
        return user

    def actor(user: Any) -> str:
        return f"airflow {user.get_name()}"

    def store() -> Any:
        return store_hook.get_conn()

    def parquet() -> ParquetArchive | None:
        """The Parquet archive (`[retention] archive_path`), read for one message's story."""
        path = store_hook.config.retention.archive_path
        return ParquetArchive(path) if path else None

    def cluster() -> dict[str, Any]:
        return cluster_nodes(store(), node_timeout_seconds=store_hook.config.cluster.node_timeout_seconds) | {
            "clustered": store_hook.config.cluster.enabled,
            "cluster_name": store_hook.config.cluster.cluster_name,
        }

    @app.exception_handler(LookupError)
    def not_found(request: Request, exc: LookupError) -> Response:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(saved_searches.SearchExists)
    def taken(request: Request, exc: saved_searches.SearchExists) -> Response:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(ValueError)
    def bad_input(request: Request, exc: ValueError) -> Response:
        return JSONResponse({"detail": str(exc)}, status_code=400)

    @app.get("/api/cluster")
    @guarded
    def get_cluster(user: Any = Depends(reader)) -> dict[str, Any]:
        return cluster()

    @app.get("/api/stages")
    @guarded
    def get_stages(user: Any = Depends(reader)) -> dict[str, Any]:
        return ops.stages(store())

    @app.get("/api/destinations")
    @guarded
    def get_destinations(by: str = "destination", user: Any = Depends(reader)) -> dict[str, Any]:
        return stats.health(store(), by=by, chart=True)

    @app.get("/api/messages")
    @guarded
    def get_messages(request: Request, user: Any = Depends(reader)) -> dict[str, Any]:
        return for_user(user, {"messages": saved_searches.run(store(), searching(user, request.query_params))})

    @app.get("/api/searches")
    @guarded
    def get_searches(request: Request, user: Any = Depends(reader)) -> dict[str, Any]:
        found = saved_searches.list_all(store(), saved_searches.Page.from_query(request.query_params))
        return {"searches": found if may_read_bodies(user) else [saved_searches.hidden(s) for s in found]}

    @app.post("/api/searches")
    @guarded
    def post_search(body: dict[str, Any] = Body(...), user: Any = Depends(operator)) -> dict[str, Any]:
        query = body.get("query")
        if not isinstance(query, dict):
            raise ValueError("query must be an object of messages find's criteria")
        saved_searches.query_for(saved_searches.criteria(query))  # refuse what a run would refuse
        replace = body.get("replace", False)
        if not isinstance(replace, bool):
            raise ValueError("replace must be true or false")
        saved = saved_searches.save(store(), str(body.get("name", "")), query, actor=actor(user), replace=replace)
        return {"name": body.get("name"), "query": saved}

    @app.delete("/api/searches/{name}")
    @guarded
    def delete_search(name: str, user: Any = Depends(operator)) -> dict[str, Any]:
        if not saved_searches.delete(store(), name):
            raise LookupError(f"no saved search {name!r}")
        return {"deleted": name}

    @app.get("/api/searches/{name}/run")
    @guarded
    def run_search(name: str, request: Request, user: Any = Depends(reader)) -> dict[str, Any]:
        found = saved_searches.get(store(), name)
        if found is None:
            raise LookupError(f"no saved search {name!r}")
        query = checked_search(user, found["query"], request.query_params)
        return for_user(user, {"messages": saved_searches.run(store(), query)})

    @app.get("/api/messages/{ref}")
    @guarded
    def get_message(ref: str, body: str | None = None, user: Any = Depends(reader)) -> dict[str, Any]:
        cold = parquet()
        return for_user(
            user,
            ops.show(
                store(), ops.resolve(store(), ref, parquet=cold), parquet=cold, reader=body_reader(user, body)
            ).__dict__,
        )

    @app.get("/api/dead")
    @guarded
    def get_dead(user: Any = Depends(reader)) -> dict[str, Any]:
        return {"dead_letters": ops.dead_letters(store())}

    @app.get("/api/batches")
    @guarded
    def get_batches(stage: str | None = None, limit: int = 20, user: Any = Depends(reader)) -> dict[str, Any]:
        return {"batches": ops.recent_batches(store(), stage=stage or None, limit=limit)}  # 1..500, else 400

    @app.post("/api/messages/{ref}/replay")
    @guarded
    def post_replay(ref: str, body: dict[str, Any] = Body(...), user: Any = Depends(operator)) -> dict[str, Any]:
        replayed = ops.replay(
            store(),
            [ops.resolve(store(), ref)],
            source=str(body.get("from", "")),
            actor=actor(user),
            reason=_reason(body),
        )
        log.info("stageline view: %s replayed a message from %s", user.get_name(), body.get("from"))
        return {"replayed": replayed}

    @app.post("/api/requeue")
    @guarded
    def post_requeue(body: dict[str, Any] = Body(...), user: Any = Depends(operator)) -> dict[str, Any]:
        try:
            ids = [int(i) for i in body.get("ids") or []]
        except (TypeError, ValueError):
            raise ValueError("ids must be row ids (numbers)") from None
        moved = ops.requeue_dead(
            store(),
            str(body.get("stage") or "outbound"),
            ids=ids,
            destination=body.get("destination") or None,
            lane_key=body.get("lane") or None,
            actor=actor(user),
            reason=_reason(body),
        )
        log.info("stageline view: %s requeued %d %s row(s)", user.get_name(), len(moved), body.get("stage"))
        return {"requeued": moved}

    @app.get("/", response_class=HTMLResponse)
    async def page(request: Request) -> Response:
        from fastapi.concurrency import run_in_threadpool

        try:
            user = await get_user(request, None, None)
        except HTTPException as exc:
            if exc.status_code != 401:
                raise
            login = get_auth_manager().get_url_login(next_url=str(request.url))
            return RedirectResponse(login, status_code=303)
        if not may(user, "GET"):
            raise HTTPException(403, "the Stageline view is not permitted to this user")
        args = request.query_params
        filters = ops.Filters.from_query({**args, "limit": args.get("limit") or "20"})
        filters.params()  # out-of-range figures: 400 before any read
        lane_filter(user, filters)
        key_query = checked_search(user, {"key": args["key"]}, args) if args.get("key") else None
        body_for = body_reader(user, args.get("body"))

        def read() -> view_html.PageData:
            s = store()
            shown, siblings = None, []
            if args.get("show"):
                try:
                    cold = parquet()
                    shown = ops.show(s, ops.resolve(s, args["show"], parquet=cold), parquet=cold, reader=body_for)
                    siblings = _siblings(s, shown) if may_read_bodies(user) else []
                    shown = ops.Story(**for_user(user, shown.__dict__))
                except LookupError:
                    shown = None
            return view_html.PageData(
                user=user.get_name(),
                may_operate=may(user, "POST"),
                cluster=cluster(),
                stages=ops.stages(s),
                destinations=stats.health(s, by="destination", chart=True)["rows"],
                dead=ops.dead_letters(s),
                messages=for_user(user, saved_searches.run(s, key_query) if key_query else ops.find(s, filters)),
                key=args.get("key") or "",
                siblings=siblings,
                filters=filters,
                shown=shown,
                shown_ref=args.get("show"),
                batches=ops.recent_batches(s, limit=20),
                done=args.get("done"),
                may_read_bodies=may_read_bodies(user),
            )

        return HTMLResponse(
            view_html.render(await run_in_threadpool(guarded(read))), headers={"cache-control": "no-store"}
        )

    return app


def _siblings(store: Any, story: Any) -> list[dict[str, Any]]:
    """The other messages that share a business key with the shown one: per key (by name), its
    newest 20, newest first; each row names the key that links it."""
    from include.store import keys

    out: list[dict[str, Any]] = []
    for k in story.keys:
        query = keys.KeyQuery(name=k["name"], value=k["key_value"], limit=21)
        out += [row for row in keys.find(store, query) if row["id"] != story.inbound["id"]][:20]
    return out


def guarded(handler: Callable[..., T]) -> Callable[..., T]:
    """`handler` with a failing store answered 503 (its error's type logged, never its text: it may
    quote a message); bad input (ValueError) and unknown messages (LookupError) pass on."""

    @functools.wraps(handler)
    def run(*args: Any, **kwargs: Any) -> T:
        try:
            return handler(*args, **kwargs)
        except (HTTPException, LookupError, ValueError):
            raise
        except Exception as exc:
            log.warning("stageline view: the store failed: %s", type(exc).__name__)
            raise HTTPException(503, "store unavailable") from None

    return run


def _flag(value: str | None) -> bool:
    """`body=1` / `true` / `yes` asks for bodies; absent, empty, `0`, `false`, `no` does not; else 400."""
    if value is None or value.lower() in ("", "0", "false", "no"):
        return False
    if value.lower() in ("1", "true", "yes"):
        return True
    raise ValueError("body must be 1 or 0")


def _reason(body: dict[str, Any]) -> str:
    reason = body.get("reason")
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError("give a reason (it goes into the audit trail)")
    return reason.strip()


class _LazyApp:
    """An ASGI app that builds the view's app at its first request (see the module docstring)."""

    def __init__(self) -> None:
        self._app: Any = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self._app is None:
            self._app = create_app()
        await self._app(scope, receive, send)


class StagelineViewPlugin(AirflowPlugin):
    """The Stageline view: its app on the api-server, its entry in the UI's nav."""

    name = "stageline"
    fastapi_apps = [{"name": "Stageline view", "app": _LazyApp(), "url_prefix": URL_PREFIX}]
    external_views = [
        {
            "name": "Stageline",
            "href": f"{URL_PREFIX}/",
            "url_route": "stageline",
            "destination": "nav",
            "category": None,
        }
    ]
