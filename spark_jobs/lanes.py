"""An outbound row's lane key, in Spark: which lane of its destination a transformed message joins.

The Spark twin of `include.destinations_config.lane_key` (one lane per destination, or one per
value of an HL7 path), computed by the transform stage before any rule rewrites the message.
"""

from __future__ import annotations

from collections.abc import Mapping

from pyspark.sql import Column
from pyspark.sql import functions as F

from include.destinations_config import Destination
from spark_jobs.hl7_fields import field


def lane_key(destination: Column, payload: Column, destinations: Mapping[str, Destination]) -> Column:
    """The outbound lane key, the Spark twin of `include.destinations_config.lane_key`.

    `<name>` for a destination-wide lane (and for a destination not configured), `<name>|<value>`
    for an HL7-path lane, the value read raw from the message as routed (before any rule runs).
    Destinations that key on the same path share one read of it (a smaller plan to analyze).
    """
    by_path: dict[str, list[str]] = {}
    for name, dest in sorted(destinations.items()):
        if dest.lane != "destination":
            by_path.setdefault(dest.lane, []).append(name)
    key: Column | None = None
    for path, names in by_path.items():
        value = F.concat(destination, F.lit("|"), F.coalesce(field(payload, path), F.lit("")))
        cond = destination.isin(names)
        key = F.when(cond, value) if key is None else key.when(cond, value)
    return destination if key is None else key.otherwise(destination)
