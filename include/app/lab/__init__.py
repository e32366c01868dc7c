"""The lab: a Stageline cluster built from plain processes on one host, and the parts it is made of.

    two_nodes.py        `Lab`: two `listenerd` nodes behind an HAProxy VIP, PostgreSQL, Airflow,
                        Spark Connect and a recording receiver, with one method per fault
    listenerd.py        `Daemon`: one `listenerd` process (its config written, started, stopped by PID)
    postgres_server.py  `PostgresServer`: a throwaway PostgreSQL (`initdb` + `pg_ctl`); `free_port`, `wait_for`
    replicated_store.py `ReplicatedStore`: etcd, two PostgreSQL under Patroni (synchronous), HAProxy on
                        `GET /primary` — the store that survives losing its database host
    haproxy.py          where HAProxy is, and a backend's servers as its status page shows them
    tcpproxy.py         `TcpProxy`: a node's link to the database, which a fault can cut and restore
    recorder.py         an MLLP receiver that records every delivery, duplicates included

Runtime code, shipped in the wheel and importing nothing from `tests/`: the failover benchmark
(`bench/failover.py`) and the tests drive it. The sender stream and its verdict, which only the
tests and benchmarks use, live in `tests/support/stream.py`.
"""
