"""The `lab` destination's native rules written as a code hook (bench/pipeline.py --code-hook):
MSH-5 := LIS, PID-19 cleared, OBX-11 := F in every OBX — python-hl7 in, python-hl7 out."""

from __future__ import annotations

from typing import Any


def _put(segment: Any, index: int, value: str) -> None:
    while len(segment) <= index:
        segment.append("")
    segment[index] = value


def lab(message: Any) -> Any:
    message["MSH.F5"] = "LIS"
    for pid in message.segments("PID"):
        if len(pid) > 19:
            pid[19] = ""
    for obx in message.segments("OBX"):
        _put(obx, 11, "F")
    return message


def identity(message: Any) -> Any:
    """Parse and render only: the hatch's own cost, without any user logic."""
    return message
