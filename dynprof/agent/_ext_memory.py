"""Agent extension: CUDA OOM capture, memory snapshots and history on demand, host-memory watch.

**When CUDA starts.** The agent never initialises CUDA, and attaching PyTorch's OOM observer
does (``_cuda_attach_out_of_memory_observer`` calls ``lazyInitDevice``). So the observer is
attached, and the history policy applied, from a callback queued with ``torch.cuda._lazy_call``:
PyTorch runs it inside its own lazy CUDA initialisation, on the thread that first uses CUDA,
right after the driver and the caching allocator are up. The callback is queued when the job
imports ``torch.cuda`` (a post-import hook, like the step hook's), so a process that never
touches CUDA pays nothing at all, and a CUDA process pays once, at initialisation, rather
than anything per step. If CUDA is already up when the agent loads, the callback runs at once.

**At OOM.** The allocator calls the observer on the thread whose allocation failed, after
releasing its lock and before raising ``OutOfMemoryError``. The observer takes the snapshot
(host memory only), writes the artifact and returns; everything is caught, and at most one
capture per ``DYNPROF_MEMORY_OOM_INTERVAL_S`` and ``DYNPROF_MEMORY_OOM_MAX`` per process
happen, since OOMs repeat in retry loops.

**What it loads.** Of the ``memory`` kind's package, only :mod:`collectors.memory.capture` and
:mod:`collectors.memory.policy`, with this module (and :mod:`collectors.memory.plan.capture`
when a memory plan is asked for, see dynprof/agent/_mem_plan.py); the summary and advice modules that the
artifact's ``summary.json`` needs are imported by the first capture, and the snapshot
unpickler and the renderers never enter the job.

**Host memory.** A daemon thread wakes every ``DYNPROF_HOST_MEMORY_INTERVAL_S`` seconds,
reads /proc/self/statm (and the cgroup's memory.stat), and captures once usage passes
``DYNPROF_HOST_MEMORY_FRACTION`` of the limit. Only the search for the largest CPU tensors runs
on the training thread (a pending call, at most once a capture): the watcher never reads the
job's tensors itself.

Environment (set by ``dynprof run`` options, see dynprof/cli/_run_memory.py):
``DYNPROF_MEMORY_HISTORY`` (off | N | all-stacks[:N] | state), ``DYNPROF_MEMORY_OOM_INTERVAL_S``,
``DYNPROF_MEMORY_OOM_MAX``, ``DYNPROF_HOST_MEMORY_FRACTION`` (0 < f <= 1, or off),
``DYNPROF_HOST_MEMORY_INTERVAL_S``, ``DYNPROF_HOST_MEMORY_LIMIT`` (bytes, K/M/G suffixes),
``DYNPROF_CHECKPOINT`` (a budget, ``auto``: the memory plan applied, dynprof/agent/_mem_apply.py).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from collectors.memory import capture
from collectors.memory.policy import (
    DEFAULT_MAX_ENTRIES,
    DEFAULT_POLICY,
    OFF,
    STACKS,
    HistoryPolicy,
    PolicyError,
    apply,
    parse_policy,
)
from dynprof import _settings
from dynprof.agent._mainthread import call_soon_in_main_thread
from dynprof.agent._mem_apply import install as install_checkpoint
from dynprof.agent._mem_plan import MemoryPlanner
from dynprof.agent._post_import import PostImportFinder
from dynprof.agent._server import CommandError
from dynprof.proto import pb
from dynprof.store import ArtifactStore
from dynprof.units import parse_size

if TYPE_CHECKING:
    from dynprof.agent._agent import Agent

log = logging.getLogger("dynprof.agent")

CUDA_MODULE = "torch.cuda"


@dataclass
class MemoryOptions:
    history: HistoryPolicy = DEFAULT_POLICY
    oom_interval_s: float = 60.0
    oom_max: int = 3
    host_fraction: float = 0.9  # 0: the watcher is off
    host_interval_s: float = 1.0
    host_limit_bytes: int | None = None
    host_max: int = 2

    @classmethod
    def from_env(cls, env: Any = None) -> MemoryOptions:
        env = _settings.environ() if env is None else env
        opts = cls()
        problems = []

        def num(name: str, kind: Any, current: Any, minimum: float) -> Any:
            raw = env.get(name, "").strip()
            if not raw:
                return current
            try:
                value = kind(raw)
                if value < minimum:
                    raise ValueError
                return value
            except ValueError:
                problems.append(f"{name}={raw!r} is not a number >= {minimum}; using {current}")
                return current

        try:
            opts.history = parse_policy(env.get("DYNPROF_MEMORY_HISTORY"))
        except PolicyError as exc:
            problems.append(f"DYNPROF_MEMORY_HISTORY: {exc}; using {opts.history.describe()}")
        opts.oom_interval_s = num("DYNPROF_MEMORY_OOM_INTERVAL_S", float, opts.oom_interval_s, 0)
        opts.oom_max = num("DYNPROF_MEMORY_OOM_MAX", int, opts.oom_max, 0)
        raw_fraction = env.get("DYNPROF_HOST_MEMORY_FRACTION", "").strip().lower()
        if raw_fraction in ("off", "0", "none", "false", "no"):
            opts.host_fraction = 0.0
        elif raw_fraction:
            try:
                value = float(raw_fraction)
                if not 0 < value <= 1:
                    raise ValueError
                opts.host_fraction = value
            except ValueError:
                problems.append(
                    f"DYNPROF_HOST_MEMORY_FRACTION={raw_fraction!r} is not in (0, 1]; using {opts.host_fraction}"
                )
        opts.host_interval_s = num("DYNPROF_HOST_MEMORY_INTERVAL_S", float, opts.host_interval_s, 0.01)
        opts.host_max = num("DYNPROF_HOST_MEMORY_MAX", int, opts.host_max, 0)
        raw_limit = env.get("DYNPROF_HOST_MEMORY_LIMIT", "").strip()
        if raw_limit:
            try:
                opts.host_limit_bytes = parse_size(raw_limit) or None
            except Exception:
                problems.append(f"DYNPROF_HOST_MEMORY_LIMIT={raw_limit!r} is not a size; using the cgroup's")
        for p in problems:
            log.warning("memory options: %s", p)
        return opts


class MemoryController:
    def __init__(self, agent: Agent, options: MemoryOptions | None = None) -> None:
        self.agent = agent
        self.options = options or MemoryOptions.from_env()
        self.policy: HistoryPolicy = OFF  # what is recording now
        self.cuda_ready = False
        self.observer_attached = False
        self.oom_captures = 0
        self.oom_skipped = 0
        self.last_oom_capture = 0.0  # monotonic
        self.last_artifact = ""
        self._capture_lock = threading.Lock()
        self._in_oom = threading.local()
        self._finder: PostImportFinder | None = None
        self._host: HostMemoryWatcher | None = None
        # An observer cannot be detached from torch: once the agent stops, its callbacks return
        # at once (a restarted agent's new controller takes over).
        self._closed = False
        self.auto: Any = None  # the `auto` policy's controller, while it runs
        agent.memory_history_policy = "off"  # type: ignore[attr-defined]
        agent.memory_history_detail = ""  # type: ignore[attr-defined]

    # -- life cycle ------------------------------------------------------------------------------
    def install(self) -> None:
        self.agent.handlers["memory_snapshot"] = self.handle_snapshot
        self.agent.handlers["memory_history"] = self.handle_history
        self.planner = MemoryPlanner(self.agent)
        self.agent.handlers["memory_plan"] = self.planner.handle
        # only a job started with `dynprof run --checkpoint` (DYNPROF_CHECKPOINT) is ever changed
        self.checkpoint = install_checkpoint(self.agent, _settings.environ())
        self.agent.exit_callbacks.append(self.at_exit)
        self._hook_cuda_init()
        if self.options.host_fraction > 0:
            self._host = HostMemoryWatcher(self)
            self._host.start()

    def at_exit(self) -> None:
        self._closed = True
        self._stop_auto()
        planner = getattr(self, "planner", None)
        if planner is not None:
            planner.at_exit()
        checkpoint = getattr(self, "checkpoint", None)
        if checkpoint is not None:
            checkpoint.at_exit()
        if self._host is not None:
            self._host.stop()
        if self._finder is not None:
            self._finder.step_aside()
            self._finder = None

    def _hook_cuda_init(self) -> None:
        module = sys.modules.get(CUDA_MODULE)
        if module is not None and hasattr(module, "_lazy_call"):
            self._queue_on(module)
            return
        if module is not None:
            # torch.cuda is being imported right now on another thread; its lazy-call queue
            # is not there yet. Check again once that import is done.
            threading.Thread(target=self._wait_for_cuda_module, name="dynprof-memory-init", daemon=True).start()
            return
        self._finder = PostImportFinder(CUDA_MODULE, self._queue_on)
        sys.meta_path.insert(0, self._finder)

    def _wait_for_cuda_module(self) -> None:
        for _ in range(600):
            module = sys.modules.get(CUDA_MODULE)
            if (
                module is not None
                and hasattr(module, "_lazy_call")
                and "torch" in sys.modules
                and hasattr(sys.modules["torch"], "cuda")
            ):
                self._queue_on(module)
                return
            time.sleep(0.1)
        log.warning("torch.cuda did not finish importing within 60 s; CUDA OOM capture is off in this process")

    def _queue_on(self, cuda_module: Any) -> None:
        try:
            cuda_module._lazy_call(self._on_cuda_init)
        except Exception:
            log.exception("could not queue the CUDA start-up callback; CUDA OOM capture is off")

    def _on_cuda_init(self) -> None:
        # Runs inside torch.cuda._lazy_init on the job's thread: it must never raise (PyTorch
        # would turn that into a failed CUDA initialisation of the job) and must stay short.
        try:
            if self.cuda_ready or self._closed or os.getpid() != self.agent.pid:
                return
            self.cuda_ready = True
            import torch

            attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
            if attach is None:
                log.warning("torch %s has no CUDA OOM observer; OOM capture is off", torch.__version__)
            else:
                attach(self._on_oom)
                self.observer_attached = True
            if self.options.history.mode == "auto":
                self._start_auto(self.options.history)
            elif self.options.history.enabled:
                self._set_policy(self.options.history, clear=False)
            log.info(
                "CUDA in use: OOM observer %s, memory history %s",
                "attached" if self.observer_attached else "unavailable",
                self.policy.describe(),
            )
        except BaseException:
            log.exception("setting up CUDA memory capture failed; the job continues without it")

    def _set_policy(self, policy: HistoryPolicy, clear: bool) -> None:
        self._stop_auto()
        apply(policy, clear=clear)
        self.policy = policy
        self.agent.memory_history_policy = policy.describe()  # type: ignore[attr-defined]
        self.agent.memory_history_detail = ""  # type: ignore[attr-defined]

    def _start_auto(self, policy: HistoryPolicy) -> None:
        from dynprof.agent._mem_auto import AutoHistory

        def step_time() -> float | None:
            return getattr(self.agent.steps, "step_time_s", None) or None

        def on_plan(plan: Any) -> None:
            self.agent.memory_history_detail = plan.reason()  # type: ignore[attr-defined]

        self.auto = AutoHistory(
            policy.budget,
            step_time=step_time,
            on_plan=on_plan,
            max_entries=policy.max_entries,
            trainer_thread=lambda: self.agent.steps.hook_thread_id,
        )
        self.policy = policy
        self.agent.memory_history_policy = policy.describe()  # type: ignore[attr-defined]
        self.agent.memory_history_detail = "measuring the allocator's event rate"  # type: ignore[attr-defined]
        self.auto.start()

    def _stop_auto(self) -> None:
        auto, self.auto = self.auto, None
        if auto is not None:
            auto.stop()

    # -- OOM -------------------------------------------------------------------------------------
    def _on_oom(self, device: int, alloc: int, device_limit: int, device_free: int) -> None:
        # Called by the CUDA caching allocator; an exception here would propagate into the
        # allocator, so nothing escapes.
        try:
            if self._closed or getattr(self._in_oom, "active", False) or os.getpid() != self.agent.pid:
                return
            now = time.monotonic()
            o = self.options
            if self.oom_captures >= o.oom_max or (
                self.last_oom_capture and now - self.last_oom_capture < o.oom_interval_s
            ):
                self.oom_skipped += 1
                log.info(
                    "CUDA OOM on cuda:%d (%d bytes): not captured (%d captured, limit %d per process, one per %g s)",
                    device,
                    alloc,
                    self.oom_captures,
                    o.oom_max,
                    o.oom_interval_s,
                )
                return
            if not self._capture_lock.acquire(blocking=False):
                self.oom_skipped += 1
                return
            self._in_oom.active = True
            try:
                self.oom_captures += 1
                self.last_oom_capture = now
                stack = capture.thread_stack(sys._getframe(1))
                attribution = self._attribution(sys._getframe(1))
                auto = self.auto
                held = auto.hold.acquire(timeout=0.5) if auto is not None else False
                try:
                    art = self._capture(
                        "oom",
                        stack,
                        oom={
                            "device": int(device),
                            "requested_bytes": int(alloc),
                            "device_limit_bytes": int(device_limit),
                            "device_free_bytes": int(device_free),
                        },
                        attribution=attribution,
                    )
                finally:
                    if held:
                        auto.hold.release()
                took = (art.manifest.get("summary") or {}).get("capture_s")
                sys.stderr.write(
                    f"dynprof: CUDA out of memory on cuda:{device}: memory snapshot written to {art.path} in {took} s\n"
                )
            finally:
                self._in_oom.active = False
                self._capture_lock.release()
        except BaseException:
            try:
                log.exception("OOM capture failed")
            except BaseException:
                pass

    def _attribution(self, frame: Any) -> dict[str, Any] | None:
        """Parameters, gradients and optimizer state of the job's optimizers, and the tensors
        in ``frame``'s locals (and its callers'). Never raises."""
        try:
            refs = list(getattr(self.agent.steps, "optimizers", {}).values())
            optimizers = [o for o in (r() for r in refs) if o is not None]
            return capture.job_attribution(frame, optimizers)
        except Exception:
            log.exception("attributing memory to the job's objects failed")
            return None

    def _last_plan_measurement(self) -> dict[str, Any] | None:
        planner = getattr(self, "planner", None)
        return planner.last_measurement if planner is not None else None

    def _capture(
        self, trigger: str, stack: str, oom: dict[str, Any] | None = None, attribution: dict[str, Any] | None = None
    ) -> Any:
        ident = self.agent.identity
        art = capture.capture(
            ArtifactStore(),
            trigger=trigger,
            job=ident.job_id,
            host=ident.host,
            rank=ident.rank,
            history_policy=self.policy.describe(),
            oom=oom,
            stack=stack,
            attribution=attribution,
            plan_measurement=self._last_plan_measurement(),
            options={
                **({"oom_captures": self.oom_captures} if trigger == "oom" else {}),
                "memory_history_detail": getattr(self.agent, "memory_history_detail", "") or None,
            },
        )
        self.last_artifact = str(art.path)
        log.info("memory snapshot (%s) written to %s", trigger, art.path)
        return art

    # -- commands --------------------------------------------------------------------------------
    def _require_cuda(self) -> None:
        torch = sys.modules.get("torch")
        if torch is None:
            raise CommandError(
                pb.NO_TORCH,
                "this process has not imported torch",
                "Memory snapshots are of PyTorch's CUDA allocator; point dynprof at a training process.",
            )
        cuda = getattr(torch, "cuda", None)
        if cuda is None or not cuda.is_initialized():
            raise CommandError(
                pb.NO_CUDA,
                "this process has not used CUDA, so it has no CUDA memory to snapshot",
                "Target a process that trains on a GPU (its Status shows cuda_initialized). The "
                "agent never initialises CUDA itself, so it cannot snapshot before the job does.",
            )

    def handle_snapshot(self, _request: Any) -> tuple[str, Any]:
        self._require_cuda()
        if not self._capture_lock.acquire(blocking=False):
            raise CommandError(
                pb.BUSY, "a memory snapshot is being written in this process", "Wait a few seconds and ask again."
            )
        try:
            art = self._capture("on-demand", self._training_thread_stack(), attribution=self._attribution(None))
        finally:
            self._capture_lock.release()
        return "artifact", pb.ArtifactWritten(
            path=str(art.path),
            status=art.status,
            summary_json=json.dumps(art.manifest.get("summary") or {}, default=str),
        )

    def _training_thread_stack(self) -> str:
        """The stack of the training thread (the one that steps the optimizer, else the main
        thread): the server thread's own stack would say nothing."""
        frames = sys._current_frames()
        ident = self.agent.steps.hook_thread_id or threading.main_thread().ident
        frame = frames.get(ident) if ident is not None else None
        if frame is None:
            return "(the training thread's stack is not available)\n"
        name = next((t.name for t in threading.enumerate() if t.ident == ident), "?")
        return capture.thread_stack(frame, ident=ident, name=name)

    def handle_history(self, request: Any) -> tuple[str, Any]:
        self._require_cuda()
        if not request.enable:
            self._set_policy(OFF, clear=False)
            return "ack", pb.Ack(detail="off")
        stacks = request.stacks or "python"
        if stacks not in STACKS:
            raise CommandError(pb.INVALID_ARGUMENT, f"stacks must be one of {', '.join(STACKS)}, not {stacks!r}")
        entries = int(request.max_entries) or (
            self.options.history.max_entries if self.options.history.mode == "all" else DEFAULT_MAX_ENTRIES
        )
        if entries > 100_000_000:
            raise CommandError(pb.INVALID_ARGUMENT, f"{entries} history entries would take tens of GB of host memory")
        policy = HistoryPolicy("all", stacks, entries)
        self._set_policy(policy, clear=True)
        return "ack", pb.Ack(detail=policy.describe())


class HostMemoryWatcher:
    """A daemon thread that checks the process's memory against its limit a few times a second
    at most and captures a ``host-memory`` artifact above the configured fraction."""

    def __init__(self, controller: MemoryController) -> None:
        self.controller = controller
        self.options = controller.options
        self.captures = 0
        self.armed = True
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dynprof-host-memory", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        try:
            from collectors import host_memory

            cgroup = host_memory.find_cgroup()
            limit = host_memory.resolve_limit(self.options.host_limit_bytes, cgroup)
            if limit.bytes <= 0:
                log.warning("host-memory watch: no memory limit found; the watch is off")
                return
            log.info(
                "host-memory watch: limit %d bytes (%s), capture above %.0f %%",
                limit.bytes,
                limit.source,
                self.options.host_fraction * 100,
            )
            fraction = self.options.host_fraction
            agent = self.controller.agent
            while not self._stop.wait(self.options.host_interval_s):
                if os.getpid() != agent.pid or agent._stopped:
                    return
                usage = host_memory.read_usage(limit, cgroup)
                if usage.fraction < fraction:
                    if usage.fraction < fraction * 0.9:
                        self.armed = True  # re-arm once usage has come well down
                    continue
                if not self.armed or self.captures >= self.options.host_max:
                    continue
                self.armed = False
                self.captures += 1
                ident = agent.identity
                try:
                    art = host_memory.capture(
                        ArtifactStore(),
                        trigger="host-memory-pressure",
                        job=ident.job_id,
                        host=ident.host,
                        rank=ident.rank,
                        usage=usage,
                        fraction=fraction,
                        cgroup=cgroup,
                        # the job's tensors are read on its own thread, never this one
                        tensors_of=lambda: host_memory.tensors_on_training_thread(call_soon_in_main_thread),
                    )
                    sys.stderr.write(
                        f"dynprof: host memory at {usage.fraction * 100:.0f} % of the limit "
                        f"({limit.source}): state written to {art.path}\n"
                    )
                except Exception:
                    log.exception("host-memory capture failed")
        except BaseException:
            log.exception("the host-memory watch failed; it is off")


def install(agent: Agent) -> MemoryController:
    controller = MemoryController(agent)
    agent.memory = controller  # type: ignore[attr-defined]
    controller.install()
    return controller
