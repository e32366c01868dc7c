"""Business keys, content search and saved searches in the Stageline view (issue 26), end to end on
the same real parts as tests/test_airflow_view.py (its `view` fixture: a real Airflow api-server
with the plugin, real listenerd nodes, messages received over MLLP; SQLite and PostgreSQL): the
view's API answers a search by key, by content and by a saved search, for OP/ADMIN only; in headless
Chromium an admin searches by MRN, opens a message, and sees its keys, its trail and its siblings.
Screenshot of the PostgreSQL run: docs/img/stageline-view-postgres-07-keys.png."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from urllib.parse import quote

from include.keys_config import parse_keys
from include.store import Store
from include.store import keys as K
from include.store.lease import read_lease
from tests.dags.stores import rows
from tests.support.hostile import adt
from tests.support.staging import insert_inbound
from tests.test_airflow_view import (  # noqa: F401 (fixtures)
    ROOT,
    airflow_home,
    chromium,
    http,
    log_in,
    pg_config_fresh_module,
    token_for,
    view,
)

RULES = parse_keys({"keys": {"mrn": "PID-3.1"}})


def patient_p1_twice_more(store_config) -> list[int]:
    """Two more messages of patient P1 (the fixture sent VIEW0-2 for P0-P2), then the keys of every
    staged message indexed, as the route task does for what it claims."""
    s = Store(store_config)
    try:
        epoch = read_lease(s).epoch
        with s.transaction() as tx:
            ids = [
                insert_inbound(
                    tx,
                    epoch=epoch,
                    node_id="node-a:1:aa",
                    message_id=f"keys-{n}",
                    control_id=f"KEYS{n}",
                    connection="adt-in",
                    payload=adt(f"KEYS{n}", patient="P1").decode(),
                )
                for n in range(2)
            ]
        staged = [int(r["id"]) for r in rows(s, "SELECT id FROM stage_inbound")]
        assert set(ids) < set(staged)
        K.index(s, RULES, staged)
        return ids
    finally:
        s.close()


def test_search_by_key_content_and_saved_searches_in_the_views_api_and_in_headless_chromium(view, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    server, store_config, backend = view
    later = patient_p1_twice_more(store_config)
    admin, viewer = token_for(server.port, "admin"), token_for(server.port, "viewer")

    status, doc, _ = http(server.port, "GET", "/stageline/api/messages?key=" + quote("mrn=P1"), token=admin)
    assert status == 200, doc
    assert [m["control_id"] for m in doc["messages"]] == ["KEYS1", "KEYS0", "VIEW1"]
    assert {m["key_value"] for m in doc["messages"]} == {"P1"}
    status, doc, _ = http(server.port, "GET", "/stageline/api/messages?key=" + quote("mrn=P*"), token=admin)
    assert [m["control_id"] for m in doc["messages"]][-3:] == ["VIEW2", "VIEW1", "VIEW0"]
    status, doc, _ = http(server.port, "GET", "/stageline/api/messages?contains=KEYS1", token=admin)
    assert status == 200 and [m["id"] for m in doc["messages"]] == [later[1]]
    status, doc, _ = http(server.port, "GET", "/stageline/api/messages?where=" + quote('PID-3 = "P2"'), token=admin)
    assert [m["control_id"] for m in doc["messages"]] == ["VIEW2"]
    for path in ("/stageline/api/messages?key=mrn%3DP1", "/stageline/api/messages?contains=DOE"):
        assert http(server.port, "GET", path, token=viewer)[0] == 403  # would tell whether an MRN is here
    assert http(server.port, "GET", "/stageline/api/messages?key=mrn", token=admin)[0] == 400

    saved = {"name": "p1", "query": {"key": "mrn=P1"}}
    assert http(server.port, "POST", "/stageline/api/searches", token=viewer, body=saved)[0] == 403
    status, doc, _ = http(server.port, "POST", "/stageline/api/searches", token=admin, body=saved)
    assert status == 200 and doc["query"] == {"key": "mrn=P1"}
    other = {"name": "p1", "query": {"key": "mrn=P2"}}
    status, doc, _ = http(server.port, "POST", "/stageline/api/searches", token=admin, body=other)
    assert status == 409 and "replace" in doc["detail"]  # saving over a search is said on purpose
    status, doc, _ = http(server.port, "POST", "/stageline/api/searches", token=admin, body={**other, "replace": 1})
    assert status == 400 and "replace must be true or false" in doc["detail"]
    status, doc, _ = http(server.port, "POST", "/stageline/api/searches", token=admin, body={**saved, "replace": True})
    assert status == 200 and doc["query"] == {"key": "mrn=P1"}
    bad = {"name": "x", "query": {"key": "mrn"}}
    assert http(server.port, "POST", "/stageline/api/searches", token=admin, body=bad)[0] == 400
    status, doc, _ = http(server.port, "GET", "/stageline/api/searches", token=viewer)
    assert status == 200 and [(s["name"], s["query"], s["saved_by"]) for s in doc["searches"]] == [
        ("p1", {"key": "mrn=…"}, "airflow admin")  # a viewer sees which key, not the MRN
    ]
    status, doc, _ = http(server.port, "GET", "/stageline/api/searches", token=admin)
    assert status == 200 and [s["query"] for s in doc["searches"]] == [{"key": "mrn=P1"}]
    status, doc, _ = http(server.port, "GET", "/stageline/api/searches/p1/run?limit=2", token=admin)
    assert status == 200 and [m["control_id"] for m in doc["messages"]] == ["KEYS1", "KEYS0"]
    assert http(server.port, "GET", "/stageline/api/searches/p1/run", token=viewer)[0] == 403
    assert http(server.port, "DELETE", "/stageline/api/searches/p1", token=admin)[0] == 200
    assert http(server.port, "GET", "/stageline/api/searches/p1/run", token=admin)[0] == 404

    base = f"http://127.0.0.1:{server.port}"
    driver = chromium(tmp_path)
    try:
        log_in(driver, base)
        driver.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        WebDriverWait(driver, 60).until(lambda d: "/auth/login" not in d.current_url and d.get_cookie("_token"))
        driver.get(f"{base}/stageline/#search")
        box = WebDriverWait(driver, 60).until(ec.presence_of_element_located((By.CSS_SELECTOR, "#key-search input")))
        box.send_keys("mrn=P1")
        driver.find_element(By.CSS_SELECTOR, "#key-search button").click()
        WebDriverWait(driver, 60).until(ec.presence_of_element_located((By.CSS_SELECTOR, "#search table.keyed")))
        hits = driver.find_elements(By.CSS_SELECTOR, "#search table.keyed tbody tr")
        assert [tr.find_elements(By.TAG_NAME, "td")[3].text for tr in hits] == ["KEYS1", "KEYS0", "VIEW1"]
        hits[-1].find_element(By.TAG_NAME, "a").click()  # the oldest: VIEW1, received over MLLP
        section = WebDriverWait(driver, 60).until(ec.presence_of_element_located((By.ID, "message")))
        assert "control id VIEW1" in section.text
        assert section.find_element(By.CSS_SELECTOR, "p.keys").text == "keys: mrn=P1"
        trail = [tr.text for tr in section.find_elements(By.CSS_SELECTOR, "#trail tbody tr")]
        assert any("received" in row for row in trail)
        siblings = section.find_elements(By.CSS_SELECTOR, "#siblings tbody tr")
        assert [tr.find_elements(By.TAG_NAME, "td")[3].text for tr in siblings] == ["KEYS1", "KEYS0"]
        driver.execute_script("arguments[0].scrollIntoView()", section)
        path = tmp_path / f"{backend}-07-keys.png"
        section.screenshot(str(path))
        print(f"screenshot: {path}")
        if backend == "postgres" and os.environ.get("STAGELINE_VIEW_SCREENSHOTS", "1") != "0":
            shutil.copy(path, Path(ROOT) / "docs" / "img" / f"stageline-view-{path.name}")
        # a sibling is a link to it
        siblings[0].find_element(By.TAG_NAME, "a").click()
        WebDriverWait(driver, 60).until(lambda d: "control id KEYS1" in d.find_element(By.ID, "message").text)
    finally:
        driver.quit()
