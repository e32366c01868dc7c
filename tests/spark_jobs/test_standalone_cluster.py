"""A stage job on a Spark standalone cluster — a master and two workers as separate processes, a
Spark Connect server running its jobs there — routes exactly what the same job routes on
`local[*]` (the same oracle as tests/spark_jobs/test_route_job.py), and both workers did work."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from include.app.lab.postgres_server import free_port
from include.app.lab.spark_cluster import SparkCluster
from include.config import StoreConfig
from include.spark import start_connect_server, stop_connect_server
from include.store import Store
from include.store.lease import acquire_permanent
from tests.spark_jobs.test_route_job import NODE, expected_triples, routed_triples, stage_messages

REPO = Path(__file__).resolve().parents[2]
CHILD = textwrap.dedent("""
    import sys
    from include.config import StoreConfig
    from include.spark import spark_session, stage_session
    from include.store import Store
    from tests.spark_jobs.test_route_job import route_run
    url, path, epoch = sys.argv[1], sys.argv[2], int(sys.argv[3])
    store = Store(StoreConfig(backend="sqlite", path=path))
    with stage_session(spark_session(remote=url)) as session:
        session.spark.conf.set("spark.sql.shuffle.partitions", "4")
        outcome = route_run(store, session.spark, owner="standalone", epoch=epoch, run_id="s1")
    print("claimed", len(outcome.claimed), flush=True)
""")


def test_a_route_job_on_a_two_worker_standalone_cluster_routes_like_local(
    sqlite_config_fresh: StoreConfig, tmp_path: Path
) -> None:
    store = Store(sqlite_config_fresh)
    epoch = acquire_permanent(store, node_id=NODE)
    ids = stage_messages(store, epoch, range(40))
    cluster = SparkCluster(tmp_path / "spark", workers=2, cores=1, memory="512m").start()
    server = None
    try:
        server = start_connect_server(
            free_port(),
            log_dir=tmp_path / "connect",
            master=cluster.master_url,
            conf={"spark.executor.memory": "512m", "spark.cores.max": "2"},
        )
        child = subprocess.run(
            [sys.executable, "-c", CHILD, server.url, sqlite_config_fresh.path, str(epoch)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=REPO,
        )
        assert child.returncode == 0, child.stderr[-4000:]
        assert "claimed 40" in child.stdout
    finally:
        if server is not None:
            stop_connect_server(server)
        cluster.stop()
    assert routed_triples(store) == expected_triples(ids)
    store.close()
    ran = {}
    for worker in cluster.worker_processes:
        logs = list(worker.work_dir.glob("app-*/*/stderr"))
        ran[worker.name] = sum(p.read_text(errors="replace").count("Running task") for p in logs)
    print(f"\ntasks run per worker: {ran}")
    assert all(count > 0 for count in ran.values()), ran  # both workers did work
