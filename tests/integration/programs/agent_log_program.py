"""Starts the dynprof agent with ``dynprof.agent.start()`` and logs from threads around its stop.

--full-log: the agent's log file is /dev/full (every write fails with ENOSPC, as on a full
filesystem). Logs warnings and errors while the agent runs, stops it, then a thread logs again
("late line") after the agent stopped. Prints ``DONE`` at the end; exits normally.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading

from dynprof.paths import logs_dir


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--full-log", action="store_true")
    args = parser.parse_args()
    if args.full_log:
        os.symlink("/dev/full", logs_dir() / f"{os.getpid()}.log")
    import dynprof.agent

    agent = dynprof.agent.start()
    assert agent is not None and agent.wait_ready(30)
    log = logging.getLogger("dynprof.agent")
    for i in range(3):
        log.warning("warning %d while the agent runs", i)
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("an error while the agent runs")
    print(f"READY {os.getpid()}", flush=True)
    dynprof.agent.shutdown()
    late = threading.Thread(target=lambda: (log.info("late line"), log.warning("late warning")))
    late.start()
    late.join()
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
