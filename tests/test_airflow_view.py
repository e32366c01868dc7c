"""The Stageline view in the Airflow UI (plugins/stageline_airflow/view.py), end to end: a real
Airflow api-server (throwaway AIRFLOW_HOME, free port, the SimpleAuthManager) loads the plugin
and serves the view against a real store that two real clustered listenerd nodes use (one with a
different config dir, so the mismatch shows) and that holds messages received over MLLP with
their audit trails, a dead letter and a micro-batch. Headless Chromium (Debian's `chromium` and
`chromium-driver`, driven by selenium) logs in through Airflow's login page, opens the view from
the UI's nav, sees the cluster and a message's trail, requeues the dead letter and replays a
message; the audit events then name the Airflow user. The endpoints refuse a request without an
Airflow user, and replay/requeue by a VIEWER. Screenshots: the test's tmp dir (paths printed),
the clustered (PostgreSQL) run's copied to docs/img/ (`STAGELINE_VIEW_SCREENSHOTS=0` skips the copy)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import quote

import pytest
from hl7.client import MLLPClient

from include.app.embedded import airflow_env
from include.app.lab.listenerd import Daemon
from include.app.lab.postgres_server import free_port, wait_for
from include.app.supervisor import port_open
from include.config import StoreConfig
from include.stage_loop import claim_owner
from include.store import Store, operator, rowlease
from include.store.db import INBOUND
from include.store.lease import read_lease
from tests.conftest import migrated_sqlite, pg_config
from tests.support import pump
from tests.support.hostile import adt
from tests.support.queries import rows_of

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = {
    "enabled": True,
    "cluster_name": "test-cluster",
    "heartbeat_seconds": 1.0,
    "leader_fence_timeout_seconds": 4.0,
    "leader_lease_ttl_seconds": 6.0,
    "node_timeout_seconds": 5.0,
}
PASSWORDS = {"admin": "admin-pw", "viewer": "viewer-pw"}
DAG_RUN = "manual__2026-11-24T05:00:00+00:00"
AIRFLOW_BIN = str(Path(sys.executable).parent / "airflow")


def http(
    port: int, method: str, path: str, *, token: str | None = None, body: dict | None = None, cookie: str | None = None
) -> tuple[int, dict | str, dict]:
    """One request, no redirects followed: (status, JSON or text, headers)."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if cookie:
        headers["Cookie"] = cookie

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        method=method,
        headers=headers,
        data=json.dumps(body).encode() if body is not None else None,
    )
    try:
        with urllib.request.build_opener(NoRedirect).open(req, timeout=30) as resp:
            status, raw, got = resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as err:
        status, raw, got = err.code, err.read(), dict(err.headers)
    try:
        return status, json.loads(raw), got
    except ValueError:
        return status, raw.decode(errors="replace"), got


def token_for(port: int, user: str) -> str:
    status, doc, _ = http(port, "POST", "/auth/token", body={"username": user, "password": PASSWORDS[user]})
    assert status in (200, 201), doc
    return doc["access_token"]


@pytest.fixture(scope="module")
def airflow_home(tmp_path_factory) -> dict[str, str]:
    """A throwaway AIRFLOW_HOME with a migrated metadata DB (SQLite), shared by the module's api-servers."""
    return migrated_airflow_home(tmp_path_factory.mktemp("airflow-view"))


def migrated_airflow_home(var: Path) -> dict[str, str]:
    """The environment of an AIRFLOW_HOME under `var` with its metadata DB (SQLite) migrated."""
    env = airflow_env(var, var / "stageline.toml")  # the stack's settings; port and users below
    home = Path(env["AIRFLOW_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    (home / "passwords.json").write_text(json.dumps(PASSWORDS))
    env.update(
        {
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin,viewer:viewer",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__LOGGING__LOGGING_LEVEL": "WARNING",
        }
    )
    env.pop("AIRFLOW_CONN_STAGELINE_SPARK", None)
    started = time.monotonic()
    subprocess.run(
        [AIRFLOW_BIN, "db", "migrate"],
        cwd=ROOT,
        env={**os.environ, **env},
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=600,
    )
    print(f"\nairflow metadata DB migrated in {time.monotonic() - started:.1f} s")
    return env


class ApiServer:
    """`airflow api-server` on a free port, in its own process group (stopped by its PID)."""

    def __init__(self, env: dict[str, str], service_config: Path, log: Path) -> None:
        self.port = free_port()
        self.env = {
            **os.environ,
            **env,
            "STAGELINE_CONFIG": str(service_config),
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{self.port}/execution/",
        }
        self.log_path = log
        self.proc: subprocess.Popen | None = None

    def start(self) -> ApiServer:
        self.log = open(self.log_path, "ab")
        started = time.monotonic()
        self.proc = subprocess.Popen(
            [AIRFLOW_BIN, "api-server", "--port", str(self.port)],
            cwd=ROOT,
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

        def up() -> bool:
            if self.proc.poll() is not None:
                return True  # exited: said below
            return port_open(self.port) and http(self.port, "GET", "/api/v2/monitor/health")[0] == 200

        wait_for(up, timeout=240, interval=0.5, what="the Airflow api-server")
        assert self.proc.poll() is None, self.log_path.read_text(errors="replace")[-4000:]
        print(f"airflow api-server up on port {self.port} in {time.monotonic() - started:.1f} s")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if getattr(self, "log", None) is not None:
            self.log.close()


@pytest.fixture(scope="module", params=["postgres", "sqlite"])
def view(request, airflow_home, tmp_path_factory):
    """The api-server with the plugin, on a store that holds messages: PostgreSQL with two clustered
    nodes (B with a config dir of its own: a mismatch), or SQLite with a single node."""
    work = tmp_path_factory.mktemp(f"view-{request.param}")
    mllp = free_port()
    inbound = [{"name": "adt-in", "kind": "mllp", "host": "127.0.0.1", "port": mllp, "lane_key": "PID-3.1"}]
    nodes: list[Daemon] = []
    if request.param == "sqlite":
        store_config = migrated_sqlite(work / "stageline.db")
        nodes.append(Daemon(work / "a", store_config, node_id="node-a:1:aa", inbound=inbound))
    else:
        store_config = request.getfixturevalue("pg_config_fresh_module")
        nodes.append(Daemon(work / "a", store_config, node_id="node-a:1:aa", cluster=CLUSTER, inbound=inbound))
        nodes.append(
            Daemon(
                work / "b",
                store_config,
                node_id="node-b:2:bb",
                cluster=CLUSTER,
                inbound=[{"name": "adt-in", "kind": "mllp", "host": "127.0.0.1", "port": free_port()}],
            )
        )
    server = ApiServer(airflow_home, nodes[0].workdir / "stageline.toml", work / "api-server.log")
    try:
        nodes[0].start()
        wait_for(lambda: nodes[0].status()["is_leader"] and port_open(mllp), timeout=30, what="node A to lead")
        for standby in nodes[1:]:
            standby.start()
            wait_for(lambda: standby.status()["role"] == "standby", timeout=30, what="node B to stand by")
        with MLLPClient("127.0.0.1", mllp) as client:
            for n in range(3):
                client.send_message(adt(f"VIEW{n}", patient=f"P{n}").decode())
        s = Store(store_config)
        try:
            with s.transaction() as tx:  # what a route that keeps failing leaves: a dead letter
                tx.conn.cursor().execute(
                    "UPDATE stage_inbound SET status = 'dead', attempts = 5, "
                    "last_error = 'no route matched' WHERE control_id = 'VIEW2'"
                )
            # a route micro-batch as a stage task runs one (no Spark here: no route matches VIEW0),
            # through the same primitives and history: the message's trail names the batch's owner
            epoch = read_lease(s).epoch
            owner = claim_owner("stage_route", f"{DAG_RUN}#1.0")
            started = time.monotonic()
            with s.transaction() as tx:
                claimed = [r["id"] for r in rowlease.claim_batch(tx, INBOUND, owner=owner, epoch=epoch, limit=1)]
                rowlease.finish_batch(tx, INBOUND, claimed, owner=owner, epoch=epoch, status="unrouted")
            operator.record_batch(
                s,
                stage="route",
                owner=owner,
                dag_id="stage_route",
                run_id=f"{DAG_RUN}#1.0",
                try_number=1,
                epoch=epoch,
                seconds=time.monotonic() - started,
                counts={"claimed": len(claimed), "routed": 0, "unrouted": len(claimed)},
            )
        finally:
            s.close()
        server.start()
        yield server, store_config, request.param
    finally:
        server.stop()
        for node in reversed(nodes):
            node.stop()


@pytest.fixture(scope="module")
def pg_config_fresh_module(pg_server):
    """A new migrated PostgreSQL database for this module's clustered nodes."""
    pg_server.execute("CREATE DATABASE airflow_view TEMPLATE stageline_template")
    yield pg_config(pg_server, "airflow_view")
    pg_server.execute("DROP DATABASE IF EXISTS airflow_view WITH (FORCE)")


def audit_events(store_config: StoreConfig) -> list[dict]:
    return rows_of(
        store_config,
        "SELECT event, stage, control_id, node_id, detail FROM message_events "
        "WHERE node_id LIKE 'operator:%' ORDER BY id",
    )


def test_the_endpoints_refuse_a_request_without_an_airflow_user(view):
    server, store_config, backend = view
    port = server.port
    for method, path in (
        ("GET", "/stageline/api/cluster"),
        ("GET", "/stageline/api/stages"),
        ("GET", "/stageline/api/messages?control_id=VIEW1"),
        ("GET", "/stageline/api/messages/VIEW1"),
        ("GET", "/stageline/api/dead"),
        ("GET", "/stageline/api/batches"),
        ("POST", "/stageline/api/requeue"),
        ("POST", "/stageline/api/messages/VIEW1/replay"),
    ):
        body = {"stage": "inbound", "lane": "P2", "from": "inbound", "reason": "x"} if method == "POST" else None
        status, doc, _ = http(port, method, path, body=body)
        assert status == 401, (path, status, doc)
        assert "VIEW" not in json.dumps(doc) and "DOE" not in json.dumps(doc)
        assert http(port, method, path, body=body, token="not-a-jwt")[0] in (401, 403), path
        assert http(port, method, path, body=body, cookie="_token=forged")[0] in (401, 403), path
    # the page sends a browser without a session to Airflow's login, showing nothing
    status, page, headers = http(port, "GET", "/stageline/")
    assert status == 303 and "/auth/login" in headers["location"] and "VIEW" not in str(page)

    # a VIEWER reads, but may not replay or requeue; an admin may
    viewer = token_for(port, "viewer")
    status, cluster, _ = http(port, "GET", "/stageline/api/cluster", token=viewer)
    assert status == 200 and cluster["leader_node_id"] == "node-a:1:aa" and cluster["epoch"] >= 1
    assert cluster["config_mismatch"] == (["node-b:2:bb"] if backend == "postgres" else [])
    if backend == "sqlite":  # single node: the lease is the node's for good
        assert cluster["lease_expires_at"] is None and cluster["lease_owner"] == "node-a:1:aa"
    else:
        assert cluster["lease_expires_at"] > cluster["db_now"]
    status, found, _ = http(port, "GET", "/stageline/api/messages?control_id=VIEW1", token=viewer)
    assert status == 200 and [m["control_id"] for m in found["messages"]] == ["VIEW1"]
    assert (
        http(
            port, "POST", "/stageline/api/requeue", token=viewer, body={"stage": "inbound", "lane": "P2", "reason": "x"}
        )[0]
        == 403
    )
    assert (
        http(
            port, "POST", "/stageline/api/messages/VIEW1/replay", token=viewer, body={"from": "inbound", "reason": "x"}
        )[0]
        == 403
    )
    admin = token_for(port, "admin")
    assert http(port, "POST", "/stageline/api/messages/VIEW1/replay", token=admin, body={"from": "inbound"})[0] == 400
    assert http(port, "GET", "/stageline/api/messages/NOPE", token=admin)[0] == 404
    assert not [e for e in audit_events(store_config) if e["control_id"] in ("VIEW1", "VIEW2")]


def body_reads(store_config: StoreConfig, control_id: str) -> list[tuple[str, str]]:
    s = Store(store_config)
    try:
        with s.transaction(write=False) as tx:
            cur = tx.conn.cursor()
            cur.execute(
                "SELECT node_id, detail FROM message_events WHERE event = 'body_read' AND control_id = "
                f"'{control_id}' ORDER BY id"
            )  # a test's own constant
            return [(r["node_id"], r["detail"]) for r in cur.fetchall()]
    finally:
        s.close()


def test_bodies_are_for_op_and_admin_only_on_purpose_and_each_read_is_recorded(view):
    """Airflow's Viewer reads metadata only (API and page); an Admin reads bodies when asking
    (`body=1`), and each such read is a body_read event naming the Airflow user."""
    server, store_config, _ = view
    port = server.port
    viewer, admin = token_for(port, "viewer"), token_for(port, "admin")
    for token in (viewer, admin):
        status, story, _ = http(port, "GET", "/stageline/api/messages/VIEW1", token=token)
        assert status == 200 and story["inbound"]["control_id"] == "VIEW1"
        assert "payload" not in story["inbound"] and "DOE^JANE" not in json.dumps(story)
    status, doc, _ = http(port, "GET", "/stageline/api/messages/VIEW1?body=1", token=viewer)
    assert (status, doc) == (403, {"detail": "message bodies need the OP or ADMIN role"})
    status, page, _ = http(port, "GET", "/stageline/?show=VIEW1", cookie=f"_token={viewer}")
    assert status == 200 and "need the OP or ADMIN role" in page and "DOE^JANE" not in page
    assert 'id="show-bodies"' not in page
    assert http(port, "GET", "/stageline/?show=VIEW1&body=1", cookie=f"_token={viewer}")[0] == 403
    assert body_reads(store_config, "VIEW1") == []

    status, story, _ = http(port, "GET", "/stageline/api/messages/VIEW1?body=1", token=admin)
    assert status == 200 and "PID|1||P1||DOE^JANE" in story["inbound"]["payload"]
    status, page, _ = http(port, "GET", "/stageline/?show=VIEW1", cookie=f"_token={admin}")
    assert status == 200 and 'id="show-bodies"' in page and "DOE^JANE" not in page
    status, page, _ = http(port, "GET", "/stageline/?show=VIEW1&body=1", cookie=f"_token={admin}")
    assert status == 200 and "PID|1||P1||DOE^JANE" in page
    assert body_reads(store_config, "VIEW1") == [("reader:airflow admin", "bodies read via airflow")] * 2
    status, doc, _ = http(port, "GET", "/stageline/api/messages?limit=100000000", token=viewer)
    assert (status, doc) == (400, {"detail": "limit must be 1..1000 (page on with before_id), got 100000000"})
    status, doc, _ = http(port, "GET", "/stageline/api/batches?limit=100000", token=viewer)
    assert (status, doc) == (400, {"detail": "limit must be 1..500, got 100000"})


def chromium(tmp_path: Path):
    """Debian's headless Chromium through its chromedriver, a profile of its own under `tmp_path`."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1400,1000",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ):
        options.add_argument(arg)
    return webdriver.Chrome(
        service=Service("/usr/bin/chromedriver", log_output=str(tmp_path / "chromedriver.log")), options=options
    )


def log_in(driver, base: str, user: str = "admin") -> None:
    """Through Airflow's login page, as `user` (the UI sends a browser without a session there)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(f"{base}/")
    WebDriverWait(driver, 60).until(ec.presence_of_element_located((By.NAME, "username"))).send_keys(user)
    driver.find_element(By.NAME, "password").send_keys(PASSWORDS[user])


def test_the_view_in_headless_chromium(view, tmp_path):
    from selenium import webdriver
    from selenium.common.exceptions import (
        ElementClickInterceptedException,
        ElementNotInteractableException,
        NoSuchElementException,
        StaleElementReferenceException,
    )
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    server, store_config, backend = view
    base = f"http://127.0.0.1:{server.port}"
    driver = chromium(tmp_path)
    shots: list[Path] = []

    def shot(name: str, *, full: bool = False) -> None:
        if full:  # the whole page, not only the window
            height = driver.execute_script("return document.documentElement.scrollHeight")
            driver.set_window_size(1400, min(max(height + 40, 1000), 6000))
            driver.execute_script("window.scrollTo(0, 0)")
        path = tmp_path / f"{backend}-{name}.png"
        driver.save_screenshot(str(path))
        shots.append(path)
        if full:
            driver.set_window_size(1400, 1000)

    # a page replaced under a check (a search, an action's reload) only means: look again
    wait = WebDriverWait(
        driver,
        60,
        ignored_exceptions=(
            NoSuchElementException,
            StaleElementReferenceException,
            ElementClickInterceptedException,
            ElementNotInteractableException,
        ),
    )

    def done_says(word: str) -> bool:
        """Whether the action's banner says `word` (read in one script: the page may be reloading)."""
        return word in driver.execute_script(
            "const d = document.getElementById('done'); "
            "return d && document.readyState === 'complete' ? d.textContent : '';"
        )

    def trail_events() -> list[str]:
        return driver.execute_script(
            "return Array.from(document.querySelectorAll('#trail td.event'), td => td.textContent);"
        )

    try:
        # Airflow's login: the UI sends a browser without a session there
        log_in(driver, base)
        shot("01-airflow-login")
        driver.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        wait.until(lambda d: "/auth/login" not in d.current_url and d.get_cookie("_token"))

        # the nav entry opens the view inside the Airflow UI (an iframe under /plugin/stageline)
        def nav_to_view(d: webdriver.Chrome) -> bool:  # a click while the UI still renders may be lost: again
            if d.current_url.rstrip("/").endswith("/plugin/stageline"):
                return True
            for link in d.find_elements(By.XPATH, "//a[normalize-space()='Stageline']")[:1]:
                link.click()
            return False

        wait.until(nav_to_view)
        frame = wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "iframe")))
        time.sleep(1)
        shot("02-stageline-in-airflow-ui")
        driver.switch_to.frame(frame)
        wait.until(ec.presence_of_element_located((By.ID, "cluster")))
        assert driver.find_element(By.ID, "leader").text == "node-a:1:aa"
        assert driver.find_element(By.ID, "mismatch").text == ("node-b:2:bb" if backend == "postgres" else "none")
        assert "signed in to Airflow as admin" in driver.page_source
        driver.switch_to.default_content()

        # the view on its own: search a control id, open the message, see its trail
        driver.get(f"{base}/stageline/")
        wait.until(ec.presence_of_element_located((By.NAME, "control_id"))).send_keys("VIEW2")
        driver.find_element(By.CSS_SELECTOR, "form.search button").click()
        wait.until(
            lambda d: (
                "control_id=VIEW2" in d.current_url
                and [" VIEW2 " in r.text for r in d.find_elements(By.CSS_SELECTOR, "#search tbody tr")] == [True]
            )
        )
        driver.find_element(By.CSS_SELECTOR, "#search tbody tr a").click()
        wait.until(ec.presence_of_element_located((By.ID, "trail")))
        assert trail_events() == ["received"], trail_events()  # staged by listenerd; nothing routed it since
        assert not driver.find_elements(By.CSS_SELECTOR, "pre.hl7")  # bodies (PHI) only when asked for
        driver.find_element(By.ID, "show-bodies").click()
        wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "pre.hl7")))
        assert "PID|1||P2||DOE^JANE" in driver.find_element(By.CSS_SELECTOR, "pre.hl7").text
        shot("03-message-trail", full=True)

        # a message a micro-batch moved links to that batch and its Airflow run
        driver.get(f"{base}/stageline/?show=VIEW0")
        link = wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "#message a.run")))
        assert link.get_attribute("href") == f"{base}/dags/stage_route/runs/{quote(DAG_RUN, safe='')}"
        assert trail_events() == ["received", "unrouted"], trail_events()
        shot("04-message-moved-by-a-batch", full=True)
        driver.get(f"{base}/stageline/?show=VIEW2")
        wait.until(ec.presence_of_element_located((By.ID, "trail")))

        # requeue the dead letter from its row (a reason is required), then replay the message
        form = driver.find_element(By.CSS_SELECTOR, "#message form.action[action='api/requeue']")
        form.find_element(By.NAME, "reason").send_keys("route fixed in routes.toml")
        form.find_element(By.TAG_NAME, "button").click()
        wait.until(lambda d: done_says("requeued"))
        form = driver.find_element(By.CSS_SELECTOR, "#message form.action[action$='/replay']")
        form.find_element(By.NAME, "reason").send_keys("EHR asked for it again")
        form.find_element(By.TAG_NAME, "button").click()
        wait.until(lambda d: done_says("replayed"))
        assert trail_events() == ["received", "body_read", "requeued", "replayed"], trail_events()
        shot("05-after-requeue-and-replay", full=True)
    finally:
        driver.quit()
        for path in shots:
            print(f"screenshot: {path}")
        if shots and backend == "postgres" and os.environ.get("STAGELINE_VIEW_SCREENSHOTS", "1") != "0":
            (ROOT / "docs" / "img").mkdir(exist_ok=True)
            for path in shots:
                shutil.copy(path, ROOT / "docs" / "img" / f"stageline-view-{path.name}")

    events = audit_events(store_config)
    mine = [(e["event"], e["stage"], e["control_id"], e["node_id"]) for e in events if e["control_id"] == "VIEW2"]
    assert ("requeued", "inbound", "VIEW2", "operator:airflow admin") in mine
    assert ("replayed", "inbound", "VIEW2", "operator:airflow admin") in mine
    assert ("staged", "inbound", "VIEW2", "operator:airflow admin") in mine  # the replay's new inbound row
    details = {e["event"]: e["detail"] for e in events if e["control_id"] == "VIEW2"}
    assert details["requeued"] == "route fixed in routes.toml" and "EHR asked for it again" in details["replayed"]
    s = Store(store_config)
    try:
        with s.transaction(write=False) as tx:
            cur = tx.conn.cursor()
            cur.execute(
                "SELECT status FROM stage_inbound WHERE message_id NOT LIKE '%~replay-%' AND control_id = 'VIEW2'"
            )
            assert [next(iter(r.values())) if isinstance(r, dict) else r[0] for r in cur.fetchall()] == ["pending"]
    finally:
        s.close()


def test_the_page_escapes_what_the_store_holds():
    """Control ids, errors and bodies come from senders: the page shows them as text, never markup."""
    from stageline_airflow.view_html import PageData, render

    hostile = "<script>alert(1)</script>"
    message = {
        "id": 7,
        "message_id": "m7",
        "control_id": hostile,
        "connection": "adt-in",
        "lane_key": '"><b>',
        "status": "dead",
        "attempts": 1,
        "charset": None,
        "created_ms": 0,
        "updated_ms": 0,
        "last_error": hostile,
        "payload": f"MSH|^~\\&|{hostile}\rPID|1",
        "archived_ms": 0,
    }
    page = render(
        PageData(
            user=hostile,
            may_operate=True,
            cluster={
                "nodes": [],
                "leader_node_id": None,
                "lease_owner": None,
                "lease_expires_at": None,
                "epoch": 0,
                "db_now": 0.0,
                "config_mismatch": [],
                "clustered": True,
                "cluster_name": hostile,
            },
            stages={},
            dead=[{"stage": "outbound", "destination": hostile, "reason": hostile, "n": 1, "oldest_ms": 0}],
            messages=[{**message, "routed": 0, "delivered": 0, "dead": 1}],
            filters=operator.Filters(control_id=hostile),
            shown=operator.Story(
                message,
                trail=[
                    {
                        "at_ms": 0,
                        "stage": "inbound",
                        "row_id": 7,
                        "event": "received",
                        "from_status": None,
                        "to_status": "pending",
                        "destination": None,
                        "epoch": 1,
                        "node_id": "n",
                        "detail": hostile,
                    }
                ],
            ),
            shown_ref="7",
            batches=[],
            done=hostile,
            destinations=[
                {
                    "destination": hostile,
                    **dict.fromkeys(("queued", "retrying", "in_flight", "dead"), 1),
                    "oldest_queued_seconds": 1.0,
                    "windows": {
                        w: {"received": 1, "sent": 1, "dead": 0, "p50_seconds": 0.1, "p95_seconds": 0.2}
                        for w in ("5m", "1h")
                    },
                    "per_minute": [{"minute_ms": 0, "sent": 1, "dead": 1}],
                }
            ],
        )
    )
    assert hostile not in page and '"><b>' not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "no live leader" in page
    assert "; archived 1970-01-01 00:00:00.000Z" in page  # retention archived it: the page says so
    assert page.count("<script>") == 1  # the page's own


def test_a_viewer_sees_lane_keys_masked_and_may_not_filter_by_lane(view):
    """Lane keys are usually PID-3, the MRN (issue 23, red team item 19): Airflow's Viewer sees a
    keyed digest, the same for one lane, and may not filter by lane; an Admin sees the lane."""
    server, _, _ = view
    port = server.port
    viewer, admin = token_for(port, "viewer"), token_for(port, "admin")
    status, found, _ = http(port, "GET", "/stageline/api/messages?control_id=VIEW1", token=admin)
    lane = found["messages"][0]["lane_key"]
    assert status == 200 and lane and not lane.startswith("lane:")
    status, found, _ = http(port, "GET", "/stageline/api/messages?control_id=VIEW1", token=viewer)
    masked = found["messages"][0]["lane_key"]
    assert status == 200 and re.fullmatch(r"lane:[0-9a-f]{12}", masked) and lane not in json.dumps(found)
    status, story, _ = http(port, "GET", "/stageline/api/messages/VIEW1", token=viewer)
    assert status == 200 and story["inbound"]["lane_key"] == masked and story["inbound"]["control_id"] == "VIEW1"
    status, page, _ = http(port, "GET", "/stageline/?show=VIEW1", cookie=f"_token={viewer}")
    assert status == 200 and masked in page and f"lane {lane}," not in page
    status, doc, _ = http(port, "GET", f"/stageline/api/messages?lane_key={lane}", token=viewer)
    assert (status, doc) == (403, {"detail": "lane filters need the OP or ADMIN role"})
    assert http(port, "GET", f"/stageline/?lane_key={lane}", cookie=f"_token={viewer}")[0] == 403
    status, found, _ = http(port, "GET", f"/stageline/api/messages?lane_key={lane}", token=admin)
    assert status == 200 and {m["lane_key"] for m in found["messages"]} == {lane}


def test_the_destination_table_and_its_charts_in_headless_chromium(view, tmp_path):
    """Messages flow to two destinations, the lab refusing everything: the view's destination table
    shows each one's figures, and each row's chart (inline SVG) has a bar for the minute they went."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    server, store_config, backend = view
    base = f"http://127.0.0.1:{server.port}"
    s = Store(store_config)
    try:
        epoch = read_lease(s).epoch
        pump.stage(s, epoch=epoch, n=6, connection="lab-in", prefix="DEST")
        routed = pump.route(
            s, epoch=epoch, destinations=lambda r: ["ehr", "lab"] if r["control_id"].startswith("DEST") else []
        )
        assert routed >= 6
        out = pump.deliver(
            s, epoch=epoch, send=lambda row: row["destination"] == "ehr", retry=pump.Retry(backoff_seconds=60)
        )
        assert len(out.done) == 6 and len(out.retrying) == 1
    finally:
        s.close()
    driver = chromium(tmp_path)
    try:
        log_in(driver, base)
        driver.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        WebDriverWait(driver, 60).until(lambda d: "/auth/login" not in d.current_url and d.get_cookie("_token"))
        driver.get(f"{base}/stageline/#destinations")
        WebDriverWait(driver, 60).until(ec.presence_of_element_located((By.ID, "destinations")))

        def cells(name: str) -> list[str]:
            row = driver.find_element(By.CSS_SELECTOR, f"#destinations tr[data-destination='{name}']")
            return [td.text for td in row.find_elements(By.TAG_NAME, "td")]

        ehr, lab = cells("ehr"), cells("lab")
        # destination, queued, retrying, in flight, dead, oldest | received, sent, dead, p50/p95 | sent 1h, p95 1h
        assert ehr[1:5] == ["0", "0", "0", "0"] and ehr[6:9] == ["6", "6", "0"] and ehr[10] == "6"
        assert lab[1:5] == ["5", "1", "0", "0"] and lab[6:9] == ["6", "0", "0"] and lab[9] == "- / -"
        assert lab[5].endswith(" s") and ehr[5] == "-"
        bars = driver.execute_script(
            "return Array.from(document.querySelectorAll('#destinations tr[data-destination]'), tr => "
            "[tr.dataset.destination, tr.querySelectorAll('svg.chart rect.sent').length, "
            "tr.querySelector('svg.chart').getAttribute('aria-label')]);"
        )
        assert ["ehr", 1, "ehr: 6 delivered, 0 dead-lettered in the last hour (busiest minute 6)"] in bars
        assert ["lab", 0, "lab: 0 delivered, 0 dead-lettered in the last hour (busiest minute 1)"] in bars
        section = driver.find_element(By.ID, "destinations")
        driver.execute_script("arguments[0].scrollIntoView()", section)
        path = tmp_path / f"{backend}-06-destinations.png"
        section.screenshot(str(path))
        print(f"screenshot: {path}")
        if backend == "postgres" and os.environ.get("STAGELINE_VIEW_SCREENSHOTS", "1") != "0":
            shutil.copy(path, ROOT / "docs" / "img" / f"stageline-view-{path.name}")
    finally:
        driver.quit()
