"""The environment a user's shell would give a program the tests start as that user would (`stageline up`).

The test process is not such a shell: `tests/dags/conftest.py` configures Airflow for in-process
`dag.test()` runs through `os.environ` at collection time (Airflow reads its config on import), so
in a run that collects that directory every later subprocess inherits Airflow's unit-test mode (its
scheduler never sleeps between loops), warnings-only logging and `STAGELINE_STAGE_LINGER_SECONDS=0`
(a stage task ends as soon as its work is done, so the next message waits for a new DAG run and a
task start). Run alone, a test sees none of that; in the full suite it did (issue 29: 11-20 s for
a delivery after an idle minute that takes about one second).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

SUITE_PREFIXES = ("AIRFLOW_", "STAGELINE_")
"""Settings the suite may have put in `os.environ`, none of which a user's shell is assumed to have."""


def user_env(extra: Mapping[str, str] | None = None, *, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default `os.environ`) without Airflow's and Stageline's settings, plus `extra`."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith(SUITE_PREFIXES)}
    return {**env, **(extra or {})}
