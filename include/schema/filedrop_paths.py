"""Where a file connection keeps its claimed files, known to both sides of the include/ line.

listenerd (`listeners/filedrop.py`) claims a file by renaming it into the connection's private
processing directory; the config check (`include/schema/connections.py`, which may not import
listeners) must know the same path to keep every other connection's drop off it: a drop there would
stage each claimed file a second time. One rule, here; tests/config/test_config_second_pass.py
holds `listeners.filedrop.default_processing` to it.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["processing_dir"]


def processing_dir(connection: str, archive: str | Path) -> Path:
    """`<archive>/.processing-<connection>`: inside the archive (its file system, so the final move
    is a rename). With the default archive that is `<var>/filedrop/<name>/archive/.processing-<name>`."""
    return Path(archive) / f".processing-{connection}"
