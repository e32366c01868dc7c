"""`listenerd --service-config stageline.toml --config ./config`: run one node until SIGTERM.

Exit codes: 0 after a clean stop, 2 for a configuration error, 1 when the node cannot start
(store unreachable, foreign cluster, unmigrated store).
"""
from __future__ import annotations

import argparse
import sys

from twisted.logger import Logger, LogLevel, LogLevelFilterPredicate, FilteringLogObserver, globalLogBeginner
from twisted.logger import textFileLogObserver

from include import config as cfgmod
from listeners.connections import ConnectionConfigError

_log = Logger(namespace="stageline.listenerd")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="listenerd", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--service-config", default=None, help="stageline.toml ([store], [cluster])")
    ap.add_argument("--config", default="config", help="config dir holding connections.toml")
    ap.add_argument("--api-port", type=int, default=None,
                    help="override [api].port (several nodes on one host sharing one config dir)")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warn", "error"])
    return ap.parse_args(argv)


def build(args: argparse.Namespace):
    from listeners.node import ListenerNode

    return ListenerNode(cfgmod.load(args.service_config), args.config, api_port=args.api_port)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # The group-commit thread waits on the database many times a second; with the default 5 ms
    # GIL switch interval each wake-up can queue behind a busy reactor thread for that long.
    sys.setswitchinterval(0.0005)
    observer = FilteringLogObserver(textFileLogObserver(sys.stdout),
                                    [LogLevelFilterPredicate(LogLevel.levelWithName(args.log_level))])
    globalLogBeginner.beginLoggingTo([observer], redirectStandardIO=False)
    try:
        node = build(args)
    except (cfgmod.ConfigError, ConnectionConfigError) as exc:
        print(f"listenerd: configuration error: {exc}", file=sys.stderr)
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

    node.install_signal_handlers()
    reactor.callWhenRunning(start)
    reactor.run()
    sys.exit(status["code"])


if __name__ == "__main__":
    main()
