"""Fixtures the listener tests share."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
from twisted.logger import ILogObserver, LogEvent, globalLogPublisher
from zope.interface import provider


@pytest.fixture
def logs() -> Iterator[list[LogEvent]]:
    """Every event logged while the test runs, in order: for asserting what a log line says (or
    that none carries a message body)."""
    events: list[LogEvent] = []

    @provider(ILogObserver)
    def observe(event: LogEvent) -> None:
        events.append(event)

    globalLogPublisher.addObserver(observe)
    yield events
    globalLogPublisher.removeObserver(observe)
