"""One local SparkSession for the whole directory: JVM start dominates, so share it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pyspark.sql import SparkSession

from include.spark import driver_jars


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """A single-core local session with tiny shuffles and no UI; stopped when the run ends.

    Debian's JDBC driver jars are on it (`spark.jars`) for the stage jobs' reads and writes.
    """
    session = (
        SparkSession.builder.master("local[1]")
        .appName("stageline-spark-jobs-tests")
        .config("spark.jars", ",".join(driver_jars()))
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "1")
        .config("spark.default.parallelism", "1")
        .config("spark.sql.session.timeZone", "UTC")
        # A short-lived JVM: C1-only JIT and serial GC start faster than the server defaults.
        .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()
