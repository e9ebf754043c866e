"""Agent extension: the hang watchdog (opt-in with ``DYNPROF_HANG_TIMEOUT=SEC``).

When no optimizer step of any optimizer completes for the timeout, this process's stacks
(every thread) are dumped and registered as a ``hang`` artifact; a second dump follows
``SECOND_DUMP_FACTOR`` timeouts later if the process is still stuck, so the two can be
compared. Once steps flow again the watchdog re-arms for the next stall.

Who dumps: a low-frequency monitor thread (waking every timeout/4) dumps with faulthandler
while *it holds the GIL*, so every other thread is parked (waiting for the GIL, or in C without
it) and its frames cannot change under the reader. faulthandler's C timer, which needs no GIL,
is only the backstop for a thread stuck in C *holding* the GIL: it is set ``grace`` seconds
later than the monitor's deadline, so on a live process it never fires. The dump comes between
1 and 1.25 timeouts after the last step; never before the timeout.

Progress is an optimizer step of any optimizer, or a ``dynprof.phase(NAME)`` in progress (an
evaluation, a checkpoint: "busy, not hung"); after a phase the timeout counts from its end.

Cost per optimizer step: nothing. No step listener is installed: the monitor reads the step
tracker's last-progress time. Before the first step (compilation, data loading) the watchdog
is quiet unless ``DYNPROF_HANG_FIRST_STEP_TIMEOUT`` is set, and even then in processes that
never step by design: launchers and DataLoader workers (``dynprof.roles``). A process whose
role is not known yet (a spawned child still importing its parent's main module, before its
target runs: ``roles.role_pending``) arms nothing; its first-step timeout counts from when it is.

faulthandler has one such timer per process: a job that calls
``faulthandler.dump_traceback_later`` itself should not also use the watchdog.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import threading
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from dynprof import _phase, _settings, roles
from dynprof.paths import ensure_private_dir, run_dir
from dynprof.store import ArtifactStore

if TYPE_CHECKING:
    from dynprof.agent._agent import Agent

log = logging.getLogger("dynprof.agent")

ENV_TIMEOUT = "DYNPROF_HANG_TIMEOUT"
ENV_FIRST_STEP = "DYNPROF_HANG_FIRST_STEP_TIMEOUT"
SECOND_DUMP_FACTOR = 3.0  # the second dump of a stall comes this many timeouts after the first
MAX_ARTIFACTS = 20  # per process, over its whole life


def _seconds(name: str) -> float:
    text = (_settings.getenv(name) or "").strip()
    if not text:
        return 0.0
    try:
        value = float(text)
    except ValueError:
        log.warning("%s=%r is not a number of seconds; the hang watchdog is off", name, text)
        return 0.0
    return value if value > 0 else 0.0


class HangWatchdog:
    def __init__(self, agent: Agent, timeout_s: float, first_step_timeout_s: float = 0.0) -> None:
        self.agent = agent
        self.timeout_s = timeout_s
        self.first_step_timeout_s = first_step_timeout_s
        self.interval_s = max(0.05, timeout_s / 4)
        self.artifacts: list[str] = []
        self.state = "waiting for the first step"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._file: IO[str] | None = None
        self._file_path: Path | None = None
        self._seq = 0
        self._armed_for = 0.0
        self.grace_s = max(1.0, timeout_s / 2)  # the C backstop fires this much after the monitor's deadline
        self._seen_progress = -1.0
        self._progress_at = time.time()
        self._next_dump_at = 0.0
        self._dumps_this_stall = 0
        self._exempt = ""  # the role that exempts this process from the first-step timeout

    # -- life cycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._dir = run_dir() / "hang"
        ensure_private_dir(self._dir)
        self._thread = threading.Thread(target=self._run, name="dynprof-hang", daemon=True)
        self._thread.start()
        log.info(
            "hang watchdog on: timeout %.3g s (first step: %s)",
            self.timeout_s,
            f"{self.first_step_timeout_s:g} s" if self.first_step_timeout_s else "not watched",
        )

    def stop(self) -> None:
        self._stop.set()
        self._disarm()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        self._close_file(remove_if_empty=True)

    # -- faulthandler's timer ---------------------------------------------------------------
    def _open_file(self) -> IO[str]:
        if self._file is None:
            self._seq += 1
            self._file_path = self._dir / f"{os.getpid()}-{self._seq}.txt"
            self._file = open(self._file_path, "w")  # kept open: faulthandler writes into it
        return self._file

    def _close_file(self, remove_if_empty: bool = False, remove: bool = False) -> None:
        fh, path = self._file, self._file_path
        self._file = None
        if fh is not None:
            with contextlib.suppress(OSError):
                fh.close()
            if (remove_if_empty or remove) and path is not None:
                with contextlib.suppress(OSError):
                    if remove or path.stat().st_size == 0:
                        path.unlink()

    def _arm(self, seconds: float) -> None:
        """Arm faulthandler's C timer as the backstop for a GIL held in C."""
        faulthandler.dump_traceback_later(seconds + self.grace_s, repeat=False, file=self._open_file(), exit=False)
        self._armed_for = seconds

    def _disarm(self) -> None:
        if self._armed_for:
            faulthandler.cancel_dump_traceback_later()
            self._armed_for = 0.0

    def _c_timer_fired(self) -> bool:
        path = self._file_path
        if not self._armed_for or path is None or self._file is None:
            return False
        try:
            return path.stat().st_size > 0
        except OSError:
            return False

    # -- the monitor thread -----------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._check()
            except Exception:
                log.exception("hang watchdog check failed; it stops")
                self._disarm()
                return

    def _check(self) -> None:
        steps = self.agent.steps
        steps.fold_compiled()
        progress = steps.last_progress_at
        now = time.time()
        if not progress and roles.role_pending():
            # A spawned child still starting (importing its parent's main module): what it is,
            # a DataLoader worker or a rank, is not known yet. Nothing is armed; the first-step
            # timeout counts from the moment it is known.
            self._disarm()
            self._close_file(remove=True)
            self._progress_at = now
            self.state = "waiting for its role (a spawned process starting)"
            return
        if progress != self._seen_progress:
            self._seen_progress = progress
            self._progress_at = progress or now
            if self._dumps_this_stall:
                log.info("steps flow again (step %d) after a stall; the watchdog re-arms", steps.step)
                self._dumps_this_stall = 0
            self._next_dump_at = 0.0
            self.state = "armed" if progress else self.state
        busy = _phase.busy_until(now)  # a dynprof.phase in progress (or just ended) is progress too
        if busy > self._progress_at:
            self._progress_at = busy
            self._next_dump_at = 0.0
            if self._dumps_this_stall:
                log.info("a dynprof.phase runs after a stall; the watchdog re-arms")
                self._dumps_this_stall = 0
            in_phase = _phase.current()
            self.state = f"busy: in phase {in_phase[0]}" if in_phase else ("armed" if progress else self.state)
        limit = self.timeout_s if progress else self._first_step_limit(now)
        if self._c_timer_fired():
            # This thread could not run in time: a thread held the GIL in C. The C timer's dump
            # counts only if the process really made no progress for the timeout.
            time.sleep(0.05)  # let faulthandler finish writing
            self._armed_for = 0.0
            if limit and now - self._progress_at >= limit and self._dumps_this_stall < 2:
                self._dumped(now, from_c_timer=True)
            else:
                log.info("faulthandler's backstop fired while steps were flowing (or before the first); discarded")
                self._close_file(remove=True)
        elif limit and self._dumps_this_stall < 2 and now >= (self._next_dump_at or self._progress_at + limit):
            # This thread holds the GIL here: the other threads' frames are stable while it reads.
            self._disarm()
            fh = self._open_file()
            faulthandler.dump_traceback(file=fh, all_threads=True)
            fh.flush()
            self._dumped(now, from_c_timer=False)
        if self._dumps_this_stall >= 2:
            self._disarm()
            return
        # Dead man's switch: faulthandler's C timer fires only if this thread cannot run again
        # until grace seconds after the next dump is due (or after a timeout from now, before
        # the first step is seen: steps may have come and the GIL been taken since this check).
        due = (self._next_dump_at or self._progress_at + limit) if limit else now + self.timeout_s
        self._arm(max(0.0, due - now))

    def _first_step_limit(self, now: float) -> float:
        """The first-step timeout, or 0 for a process that never steps by design: a launcher
        (torchrun, a wrapper of the script) or a DataLoader worker (see ``dynprof.roles``).
        The role is asked only once the timeout is due."""
        if not self.first_step_timeout_s or self._exempt:
            return 0.0
        if now < self._progress_at + self.first_step_timeout_s:
            return self.first_step_timeout_s
        role = self.agent.role
        if role in (roles.LAUNCHER, roles.WORKER):
            self._exempt = role
            self.state = f"a {role}: the first step is not watched"
            log.info("this process is a %s: the hang watchdog does not wait for its first step", role)
            return 0.0
        return self.first_step_timeout_s

    def _dumped(self, now: float, from_c_timer: bool) -> None:
        self._dumps_this_stall += 1
        path = self._file_path
        self._close_file()
        if path is not None:
            self._register(path, self.agent.steps.step, from_c_timer)
        if self._dumps_this_stall == 1 and len(self.artifacts) < MAX_ARTIFACTS:
            self._next_dump_at = now + self.timeout_s * SECOND_DUMP_FACTOR
            self.state = "stalled; second dump armed"
        else:
            self._dumps_this_stall = 2
            self.state = "stalled; dumped"

    def _register(self, dump: Path, step: int, from_c_timer: bool = False) -> None:
        from collectors.stacks import HANG_KIND, ProcessStacks, parse_faulthandler, render_process

        if len(self.artifacts) >= MAX_ARTIFACTS:
            log.warning("hang dump %s not registered: %d artifacts already", dump, MAX_ARTIFACTS)
            return
        text = dump.read_text(errors="replace")
        names = {t.ident: (t.name, getattr(t, "native_id", None)) for t in threading.enumerate() if t.ident}
        stalled = time.time() - (self.agent.steps.last_progress_at or self._progress_at)
        ident = self.agent.identity
        stacks = ProcessStacks(
            pid=os.getpid(),
            method="faulthandler",
            rank=ident.rank,
            job=ident.job_id,
            host=ident.host,
            threads=parse_faulthandler(text, os.getpid(), names, threading.main_thread().ident),
            captured_at=time.time(),
            notes=[
                f"hang watchdog: no optimizer step for {stalled:.1f} s after step {step}"
                + (" (dumped by faulthandler's C timer: a thread held the GIL)" if from_c_timer else "")
            ],
        )
        main = stacks.main_thread()
        main_frames = main.frames if main is not None else []
        summary: dict[str, Any] = {
            "step": step,
            "stalled_for_s": round(stalled, 1),
            "timeout_s": self.timeout_s,
            "dump": self._dumps_this_stall,
            "main_thread": [f.where() for f in main_frames][:3],
        }
        writer = ArtifactStore().create(
            HANG_KIND, job=ident.job_id, host=ident.host, rank=ident.rank, options={"timeout_s": self.timeout_s}
        )
        writer.write_text("hang.txt", text)
        writer.write_json("stacks.json", stacks.to_json())
        writer.write_text("stacks.txt", render_process(stacks) + "\n")
        art = writer.finish("complete", summary=summary)
        self.artifacts.append(str(art.path))
        with contextlib.suppress(OSError):
            dump.unlink()
        log.warning("no optimizer step for %.0f s (after step %d): stacks saved in %s", stalled, step, art.path)


def install(agent: Agent) -> HangWatchdog | None:
    timeout = _seconds(ENV_TIMEOUT)
    if not timeout:
        return None
    watchdog = HangWatchdog(agent, timeout, _seconds(ENV_FIRST_STEP))
    watchdog.start()
    agent.exit_callbacks.append(watchdog.stop)
    return watchdog
