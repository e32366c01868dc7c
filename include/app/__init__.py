"""The top floor: what a person runs, built on everything below it.

    cli.py, cli_common.py, cli_messages.py   the `stageline` command
    embedded.py                              `stageline up`: the single-node stack, supervised
    supervisor.py                            start processes in order, wait for each, stop them all
    demo.py                                  sample messages and the demo receiver
    lab/                                     a two-node cluster from processes, for failover runs

It may import `listeners` and `spark_jobs` (the CLI runs the config check that `listenerd` runs);
nothing below imports it (tests/test_structure.py).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The checkout: where `config/`, `dags/` and `var/` are, and the working directory of the processes
the app starts."""
