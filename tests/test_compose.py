"""The two-node compose cluster (`docker-compose.yaml`, `Dockerfile`, `deploy/`), checked without Docker.

There is no Docker engine where these tests run, so the cluster itself never starts here. What is
checked instead: the compose file's structure (services, image, dependencies, environment, the
two nodes being identical), that every file the services point at exists and loads with
Stageline's own loaders (`include/config.py`, `listeners/connections_config.py`, `listeners/api.py`,
`include/stage_config.py`),
that the HAProxy VIP asks each node's `GET /leader` (not a TCP connect), and — where the tools exist — the
parts that can run outside a container: `haproxy -c`, HAProxy's failover between two stand-in nodes
on loopback, `docker compose config`, the Spark Connect server command, and the PostgreSQL init
script followed by the migrate job's own command against a throwaway PostgreSQL 15.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import socket
import socketserver
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from stageline_airflow import tasks

from include import config as cfgmod
from include import spark as spark_consts
from include import stage_config
from include.app.lab.spark_cluster import SparkCluster
from listeners.api import ApiAuth, ApiSettings
from listeners.connections_config import load_config_dir

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
DEPLOY = ROOT / "deploy"
HAPROXY_CFG = DEPLOY / "haproxy.cfg"
INIT_SCRIPT = DEPLOY / "postgres-init.sh"
APP = "/app"  # where the Dockerfile puts the repo

SPARK_CLUSTER = ("spark-master", "spark-worker-a", "spark-worker-b")
STAGELINE_SERVICES = (
    "stageline-migrate",
    "spark-connect",
    *SPARK_CLUSTER,
    "airflow-api-server",
    "airflow-scheduler",
    "airflow-scheduler-b",
    "airflow-dag-processor",
    "airflow-triggerer",
    "listenerd-a",
    "listenerd-b",
)
AIRFLOW_SERVICES = (
    "airflow-api-server",
    "airflow-scheduler",
    "airflow-scheduler-b",
    "airflow-dag-processor",
    "airflow-triggerer",
)
LISTENERD = ("listenerd-a", "listenerd-b")
STORE_USERS = ("stageline-migrate", *AIRFLOW_SERVICES, *LISTENERD)  # every process that opens the store

# What `docker compose` would read from `.env`: throwaway values for the checks below.
FAKE_ENV = {
    "POSTGRES_PASSWORD": "pg-" + secrets.token_urlsafe(12),
    "STAGELINE_STORE_PASSWORD": "st-" + secrets.token_urlsafe(12),
    "AIRFLOW_DB_PASSWORD": "af-" + secrets.token_urlsafe(12),
    "AIRFLOW_API_SECRET_KEY": secrets.token_urlsafe(24),
    "AIRFLOW_JWT_SECRET": secrets.token_urlsafe(24),
    "AIRFLOW_ADMIN_PASSWORD": secrets.token_urlsafe(12),
    "STAGELINE_API_TOKEN": secrets.token_urlsafe(24),
}

_VAR = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


# ---- helpers ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def env_of(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # the `- KEY=value` form
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def referenced_vars(value: str) -> set[str]:
    return {m["name"] for m in _VAR.finditer(value)}


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's `${VAR}`, `${VAR:-default}` and `${VAR:?error}`, enough for this file."""

    def one(m: re.Match[str]) -> str:
        name, op, arg = m["name"], m["op"], m["arg"]
        if env.get(name):
            return env[name]
        if op in (":-", "-"):
            return arg
        raise KeyError(f"{name} is required ({arg})")

    return _VAR.sub(one, value)


def argv_of(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    return shlex.split(command) if isinstance(command, str) else [str(a) for a in command]


def bind_mounts(service: dict[str, Any]) -> list[tuple[Path, str]]:
    """(host path, container path) of the service's bind mounts (`./x:/y[:ro]`)."""
    mounts = []
    for volume in service.get("volumes", []):
        source, target = str(volume).split(":")[:2]
        if source.startswith(("./", "/")):
            mounts.append(((ROOT / source).resolve(), target))
    return mounts


def dockerfile_copies() -> set[str]:
    """The repo paths the Dockerfile copies under /app (`COPY include ./include` → `include`)."""
    copied: set[str] = set()
    for line in DOCKERFILE.read_text().splitlines():
        parts = line.split()
        if parts[:1] == ["COPY"] and not any(p.startswith("--from") for p in parts):
            copied.update(p.rstrip("/") for p in parts[1:-1])
    return copied


def host_path(service: dict[str, Any], container_path: str) -> Path:
    """Where a path seen inside a Stageline container comes from on the host: a bind mount, else
    the repo copy the Dockerfile makes under /app. Fails when it comes from nowhere."""
    for source, target in sorted(bind_mounts(service), key=lambda m: -len(m[1])):
        if container_path == target or container_path.startswith(target.rstrip("/") + "/"):
            return source / os.path.relpath(container_path, target)
    if container_path == APP:
        return ROOT
    assert container_path.startswith(APP + "/"), f"{container_path} is neither mounted nor under {APP}"
    relative = os.path.relpath(container_path, APP)
    top = relative.split("/")[0]
    assert top in dockerfile_copies(), f"{container_path}: the Dockerfile does not copy {top!r}"
    return ROOT / relative


def option(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} missing from {argv}"
    return argv[argv.index(name) + 1]


def spark_confs(argv: list[str]) -> dict[str, str]:
    return dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--conf")


def haproxy_sections(text: str) -> dict[str, list[str]]:
    """`{"backend mllp_leader": [lines...], ...}` with comments and blank lines dropped."""
    sections: dict[str, list[str]] = {}
    current = None
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        if not line[0].isspace():
            current = " ".join(line.split()[:2])
            sections[current] = []
        elif current is not None:
            sections[current].append(line.strip())
    return sections


def haproxy_servers(section: list[str]) -> dict[str, list[str]]:
    return {line.split()[1]: line.split()[2:] for line in section if line.startswith("server ")}


def haproxy_backend_of(sections: dict[str, list[str]], port: int) -> str:
    """The backend behind the frontend that binds `port`."""
    for name, lines in sections.items():
        if name.startswith("frontend ") and f"bind :{port}" in lines:
            used = next(line.split()[1] for line in lines if line.startswith("default_backend "))
            return f"backend {used}"
    raise AssertionError(f"no frontend binds :{port}")


@pytest.fixture(scope="module")
def listener_config():
    return load_config_dir(DEPLOY / "config")


@pytest.fixture(scope="module")
def data_port(listener_config) -> int:
    mllp = [c for c in listener_config.inbound if c.kind == "mllp"]
    assert mllp, "the cluster config dir has no MLLP inbound connection"
    return mllp[0].port


@pytest.fixture(scope="module")
def api_port(listener_config) -> int:
    return ApiSettings.from_config(listener_config.api, listener_config.directory).port


# ---- the compose file: services, image, dependencies ------------------------------------------


def test_compose_defines_the_two_node_cluster(services):
    assert set(services) == {"postgres", "haproxy", *STAGELINE_SERVICES}


def test_every_service_has_an_image_or_a_build(services):
    for name, service in services.items():
        assert service.get("image") or service.get("build"), f"{name} has neither image nor build"


def test_stageline_services_share_one_image_built_from_the_dockerfile(services):
    images = {services[name].get("image") for name in STAGELINE_SERVICES}
    assert len(images) == 1 and None not in images, f"one image expected, got {images}"
    for name in STAGELINE_SERVICES:
        build = services[name]["build"]
        context = build if isinstance(build, str) else build.get("context", ".")
        dockerfile = "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
        assert (ROOT / context).resolve() == ROOT, f"{name} builds from {context}"
        assert (ROOT / context / dockerfile).resolve() == DOCKERFILE
    assert services["postgres"]["image"].startswith("postgres:15")
    assert services["haproxy"]["image"].startswith("haproxy:")


def test_depends_on_targets_exist_and_form_no_cycle(services):
    graph: dict[str, set[str]] = {}
    for name, service in services.items():
        deps = service.get("depends_on", {})
        targets = set(deps) if isinstance(deps, (dict, list)) else set()
        for target in targets:
            assert target in services, f"{name} depends on unknown service {target!r}"
            if isinstance(deps, dict):
                condition = deps[target].get("condition", "service_started")
                assert condition in ("service_started", "service_healthy", "service_completed_successfully")
                if condition == "service_healthy":
                    assert "healthcheck" in services[target], (
                        f"{name} waits for {target} healthy: it has no healthcheck"
                    )
                if condition == "service_completed_successfully":
                    assert services[target].get("restart", "no") == "no", f"{target} is one-shot: restart must be no"
        graph[name] = targets
    done: set[str] = set()

    def visit(node: str, path: tuple[str, ...]) -> None:
        assert node not in path, f"depends_on cycle: {' -> '.join(path + (node,))}"
        if node not in done:
            for dep in graph[node]:
                visit(dep, path + (node,))
            done.add(node)

    for name in graph:
        visit(name, ())


def test_startup_order_migrates_before_anything_uses_the_databases(services):
    assert services["stageline-migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in (*AIRFLOW_SERVICES, *LISTENERD):
        assert services[name]["depends_on"]["stageline-migrate"]["condition"] == "service_completed_successfully", name
    assert "spark-connect" in services["airflow-scheduler"]["depends_on"], "tasks run in the scheduler and use Spark"


def test_migrate_job_runs_both_migrations_once(services):
    migrate = services["stageline-migrate"]
    assert migrate.get("restart") == "no"
    script = " ".join(argv_of(migrate))
    assert re.search(r"stageline\b.*\bdb migrate\b.*&&.*\bairflow db migrate\b", script), script


# ---- environment: what include/ reads is set where it is needed -------------------------------


def test_store_users_get_the_service_config_and_password(services):
    for name in STORE_USERS:
        service, env = services[name], env_of(services[name])
        assert cfgmod.CONFIG_ENV in env, f"{name} lacks {cfgmod.CONFIG_ENV}"
        assert host_path(service, env[cfgmod.CONFIG_ENV]) == DEPLOY / "stageline.toml", name
        assert referenced_vars(env.get(cfgmod.PASSWORD_ENV, "")) == {cfgmod.PASSWORD_ENV}, (
            f"{name}: {cfgmod.PASSWORD_ENV} must come from the environment (.env), not a literal"
        )


def test_the_store_password_is_the_one_the_database_role_was_created_with(services):
    pg_env = env_of(services["postgres"])
    init = INIT_SCRIPT.read_text()
    for var in (cfgmod.PASSWORD_ENV, "AIRFLOW_DB_PASSWORD"):
        assert f"${{{var}:?" in init, f"the init script does not require {var}"
        assert referenced_vars(pg_env.get(var, "")) == {var}, f"postgres does not pass {var} to the init script"
    for name in AIRFLOW_SERVICES + ("stageline-migrate",):
        conn = env_of(services[name])["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
        assert "AIRFLOW_DB_PASSWORD" in referenced_vars(conn)
        assert re.fullmatch(r"postgresql\+psycopg2?://airflow:\$\{[^}]+\}@postgres:5432/airflow", conn), conn


def test_airflow_services_are_configured_alike_for_the_stage_tasks(services):
    envs = {name: env_of(services[name]) for name in (*AIRFLOW_SERVICES, "stageline-migrate")}
    spark_argv = argv_of(services["spark-connect"])
    spark_port = spark_confs(spark_argv)["spark.connect.grpc.binding.port"]
    for name, env in envs.items():
        assert env["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor", name
        assert host_path(services[name], env["AIRFLOW__CORE__DAGS_FOLDER"]) == ROOT / "dags", name
        assert host_path(services[name], env["AIRFLOW__CORE__PLUGINS_FOLDER"]) == ROOT / "plugins", name
        spark_conn = json.loads(env["AIRFLOW_CONN_" + tasks.SPARK_CONN_ID.upper()])
        assert spark_conn == {"conn_type": "spark_connect", "host": "spark-connect", "port": int(spark_port)}, name
        assert host_path(services[name], env[stage_config.PIPELINE_DIR_ENV]) == DEPLOY / "config", name
        assert cfgmod.VAR_ENV in env, name
        assert env[tasks.AIRFLOW_DB_CONN_ENV] == env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"], name
        assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"].startswith("http://airflow-api-server:"), name
    for key in (
        "AIRFLOW__API_AUTH__JWT_SECRET",
        "AIRFLOW__API__SECRET_KEY",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN",
        cfgmod.CONFIG_ENV,
        stage_config.PIPELINE_DIR_ENV,
        cfgmod.VAR_ENV,
        "AIRFLOW_CONN_" + tasks.SPARK_CONN_ID.upper(),
    ):
        values = {env[key] for env in envs.values()}
        assert len(values) == 1, f"{key} differs between Airflow components: {values}"
    assert all(referenced_vars(env["AIRFLOW__API_AUTH__JWT_SECRET"]) for env in envs.values()), (
        "JWT secret is a literal"
    )


@pytest.fixture
def cluster_pipeline(services, monkeypatch):
    """deploy/config as a stage task in the scheduler container loads it (its $STAGELINE_VAR)."""
    env = env_of(services["airflow-scheduler"])
    monkeypatch.setenv(cfgmod.VAR_ENV, env[cfgmod.VAR_ENV])
    return stage_config.load(host_path(services["airflow-scheduler"], env[stage_config.PIPELINE_DIR_ENV]))


def test_pipeline_config_of_the_cluster_loads_and_cross_checks(cluster_pipeline):
    assert [r.name for r in cluster_pipeline.routes] == ["adt-to-archive", "results-to-archive"]
    routed_to = {d for r in cluster_pipeline.routes for d in r.destinations}
    assert routed_to == set(cluster_pipeline.destinations) == {"archive"}


def test_file_deliveries_land_on_a_volume_the_task_and_the_spark_workers_share(services, cluster_pipeline):
    """A file destination's directory is resolved in the task (scheduler) and written by Spark's
    workers (spark-connect), unless deliveries run in the task process: it must be one volume,
    mounted at the same place in both, and exist there (a file destination never creates it)."""
    scheduler = services["airflow-scheduler"]
    assert not env_of(scheduler).get(tasks.DELIVER_IN_PROCESS_ENV), "deliveries are expected to run in Spark"
    dockerfile = DOCKERFILE.read_text()
    files = [d for d in cluster_pipeline.destinations.values() if d.kind == "file"]
    assert files
    for dest in files:

        def volume_for(service: dict[str, Any]) -> str | None:
            for volume in service.get("volumes", []):
                source, target = str(volume).split(":")[:2]
                if not source.startswith(("./", "/")) and (dest.directory + "/").startswith(target.rstrip("/") + "/"):
                    return f"{source}:{target}"
            return None

        shared = volume_for(scheduler)
        for name in ("spark-connect", "airflow-scheduler-b", "spark-worker-a", "spark-worker-b"):
            assert shared is not None and shared == volume_for(services[name]), (
                f"{dest.name}: {dest.directory} is not on one volume mounted in the schedulers and {name}"
            )
        assert re.search(rf"mkdir -p [^\n]*{re.escape(dest.directory)}\b", dockerfile), (
            f"{dest.name}: the image does not create {dest.directory}"
        )


def test_spark_connect_command_matches_include_spark(services):
    service = services["spark-connect"]
    argv = argv_of(service)
    spark_home = env_of(service)["SPARK_HOME"]
    assert argv[0] == f"{spark_home}/bin/spark-submit"
    assert option(argv, "--class") == spark_consts.CONNECT_SERVER_CLASS
    assert option(argv, "--jars").split(",") == list(spark_consts.DRIVER_JARS.values())
    confs = spark_confs(argv)
    assert confs["spark.connect.grpc.binding.port"] == str(spark_consts.DEFAULT_CONNECT_PORT)
    assert confs["spark.connect.grpc.binding.address"] == "0.0.0.0", "the Airflow containers must reach it"
    for key, value in spark_consts.SMALL_BATCH_CONF.items():
        assert confs.get(key) == value, key
    assert "ports" not in service, "Spark Connect has no auth: it must not be published"


def test_airflow_api_server_login_password_comes_from_the_environment(services):
    service = services["airflow-api-server"]
    assert referenced_vars(env_of(service)["AIRFLOW_ADMIN_PASSWORD"]) == {"AIRFLOW_ADMIN_PASSWORD"}
    script = " ".join(argv_of(service))
    assert "SIMPLE_AUTH_MANAGER_PASSWORDS_FILE" in script and script.rstrip().endswith("exec airflow api-server")


def test_compose_interpolates_with_a_complete_env_and_refuses_without_it(compose):
    text = COMPOSE.read_text()
    needed = {m["name"] for m in _VAR.finditer(text) if m["op"] in (":?", "?")}
    assert needed == set(FAKE_ENV), f"secrets the docs must list: {sorted(needed)}"
    resolved = interpolate(text, FAKE_ENV)
    assert "${" not in resolved
    assert yaml.safe_load(resolved)["services"].keys() == compose["services"].keys()
    with pytest.raises(KeyError, match="STAGELINE_STORE_PASSWORD"):
        interpolate(text, {k: v for k, v in FAKE_ENV.items() if k != "STAGELINE_STORE_PASSWORD"})


# ---- the two listenerd nodes -------------------------------------------------------------------


def test_both_listenerd_nodes_run_the_same_config(services):
    a, b = (services[name] for name in LISTENERD)
    for key in ("image", "build", "command", "environment", "volumes", "depends_on", "healthcheck"):
        assert a.get(key) == b.get(key), f"listenerd-a and listenerd-b differ in {key}"
    assert a.get("hostname") != b.get("hostname"), "the node id is derived from the host name"
    argv = argv_of(a)
    assert Path(argv[0]).name == "listenerd"
    assert host_path(a, option(argv, "--service-config")) == DEPLOY / "stageline.toml"
    assert host_path(a, option(argv, "--config")) == DEPLOY / "config"
    assert "--api-port" not in argv, "one API port for every node: HAProxy reaches each on it"
    assert "ports" not in a and "ports" not in b, "senders reach the nodes through the VIP only"


def test_listenerd_gets_every_api_token_its_config_names(services, listener_config):
    token_envs = [t["token_env"] for t in listener_config.api.get("tokens", []) if "token_env" in t]
    assert token_envs, "the cluster API has no token: every guarded endpoint would answer 401"
    for name in LISTENERD:
        env = env_of(services[name])
        for var in token_envs:
            assert referenced_vars(env.get(var, "")) == {var}, f"{name} lacks {var}"
    # and listenerd accepts them, as node.py reads them
    auth = ApiAuth.from_config(listener_config.api, dict.fromkeys(token_envs, FAKE_ENV["STAGELINE_API_TOKEN"]))
    assert auth.configured


# ---- deploy/stageline.toml and deploy/config/ with Stageline's own loaders --------------------


def test_cluster_service_config_loads_and_passes_the_rules():
    config = cfgmod.load(DEPLOY / "stageline.toml")
    store, cluster = config.store, config.cluster
    assert store.backend == "postgres" and cluster.enabled
    assert store.server == "postgres" and store.effective_port == 5432, "the compose database service"
    assert store.pool_size >= 2
    assert cluster.heartbeat_seconds < cluster.leader_fence_timeout_seconds < cluster.leader_lease_ttl_seconds
    assert cluster.node_timeout_seconds > cluster.heartbeat_seconds
    raw = tomllib.loads((DEPLOY / "stageline.toml").read_text())
    assert not any("password" in key for key in raw["store"]), "the password only ever comes from the environment"


def test_cluster_service_config_names_the_database_the_init_script_creates():
    config = cfgmod.load(DEPLOY / "stageline.toml")
    init = INIT_SCRIPT.read_text()
    assert re.search(rf"CREATE ROLE {config.store.username} LOGIN", init)
    assert re.search(rf"CREATE DATABASE {config.store.database} OWNER {config.store.username}\b", init)
    conn = yaml.safe_load(COMPOSE.read_text())["services"]["airflow-scheduler"]["environment"][
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"
    ]
    user, database = re.search(r"://(\w+):.*/(\w+)$", conn).groups()
    assert re.search(rf"CREATE DATABASE {database} OWNER {user}\b", init)


def test_a_broken_lease_timing_in_the_cluster_config_is_refused(tmp_path):
    text = (DEPLOY / "stageline.toml").read_text()
    broken = re.sub(r"(?m)^leader_fence_timeout_seconds = .*$", "leader_fence_timeout_seconds = 20.0", text)
    assert broken != text
    (tmp_path / "stageline.toml").write_text(broken)
    with pytest.raises(cfgmod.ConfigError, match="heartbeat_seconds < leader_fence_timeout_seconds"):
        cfgmod.load(tmp_path / "stageline.toml")


def test_cluster_config_dir_loads_with_listenerds_loader(listener_config):
    assert listener_config.directory == (DEPLOY / "config").resolve()
    mllp = [c for c in listener_config.inbound if c.kind == "mllp"]
    assert len(mllp) == 1
    conn = mllp[0]
    assert conn.host == "0.0.0.0" and conn.allow_insecure_bind, "reachable by HAProxy over the compose network"
    settings = ApiSettings.from_config(listener_config.api, listener_config.directory)
    assert settings.host == "0.0.0.0" and settings.allow_insecure_bind
    text = (DEPLOY / "config" / "connections.toml").read_text()
    assert len(re.findall(r"(?m)^allow_insecure_bind = true\b", text)) == 2
    assert "compose network" in text, "an insecure bind must say why it is acceptable"


# ---- HAProxy: the VIP ---------------------------------------------------------------------------


def _duration_ms(value: str) -> float:
    number, unit = re.fullmatch(r"(\d+)(ms|s)?", value).groups()
    return float(number) * (1 if unit == "ms" else 1000)


def test_haproxy_backends_name_both_nodes_and_ask_leader_on_the_api_port(data_port, api_port):
    sections = haproxy_sections(HAPROXY_CFG.read_text())
    defaults = " ".join(sections["defaults"])
    assert "mode tcp" in defaults
    for port in (data_port, api_port):
        backend = haproxy_backend_of(sections, port)
        servers = haproxy_servers(sections[backend])
        assert set(servers) == set(LISTENERD), f"{backend} names {sorted(servers)}"
        for name, args in servers.items():
            assert args[0] == f"{name}:{port}", f"{backend}/{name} forwards to {args[0]}"
            assert "check" in args, f"{backend}/{name} is not health-checked"
            assert args[args.index("port") + 1] == str(api_port), (
                f"{backend}/{name} must ask the API port {api_port} "
                f"(a frozen leader's kernel still accepts on {data_port})"
            )
        # /health answers 200 on a standby too, and a TCP connect passes on a frozen leader: /leader only,
        # per inbound (the MLLP one), so an inbound no node can bind does not empty this VIP
        assert "option httpchk GET /leader?inbound=adt-in" in sections[backend], (
            f"{backend} does not ask GET /leader?inbound=adt-in"
        )
        assert "http-check expect status 200" in sections[backend]


def test_haproxy_drops_a_silent_leader_within_two_seconds():
    """inter x fall + timeout check: how long a node that stopped answering stays in the VIP."""
    sections = haproxy_sections(HAPROXY_CFG.read_text())
    server_defaults = next(line.split() for line in sections["defaults"] if line.startswith("default-server "))
    inter = _duration_ms(server_defaults[server_defaults.index("inter") + 1])
    fall = int(server_defaults[server_defaults.index("fall") + 1])
    timeout_check = _duration_ms(
        next(line.split()[2] for line in sections["defaults"] if line.startswith("timeout check "))
    )
    assert timeout_check < inter, "a check that outlives the interval delays the next one"
    assert inter * fall + timeout_check <= 2000, (inter, fall, timeout_check)
    # MLLP: listenerd ends its own sessions when it stops leading (HAProxy cutting them raced a clean
    # stop's last ACKs); the API port stays open on a standby, so its sessions are cut by HAProxy
    assert "shutdown-sessions" not in " ".join(sections["defaults"] + sections["backend mllp_leader"])
    assert all(
        "on-marked-down shutdown-sessions" in line
        for line in sections["backend api_leader"]
        if line.startswith("server ")
    )


def test_haproxy_service_mounts_the_config_and_publishes_the_vip(services, data_port, api_port):
    haproxy = services["haproxy"]
    assert any(
        target == "/usr/local/etc/haproxy/haproxy.cfg" and source == HAPROXY_CFG
        for source, target in bind_mounts(haproxy)
    )
    published = {}
    for spec in haproxy["ports"]:
        host_ip, host_port, container_port = interpolate(str(spec), {}).split(":")
        assert host_port == container_port
        published[int(container_port)] = host_ip
    assert data_port in published and api_port in published
    for port, host_ip in published.items():
        assert host_ip == "127.0.0.1", f"port {port} is published beyond loopback by default: {host_ip}"
    assert set(haproxy["depends_on"]) == set(LISTENERD)


def test_haproxy_accepts_the_config():
    binary = shutil.which("haproxy")
    if binary is None:
        pytest.skip("no haproxy binary here (Debian package `haproxy`): `haproxy -c` not run")
    result = subprocess.run([binary, "-c", "-f", str(HAPROXY_CFG)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Configuration file is valid" in result.stdout + result.stderr


class _StandIn:
    """A stand-in node on a loopback address: it answers every connection with its own name and
    keeps it open, so we can see which node the VIP forwards to. The data port is bound only while
    `leading` — like listenerd, whose standby binds no data port; the API port is always bound and
    answers `GET /leader` 200 while leading, 503 otherwise. `freeze()` is what SIGSTOP leaves: the
    listening sockets stay (the kernel still completes handshakes) but nothing is ever answered."""

    def __init__(self, name: str, host: str, data_port: int, api_port: int) -> None:
        self.name, self.host, self.data_port = name, host, data_port
        self.leading = False
        self.frozen = threading.Event()
        self.api = self._serve(api_port, f"{name}-api", api=True)
        self.data: socketserver.ThreadingTCPServer | None = None

    def _serve(self, port: int, reply: str, *, api: bool = False) -> socketserver.ThreadingTCPServer:
        stand_in = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                if stand_in.frozen.is_set():
                    self.request.settimeout(30)
                    try:
                        while self.request.recv(1024):  # accepted by the kernel, never answered
                            pass
                    except OSError:
                        pass
                    return
                if api:
                    self.request.settimeout(0.2)
                    try:
                        first = self.request.recv(1024)
                    except OSError:
                        first = b""
                    if first.startswith(b"GET /leader"):
                        status = b"200 OK" if stand_in.leading else b"503 Service Unavailable"
                        self.request.sendall(
                            b"HTTP/1.1 " + status + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                        )
                        return
                self.request.sendall(reply.encode() + b"\n")
                self.request.settimeout(20)
                try:
                    while self.request.recv(1024):
                        pass
                except OSError:
                    pass

        server = socketserver.ThreadingTCPServer((self.host, port), Handler, bind_and_activate=False)
        server.daemon_threads = True
        server.allow_reuse_address = True
        server.server_bind()
        server.server_activate()
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return server

    def lead(self) -> None:
        self.data = self._serve(self.data_port, f"{self.name}-mllp")
        self.leading = True

    def freeze(self) -> None:
        self.frozen.set()

    def step_down(self) -> None:
        self.leading = False
        if self.data is not None:
            self.data.shutdown()
            self.data.server_close()
            self.data = None

    def close(self) -> None:
        self.frozen.clear()
        self.step_down()
        self.api.shutdown()
        self.api.server_close()


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ask(port: int) -> str:
    """Connect to the VIP and read which node answered ('' when nobody did)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
            sock.settimeout(2)
            return sock.recv(64).decode().strip()
    except OSError:
        return ""


def _until(predicate, *, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


@pytest.fixture
def local_haproxy(tmp_path, data_port, api_port) -> Iterator[tuple[dict[str, int], dict[str, _StandIn]]]:
    """deploy/haproxy.cfg with its addresses moved to loopback: listenerd-a → 127.0.0.2 and
    listenerd-b → 127.0.0.3 (same ports on both, as in compose), the VIP on 127.0.0.1."""
    binary = shutil.which("haproxy")
    if binary is None:
        pytest.skip("no haproxy binary here (Debian package `haproxy`): the VIP failover check is not run")
    node_data, node_api = _free_port("127.0.0.2"), _free_port("127.0.0.2")
    vip = {"mllp": _free_port(), "api": _free_port(), "stats": _free_port()}
    text = HAPROXY_CFG.read_text()
    replacements = [
        (rf"\blistenerd-a:{data_port}\b", f"127.0.0.2:{node_data}"),
        (rf"\blistenerd-b:{data_port}\b", f"127.0.0.3:{node_data}"),
        (rf"\blistenerd-a:{api_port}\b", f"127.0.0.2:{node_api}"),
        (rf"\blistenerd-b:{api_port}\b", f"127.0.0.3:{node_api}"),
        (rf"\bcheck port {api_port}\b", f"check port {node_api}"),
        (rf"(?m)^(\s*bind) :{data_port}$", rf"\g<1> 127.0.0.1:{vip['mllp']}"),
        (rf"(?m)^(\s*bind) :{api_port}$", rf"\g<1> 127.0.0.1:{vip['api']}"),
        (r"(?m)^(\s*bind) :8404$", rf"\g<1> 127.0.0.1:{vip['stats']}"),
    ]
    for pattern, replacement in replacements:
        text, count = re.subn(pattern, replacement, text)
        assert count, f"deploy/haproxy.cfg no longer matches {pattern}"
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(text)
    nodes = {
        name: _StandIn(name, host, node_data, node_api)
        for name, host in (("listenerd-a", "127.0.0.2"), ("listenerd-b", "127.0.0.3"))
    }
    with open(tmp_path / "haproxy.log", "wb") as log:
        proc = subprocess.Popen([binary, "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL, stderr=log)
    try:
        yield vip, nodes
    finally:
        proc.terminate()
        proc.wait(10)
        for node in nodes.values():
            node.close()


def test_vip_follows_the_node_that_binds_the_data_port(local_haproxy):
    vip, nodes = local_haproxy
    a, b = nodes["listenerd-a"], nodes["listenerd-b"]
    a.lead()  # a leads: only its data port is bound; both API ports are
    _until(lambda: _ask(vip["mllp"]) == "listenerd-a-mllp", timeout=10, what="the VIP to reach a's MLLP")
    answers = {_ask(vip["api"]) for _ in range(6)}
    assert answers == {"listenerd-a-api"}, f"the API VIP must go to the leader only, got {answers}"

    held = socket.create_connection(("127.0.0.1", vip["api"]), timeout=2)  # a session open through the VIP
    held.settimeout(10)
    assert held.recv(64).strip() == b"listenerd-a-api"

    a.step_down()  # failover: a unbinds (fenced / stopped), b wins the lease and binds
    b.lead()
    _until(lambda: _ask(vip["mllp"]) == "listenerd-b-mllp", timeout=10, what="the VIP to follow the new leader")
    _until(lambda: _ask(vip["api"]) == "listenerd-b-api", timeout=10, what="the API VIP to follow the new leader")
    # a's API port never closed, yet its session through the VIP is cut once a is marked down
    try:
        rest = held.recv(64)
    except ConnectionResetError:
        rest = b""
    finally:
        held.close()
    assert rest == b"", "the session to the old leader's API was left open"


def test_a_frozen_leader_leaves_the_vip_within_three_seconds(local_haproxy):
    """Issue 24: a frozen leader's kernel still completes handshakes on its ports, so a TCP check kept
    it in the VIP for the whole freeze; `GET /leader` needs the process, and it is out in < 3 s."""
    vip, nodes = local_haproxy
    a, b = nodes["listenerd-a"], nodes["listenerd-b"]
    a.lead()
    _until(lambda: _ask(vip["mllp"]) == "listenerd-a-mllp", timeout=10, what="the VIP to reach a's MLLP")
    a.freeze()  # SIGSTOP: a's sockets stay bound and accepting, nothing answers
    b.lead()  # the standby takes the lease (here at once; the check timing is what is measured)
    frozen_at = time.monotonic()
    _until(lambda: _ask(vip["mllp"]) == "listenerd-b-mllp", timeout=10, what="the VIP to leave the frozen leader")
    _until(lambda: _ask(vip["api"]) == "listenerd-b-api", timeout=10, what="the API VIP to leave the frozen leader")
    elapsed = time.monotonic() - frozen_at
    assert elapsed < 3.0, f"the frozen leader stayed in the VIP for {elapsed:.1f} s"


def test_a_leader_that_answers_503_gets_no_senders(local_haproxy):
    """A node whose MLLP port is open but whose /leader says 503 (it holds the lease but an inbound is
    unbound, or it fenced and has not closed yet) is not where the VIP sends anyone."""
    vip, nodes = local_haproxy
    a, b = nodes["listenerd-a"], nodes["listenerd-b"]
    a.lead()
    b.lead()
    _until(lambda: _ask(vip["mllp"]) == "listenerd-a-mllp", timeout=10, what="the VIP to reach a (first server)")
    a.leading = False  # port still bound, /leader 503
    _until(lambda: _ask(vip["mllp"]) == "listenerd-b-mllp", timeout=5, what="the VIP to leave a node answering 503")


# ---- optional: the real compose loader ----------------------------------------------------------


def _compose_command() -> list[str] | None:
    """`docker compose` (v2) if this machine has it, or $STAGELINE_COMPOSE_BIN (a standalone v2 binary)."""
    candidates = []
    if os.environ.get("STAGELINE_COMPOSE_BIN"):
        candidates.append([os.environ["STAGELINE_COMPOSE_BIN"]])
    if shutil.which("docker"):
        candidates.append(["docker", "compose"])
    if shutil.which("docker-compose"):
        candidates.append(["docker-compose"])
    for command in candidates:
        try:
            out = subprocess.run([*command, "version"], capture_output=True, text=True, timeout=20)
        except OSError:
            continue
        if out.returncode == 0 and re.search(r"\bv?2\.\d+", out.stdout):
            return command
    return None


def test_docker_compose_config_accepts_the_file():
    command = _compose_command()
    if command is None:
        pytest.skip("no Docker Compose v2 here (no `docker compose` plugin, no STAGELINE_COMPOSE_BIN)")
    base_env = {k: v for k, v in os.environ.items() if k not in FAKE_ENV}
    ok = subprocess.run(
        [*command, "-f", str(COMPOSE), "config", "-q"],
        capture_output=True,
        text=True,
        env={**base_env, **FAKE_ENV},
        cwd=ROOT,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    missing = subprocess.run(
        [*command, "-f", str(COMPOSE), "config", "-q"],
        capture_output=True,
        text=True,
        env=base_env,
        cwd=ROOT,
        timeout=60,
    )
    assert missing.returncode != 0 and "is missing a value" in missing.stderr, "secrets must be required"


# ---- the Dockerfile ----------------------------------------------------------------------------


def test_dockerfile_mirrors_setup_sh():
    text = DOCKERFILE.read_text()
    assert re.search(r"(?m)^FROM python:3\.11-slim-bookworm\b", text)
    for package in ("openjdk-17-jre-headless", "libpostgresql-jdbc-java", "libxerial-sqlite-jdbc-java", "libjtds-java"):
        assert re.search(rf"\b{re.escape(package)}\b", text), package
        assert package in (ROOT / "scripts" / "setup.sh").read_text(), f"{package} is not what setup.sh installs"
    assert re.search(r"UV_COMPILE_BYTECODE=1", text)
    assert re.search(r"\buv sync --locked\b", text)
    for jar in spark_consts.DRIVER_JARS.values():
        assert jar in text, f"the build does not check {jar} is there"
    copied = dockerfile_copies()
    for needed in ("pyproject.toml", "uv.lock", "include", "listeners", "spark_jobs", "dags", "plugins", "deploy"):
        assert needed in copied, f"the image lacks {needed}"
    assert ".venv" not in copied and "." not in copied, "the host's .venv must not reach the image"
    assert re.search(r"(?m)^USER (?!root)\w+", text), "the processes must not run as root"


# ---- real processes where they can run here -----------------------------------------------------


def test_spark_connect_command_starts_a_server_that_answers(services, tmp_path):
    if shutil.which("java") is None:
        pytest.skip("no java here: the Spark Connect command is not started")
    service = services["spark-connect"]
    container_home = env_of(service)["SPARK_HOME"]
    home = str(Path(spark_consts.spark_home()))
    port = _free_port()
    # The compose file's standalone master, here: a master and a worker from include/app/lab/spark_cluster.py.
    cluster = SparkCluster(tmp_path / "spark", workers=1, cores=1, memory="2g").start()  # executors take 1g
    assert option(argv_of(service), "--master") == "spark://spark-master:7077"
    argv = [
        a.replace(container_home, home).replace("spark://spark-master:7077", cluster.master_url)
        for a in argv_of(service)
    ]
    confs = {
        "spark.connect.grpc.binding.address": "127.0.0.1",
        "spark.connect.grpc.binding.port": str(port),
        "spark.sql.warehouse.dir": str(tmp_path / "warehouse"),
        "spark.driver.host": "127.0.0.1",
    }
    argv = [f"{a.split('=', 1)[0]}={confs[a.split('=', 1)[0]]}" if a.split("=", 1)[0] in confs else a for a in argv]
    log = tmp_path / "spark-connect.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv,
            env={**os.environ, "SPARK_HOME": home},
            cwd=tmp_path,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:

        def listening() -> bool:
            assert proc.poll() is None, f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                return True
            except OSError:
                return False

        _until(listening, timeout=120, what="the Spark Connect server to listen")
        # A client in its own process: a Connect session switches pyspark to Connect process-wide.
        client = (
            "from pyspark.sql import SparkSession; "
            f"s = SparkSession.builder.remote('sc://127.0.0.1:{port}').getOrCreate(); "
            "print(s.range(7).count(), s.conf.get('spark.sql.session.timeZone'))"
        )
        out = subprocess.run([sys.executable, "-c", client], capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.split() == ["7", "UTC"]
        loaded = log.read_text()
        for jar in map(Path, spark_consts.DRIVER_JARS.values()):
            if jar.exists():
                names = {jar.name, jar.resolve().name}  # Debian's jars are symlinks to versioned files
                link = jar
                while link.is_symlink():
                    link = link.parent / os.readlink(link)
                    names.add(link.name)
                assert any(
                    f"Added JAR file:{p}" in loaded or f"Added JAR file://{p}" in loaded
                    for p in (str(jar.parent / n) for n in names)
                ), f"{jar} not on the server's classpath"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait(10)
        cluster.stop()


@pytest.mark.postgres
def test_init_script_and_migrate_job_work_on_postgres_15(services, tmp_path):
    """The init script on an empty server, then the migrate job's own command with its own
    environment (hosts and /app paths moved to this machine), with password authentication on."""
    from include.app.lab.postgres_server import PG_BIN, PostgresServer

    if not (PG_BIN / "initdb").exists() or not (PG_BIN / "psql").exists():
        pytest.skip(f"no PostgreSQL server binaries under {PG_BIN}")
    import psycopg

    odd = {**FAKE_ENV, "STAGELINE_STORE_PASSWORD": "s'q\"d $x\\y " + secrets.token_hex(4)}  # quoting must hold
    with PostgresServer(settings={"fsync": "off"}) as server:
        init_env = {
            **os.environ,
            "PATH": f"{PG_BIN}:{os.environ['PATH']}",
            "PGHOST": server.host,
            "PGPORT": str(server.port),
            "POSTGRES_USER": server.user,
            "POSTGRES_DB": "postgres",
            **{
                k: interpolate(v, odd)
                for k, v in env_of(services["postgres"]).items()
                if k not in ("POSTGRES_USER", "POSTGRES_DB")
            },
        }
        init = subprocess.run(["bash", str(INIT_SCRIPT)], env=init_env, capture_output=True, text=True, timeout=60)
        assert init.returncode == 0, init.stderr
        # from now on: passwords, as in the image (the superuser keeps trust for the checks)
        (server.data / "pg_hba.conf").write_text(
            f"host all {server.user} 127.0.0.1/32 trust\nhost all all 127.0.0.1/32 scram-sha-256\n"
        )
        server.execute("SELECT pg_reload_conf()")

        def login(user: str, dbname: str, password: str) -> None:
            psycopg.connect(host=server.host, port=server.port, user=user, dbname=dbname, password=password).close()

        login("stageline", "stageline", odd["STAGELINE_STORE_PASSWORD"])
        login("airflow", "airflow", odd["AIRFLOW_DB_PASSWORD"])
        with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
            login("stageline", "stageline", "wrong")
        with pytest.raises(psycopg.OperationalError, match="permission denied"):  # its own database only
            login("stageline", "airflow", odd["STAGELINE_STORE_PASSWORD"])
        with pytest.raises(psycopg.OperationalError, match="permission denied"):
            login("airflow", "stageline", odd["AIRFLOW_DB_PASSWORD"])

        service_config = tmp_path / "stageline.toml"
        text, count = re.subn(
            r'(?m)^server = "postgres"', f'server = "{server.host}"', (DEPLOY / "stageline.toml").read_text()
        )
        text, count2 = re.subn(r"(?m)^port = 5432\b", f"port = {server.port}", text)
        assert count == count2 == 1
        service_config.write_text(text)

        migrate = services["stageline-migrate"]
        env = {}
        for key, value in env_of(migrate).items():
            value = interpolate(value, odd).replace("@postgres:5432/", f"@{server.host}:{server.port}/")
            if value.startswith(APP):  # a path, or a PYTHONPATH-style list of them
                value = os.pathsep.join(str(host_path(migrate, part)) for part in value.split(":"))
            env[key] = value
        env.update(
            {
                cfgmod.CONFIG_ENV: str(service_config),
                "AIRFLOW_HOME": str(tmp_path / "airflow"),
                "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            }
        )
        argv = argv_of(migrate)
        for attempt in (1, 2):  # the job runs on every `docker compose up`: it must be repeatable
            run = subprocess.run(
                argv, env={**os.environ, **env}, cwd=tmp_path, capture_output=True, text=True, timeout=300
            )
            assert run.returncode == 0, f"attempt {attempt}:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
            assert "cluster 'stageline-compose'" in run.stdout

        def owners(db: str) -> dict[str, str]:
            with psycopg.connect(server.conninfo(db)) as conn:
                return dict(conn.execute("SELECT tablename, tableowner FROM pg_tables WHERE schemaname = 'public'"))

        stageline_tables, airflow_tables = owners("stageline"), owners("airflow")
        assert {"stage_inbound", "leader_lease", "nodes", "cluster_identity"} <= set(stageline_tables)
        assert set(stageline_tables.values()) == {"stageline"}
        assert {"dag_run", "task_instance", "alembic_version"} <= set(airflow_tables)
        assert set(airflow_tables.values()) == {"airflow"}
