"""`listenerd --service-config stageline.toml --config ./config`: run one node until SIGTERM.

The one entry point: `makeService` builds the node's service tree (`listeners.node`), for the
`listenerd` command (`main`, below) and for `twistd -n stageline-listenerd` alike (the plugin in
`twisted/plugins/stageline_listenerd.py` points here).

Exit codes: 0 after a clean stop, 2 for a configuration error, 1 when the node cannot start
(store unreachable, foreign cluster, unmigrated store).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from twisted.logger import (
    FilteringLogObserver,
    Logger,
    LogLevel,
    LogLevelFilterPredicate,
    globalLogBeginner,
    textFileLogObserver,
)
from twisted.python import usage

from include import config as cfgmod
from include.schema import ConfigProblems
from listeners.config_check import check_dir, store_lookup_tables
from listeners.mllp_listener import log_each_answer
from listeners.node import ListenerNode

__all__ = ["Options", "main", "makeService"]

_log = Logger(namespace="stageline.listenerd")

LOG_LEVELS = ("debug", "info", "warn", "error")


class Options(usage.Options):
    synopsis = "--service-config stageline.toml --config ./config [--api-port N] [--log-level info]"
    optParameters = [
        ["service-config", None, None, "stageline.toml ([store], [cluster])"],
        ["config", None, "config", "config dir holding connections.toml"],
        ["api-port", None, None, "override [api].port (several nodes on one host sharing one config dir)", int],
        ["log-level", None, "info", f"one of {', '.join(LOG_LEVELS)} (the listenerd command only)"],
    ]

    def postOptions(self) -> None:
        if self["log-level"] not in LOG_LEVELS:
            raise usage.UsageError(f"--log-level must be one of {', '.join(LOG_LEVELS)}")


def makeService(options: Options | dict[str, Any]) -> ListenerNode:
    """The node's service tree; raises `ConfigProblems` (`ConfigError`, `ConnectionConfigError`) for a
    bad config."""
    node = ListenerNode(cfgmod.load(options["service-config"]), options["config"], api_port=options["api-port"])
    node.install_signal_handlers()
    return node


def config_ok(options: Options | dict[str, Any]) -> bool:
    """`stageline config check` on the config dir and the service config (every problem printed,
    with file and key); False when there is any. Lookup tables a transform names are looked for in
    the store too; an unreadable store leaves them unchecked here (starting the node reports the store)."""
    tables, _ = store_lookup_tables(options["service-config"])
    report = check_dir(
        options["config"],
        store_tables=tables,
        lookups_unverified_ok=tables is None,
        service_config=cfgmod.config_path(options["service-config"]) if _service_given(options) else None,
    )
    for problem in report.problems:
        print(f"listenerd: configuration error: {problem}", file=sys.stderr)
    return report.ok


def _service_given(options: Options | dict[str, Any]) -> bool:
    """A service config named (option or $STAGELINE_CONFIG) or present: a missing default is the
    embedded defaults, not a problem."""
    path = cfgmod.config_path(options["service-config"])
    return bool(options["service-config"]) or path.exists() or path != Path(cfgmod.DEFAULT_CONFIG)


def main(argv: list[str] | None = None) -> None:
    options = Options()
    try:
        options.parseOptions(sys.argv[1:] if argv is None else argv)
    except usage.UsageError as exc:
        print(f"{options}\nlistenerd: {exc}", file=sys.stderr)
        sys.exit(2)
    # The group-commit thread (stores other than PostgreSQL, whose group commit runs on the reactor)
    # waits on the database many times a second; with the default 5 ms GIL switch interval each
    # wake-up can queue behind a busy reactor thread for that long.
    sys.setswitchinterval(0.0005)
    observer = FilteringLogObserver(
        textFileLogObserver(sys.stdout), [LogLevelFilterPredicate(LogLevel.levelWithName(options["log-level"]))]
    )
    globalLogBeginner.beginLoggingTo([observer], redirectStandardIO=False)
    log_each_answer(options["log-level"] == "debug")
    if not config_ok(options):
        sys.exit(2)
    cfgmod.private_var_dir()  # the store, the token and the drops' archives: 0700 whatever the umask
    try:
        node = makeService(options)
    except ConfigProblems as exc:  # the check above passed, but the files changed since, or a rule of its own
        for problem in exc.problems:
            print(f"listenerd: configuration error: {problem}", file=sys.stderr)
        sys.exit(2)
    from twisted.internet import reactor

    status = {"code": 0}

    def start() -> None:
        try:
            node.startService()
        except Exception as exc:
            _log.critical("listenerd cannot start: {err}", err=exc)
            print(f"listenerd: cannot start: {exc}", file=sys.stderr)
            status["code"] = 1
            reactor.stop()
            return
        reactor.addSystemEventTrigger("before", "shutdown", node.stopService)

    reactor.callWhenRunning(start)
    reactor.run()
    sys.exit(status["code"])


if __name__ == "__main__":
    main()
