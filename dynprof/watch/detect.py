"""The watch's decisions, as pure functions of what it read: is the job stalled, and when it
is, what each rank is doing and what that makes of the job (a hang, with its culprits, or busy).

Nothing here reads a process or a node: :mod:`dynprof.watch.look` gathers the progress rows
(:class:`~dynprof.watch.model.RankProgress`) and two samples of every rank's stacks (merged by
:func:`collectors.stacks.merge`), and hands them here. The rules live in four modules, each
pure: the stall (:mod:`dynprof.watch.stall`), where a main thread is
(:mod:`dynprof.watch.frames`), one rank's state (:mod:`dynprof.watch.classify`) and, here, the
job's decision (:func:`decide`) with the flight recorder's reading.

**Stall.** No rank advanced for ``stall_after`` seconds (default: the larger of 60 s and 20x
the job's median step time). A rank's age is the time since its last step; before its first
step (compiling, warming up a dataloader, joining the process group) it is the time since its
process started. The job's age is the smallest rank age: one rank that stepped recently is
enough to say the job moves. A rank whose agent does not answer is put at the last step the
watch heard of (the engine keeps it); when none was ever heard its step and age are None in
the verdict, never 0 and never its process's age.

**The look.** Each rank is put in one state from its two samples and its progress rows:

=========== ==========================================================================
stopped     the process is stopped (SIGSTOP, a debugger): it cannot run at all
waiting     inside communication code in both samples, the same collective and stack, and no
            CPU spent meanwhile: in torch.distributed's communication API in Python, or
            natively in a communication library (NCCL, RCCL, gloo, MPI, UCC, by shared
            object) or torch's c10d/gloo code (by namespace), whatever the call's name (a wait
            that spins the CPU, MPI's progress loop, counts when a native frame is inside it)
waiting-gpu its main thread is inside a GPU library (the driver, the runtime, torch's CUDA
            parts, NCCL, cuBLAS, cuDNN: decided by the native frame's library, never by its
            symbol, which a stripped library names by the nearest export) in both samples,
            with the same Python frames and no step made: a call that did not return across
            the look; and its GPU's side agrees (work queued and unfinished, or the device
            busy) or was not read. Whatever CPU its spin costs, it waits for its GPU, it does
            not move. The call's family (a copy, a synchronize, a launch behind a full queue,
            or "a call into the CUDA driver" where no symbol says) only words the verdict
in-gpu-library the same, but its GPU's side disagrees (the device idle, its work done): the
            call waits on the host (a lock in the library, a peer process), and says both
in-c        its agent does not answer, it is in C code holding the GIL (py-spy says
            so, or the innermost frames are native), and it does not move
moving      its Python stack changed between the samples, it spent CPU, or it read or wrote
            (1 MiB or more, or it was in disk I/O, state D: a checkpoint on a slow
            file system) -- its children's included (DataLoader workers) -- it works at
            something that is not a step
parked      the same Python frame in both samples and no CPU: it waits for something
unread      no stack could be read, and no CPU spent: nothing says what it does
=========== ==========================================================================

Every rule states what it measures; :func:`collective_of`, :func:`meets_only`,
:func:`flight_recorder_reading`, :func:`stall_after_for` and the busy text (what was measured of
each group) say each one's reason and evidence, and docs/watch.md ("How the watch decides")
lists them.

**The decision.** Ranks wait in a collective while others do not: a **hang**, whose culprits
are the ranks that do not wait (a rank that waits for its GPU is one: it is held by its
device, not by its peers). Every rank waits for its GPU: a hang on the devices (a GPU kernel
or a collective inside NCCL), called once confirmed like a hang whose culprits move. Every rank waits and none moves: a **hang**; the culprits are
the ranks the flight recorder says never enqueued the collective the others wait in, else the
ranks whose wait differs from the largest group's (another collective, another call site).
Where the waits are in different places, the evidence of their positions comes first, never a
rank's number: the ranks in a barrier (any provider's: it carries no data, it only meets the
others) while the others wait in a collective that carries data (they left the loop the others
are in); with as many ranks in one wait as in another, the ranks with
fewer steps (they are behind), and with neither evidence the verdict says every position and
names no rank.
No rank waits and some rank moves: **busy** ("no step for 94 s: all ranks in save_checkpoint
(train.py:210), moving (CPU +1.2-1.5 s in 3.0 s, I/O +8.0 MB)": what was measured of each group),
never a hang. A rank stopped or stuck in C holding the GIL is a
culprit of a **hang** wherever the others are. When the only culprits are ranks that move (a
rank that spins, or saves a checkpoint alone while the others wait), the hang is called only
once the waiting ranks have been seen waiting in the same place for ``confirm_s`` (the engine
keeps that time across looks): a rank that saves alone for a few seconds while others wait at
a barrier is not a hang. So is a hang where no rank waits in a collective and none moves: one
look without CPU is also what a node starved of CPU shows, so the same ranks must still be in
the same places ``confirm_s`` later.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from collectors.stacks import Frame, is_library_path, rank_runs
from dynprof.watch.classify import MOVING_CPU_S, RankLook, RankState, classify
from dynprof.watch.frames import where
from dynprof.watch.model import MAX_CULPRITS, Culprit
from dynprof.watch.stall import Stall


# -- the job -------------------------------------------------------------------------------------------
@dataclass
class Decision:
    kind: str  # "hang", "busy", or "pending" (a hang whose culprits only move, not yet confirmed)
    conclusion: str
    culprits: list[Culprit] = field(default_factory=list)
    states: list[RankState] = field(default_factory=list)
    flight_recorder: str | None = None  # what the flight recorder said, when it was read
    waiting_key: tuple[Any, ...] | None = None  # what the waiting ranks wait in (for confirm_s)


def ranks_text(states: Sequence[RankState], of_total: int | None = None) -> str:
    """``rank 3 on node-1``, ``ranks 0-3 on node-1, ranks 4-7 on node-2``."""
    by_node: dict[str, list[int | None]] = {}
    for s in states:
        by_node.setdefault(s.node, []).append(s.rank)
    parts = []
    for node, ranks in by_node.items():
        known = sorted(r for r in ranks if r is not None)
        pids = [s.pid for s in states if s.node == node and s.rank is None]
        label = rank_runs(known)
        text = (f"rank {label}" if len(known) == 1 else f"ranks {label}") if known else ""
        if pids:
            text = (text + ", " if text else "") + "pid " + ",".join(str(p) for p in pids[:8])
        parts.append(f"{text} on {node}")
    if len(parts) > 4:
        return f"{len(states)} ranks on {len(parts)} nodes"
    return ", ".join(parts)


def _culprit(s: RankState, why: str) -> Culprit:
    return Culprit(rank=s.rank, host=s.node, pid=s.pid, where=s.where, why=why, since_step=s.step)


# What a culprit is doing, by its state, after "rank 37 on node-5 " (``tail``: where the others
# wait, when it is elsewhere); a state not here cannot be read.
_PHRASES: dict[str, Callable[[RankState, str], str]] = {
    "stopped": lambda s, tail: f"is stopped (SIGSTOP or a debugger) in {s.where}",
    "in-c": lambda s, tail: f"is stuck in C holding the GIL in {s.where}",
    "moving": lambda s, tail: f"is in {s.where}, {s.detail}{tail}",
    "parked": lambda s, tail: f"is in {s.where}, parked" + (" (no CPU)" if s.cpu_delta_s is not None else ""),
    "waiting": lambda s, tail: f"waits in {s.collective} at {s.where}",
    "waiting-gpu": lambda s, tail: f"waits for its GPU in {s.gpu_call}{tail}",
    "in-gpu-library": lambda s, tail: (
        f"is held in {s.gpu_call}{tail}, but its GPU has nothing to wait for ({s.gpu_evidence}): "
        "the call waits on the host, not on the device"
    ),
    "gone": lambda s, tail: "is gone (its process exited)",
}


def _phrase(s: RankState, others: str | None) -> str:
    """What a culprit is doing, after "rank 37 on node-5 ": "is in load_next_batch (...) ..."."""
    phrase = _PHRASES.get(s.state)
    if phrase is None:
        return f"cannot be read ({s.detail})"
    return phrase(s, f", not in the {others} the others wait in" if others else "")


def _groups(states: Sequence[RankState], key: Any) -> list[list[RankState]]:
    buckets: dict[Any, list[RankState]] = {}
    for s in states:
        buckets.setdefault(key(s), []).append(s)
    return sorted(buckets.values(), key=lambda g: (-len(g), min((s.rank or 0) for s in g)))


def _since(states: Sequence[RankState]) -> str:
    steps = sorted({s.step for s in states if s.step is not None})
    unknown = sum(1 for s in states if s.step is None)
    if not steps:
        its = "its" if len(states) == 1 else "their"
        return f" ({its} last step unknown: {its} agent has not answered this watch)"
    text = f" since step {steps[0]}" if len(steps) == 1 else f" since steps {steps[0]}-{steps[-1]}"
    return text + (f" ({unknown} with the last step unknown)" if unknown else "")


def _culprit_text(culprits: Sequence[RankState], others: str | None) -> str:
    parts = []
    for group in _groups(culprits, lambda s: (s.state, s.where)):
        verb = _phrase(group[0], others)
        if len(group) > 1:
            verb = verb.replace("is ", "are ", 1).replace("waits ", "wait ", 1).replace(" its GPU ", " their GPUs ", 1)
        parts.append(f"{ranks_text(group)} {verb}{_since(group)}")
    return "; ".join(parts)


@dataclass(frozen=True, slots=True)
class FlightRecorderReading:
    """What the flight recorder says of the collective a job hangs in: the ranks it holds
    responsible (rank -> why, in words) and its line for the verdict."""

    culprits: dict[int, str] = field(default_factory=dict)
    text: str | None = None


def _ranks_in(value: Any) -> list[int]:
    return [r for r in value or [] if isinstance(r, int) and not isinstance(r, bool)] if isinstance(value, list) else []


def flight_recorder_reading(analysis: dict[str, Any] | None, waiting: Sequence[int] = ()) -> FlightRecorderReading:
    """The ranks that hold a collective, from the flight recorder's analysis
    (:func:`collectors.flight_recorder.analyze`). A collective completes only once every rank of
    its process group has enqueued it, and the recorder numbers each group's collectives in the
    order every rank enqueues them; so, in a group where some ranks wait in collective #N:

    - a rank whose last enqueued number is below N never enqueued it (``missing``): it holds them;
    - a rank whose entry #N is another collective or other sizes (``mismatched``) enqueued a
      different one: the ranks disagree on what #N is, and it is the odd one;
    - a member with no dump said nothing (``no_dump``): named only when nothing else is, as the
      rank the recorder could not read, never as one that did not enqueue.

    Of several groups that hang, the one read is the one whose waiting ranks are most of
    ``waiting`` (the ranks the stacks show waiting): the hang the watch sees; the first listed
    when nothing tells them apart. Bounded: sizes and texts from the analysis are cut."""
    if not isinstance(analysis, dict):
        return FlightRecorderReading()
    listed = analysis.get("process_groups")
    listed = listed[:1024] if isinstance(listed, list) else []
    groups = [pg for pg in listed if isinstance(pg, dict) and pg.get("hung")]
    if not groups:
        return FlightRecorderReading()
    seen = set(waiting)
    pg = max(groups, key=lambda g: len(seen.intersection(_ranks_in(g.get("waiting")))))  # max keeps the first of ties
    collective = str(pg.get("collective") or "?")[:200]
    missing = sorted(set(_ranks_in(pg.get("missing"))))
    mismatched: dict[int, str] = {}
    for m in (pg.get("mismatched") or [])[:1024] if isinstance(pg.get("mismatched"), list) else []:
        if isinstance(m, dict) and isinstance(m.get("rank"), int) and not isinstance(m.get("rank"), bool):
            mismatched[m["rank"]] = str(m.get("collective") or "?")[:200]
    no_dump = sorted(set(_ranks_in(pg.get("no_dump"))) - set(missing) - set(mismatched))
    culprits: dict[int, str] = {}
    parts: list[str] = []
    if missing:
        who = ",".join(str(r) for r in missing)
        parts.append(f"missing rank{'s' if len(missing) > 1 else ''} {who} in {collective}")
        culprits.update((r, "never enqueued the collective the others wait in (flight recorder)") for r in missing)
    for r, theirs in sorted(mismatched.items()):
        parts.append(f"rank {r} enqueued {theirs} where the others wait in {collective}")
        culprits[r] = f"enqueued {theirs} where the others enqueued {collective} (flight recorder)"
    if no_dump and not culprits:
        who = ",".join(str(r) for r in no_dump)
        parts.append(f"no dump from rank{'s' if len(no_dump) > 1 else ''} {who} while the others wait in {collective}")
        culprits.update(
            (r, "gave the flight recorder no dump while the others wait (flight recorder)") for r in no_dump
        )
    if not parts:
        return FlightRecorderReading(text=f"flight recorder: {str(pg.get('verdict') or '')[:300]}")
    return FlightRecorderReading(culprits, "flight recorder: " + "; ".join(parts))


def _hang_or_pending(
    text: str,
    pending_text: str,
    pending: bool,
    culprits: list[Culprit],
    states: list[RankState],
    fr_text: str | None,
    waiting: list[RankState],
) -> Decision:
    """A hang called with ``text``, or, while ``pending`` (not confirmed yet), a pending one
    said with ``pending_text``; either way keyed by what ``waiting`` wait in."""
    kind, conclusion = ("pending", pending_text) if pending else ("hang", text)
    return Decision(kind, conclusion, culprits[:MAX_CULPRITS], states, fr_text, _waiting_key(waiting))


def decide(
    looks: Sequence[RankLook],
    stall: Stall,
    flight_recorder: dict[str, Any] | None = None,
    waiting_for_s: float | None = None,
    confirm_s: float = 0.0,
    moving_cpu_s: float = MOVING_CPU_S,
) -> Decision:
    """What a stalled job is doing, from the look at every rank. ``waiting_for_s``: how long
    the waiting ranks have been seen waiting in the same place (the engine's count, across
    looks); a hang whose only culprits move is called once that reaches ``confirm_s``."""
    states = [classify(look, moving_cpu_s) for look in looks]
    states.sort(key=lambda s: (s.rank if s.rank is not None else 1 << 30, s.node, s.pid))
    age = f"{stall.age_s:.0f} s" if stall.age_s is not None else "a while"
    head = f"no first step {age} after start" if stall.first_step else f"no step for {age}"
    waiting = [s for s in states if s.state == "waiting"]
    others = [s for s in states if s.state != "waiting"]
    fr = flight_recorder_reading(flight_recorder, [s.rank for s in waiting if s.rank is not None])
    fr_missing, fr_text = sorted(fr.culprits), fr.text
    fr_clause = f" ({fr_text})" if fr_text else ""
    if not states:
        return Decision("busy", f"{head}: no rank could be read", states=states)
    if waiting and others:
        # Ranks wait for their peers while others do not come: those others hold them, wherever
        # they are (a rank held by its GPU, a parked or stopped one, one that works elsewhere).
        main = _groups(waiting, lambda s: s.collective)[0]
        collective = main[0].collective
        main_where = _groups(main, lambda s: s.where)[0][0].where
        # A culprit that works (spends CPU, does I/O, its stack changes) may yet reach the
        # collective: a hang held only by such ranks is called once confirmed. Any other culprit
        # does not move: nothing it does brings it to the others.
        stuck = [s for s in others if s.state != "moving"]
        text = (
            _culprit_text(others, collective)
            + f"; {_the_others(len(waiting))} in {collective} "
            + f"at {main_where}{fr_clause}"
        )
        return _hang_or_pending(
            text,
            f"{head}: {text}; not called a hang yet (the waiting ranks wait for "
            f"{waiting_for_s or 0:.0f} s of the {confirm_s:.0f} s asked)",
            not stuck and (waiting_for_s is None or waiting_for_s < confirm_s),
            [_culprit(s, s.detail or s.state) for s in others],
            states,
            fr_text,
            waiting,
        )
    if waiting and not others:
        groups = _groups(waiting, lambda s: (s.collective, s.stack_key))
        main = groups[0]
        if fr_missing:
            by_rank = {s.rank: s for s in states}
            named = [by_rank[r] for r in fr_missing if r in by_rank]
            rest = [s for s in states if s.rank not in set(fr_missing)]
            text = (
                f"{_culprit_text(named, None) if named else 'ranks ' + ','.join(map(str, fr_missing))}"
                f"; {_the_others(len(rest))} in {main[0].collective} at {main[0].where}{fr_clause}"
            )
            culprits = [_culprit(s, fr.culprits[s.rank]) for s in named if s.rank is not None] or [
                Culprit(rank=r, host="?", where="?", why=fr.culprits[r]) for r in fr_missing
            ]
            return Decision("hang", text, culprits[:MAX_CULPRITS], states, fr_text, _waiting_key(waiting))
        if len(groups) > 1:
            behind = _behind(groups, tied=len(groups[1]) == len(main))
            if behind is not None:
                held, why = behind
                rest = [s for s in waiting if s not in held]
                text = f"{_culprit_text(held, None)}: {why}; {_the_others(len(rest))} {_positions(rest)}{fr_clause}"
                culprits = [_culprit(s, f"waits in {s.collective} at {s.where}: {why}") for s in held]
                return Decision("hang", text, culprits[:MAX_CULPRITS], states, fr_text, _waiting_key(waiting))
            if len(groups[1]) == len(main):
                # As many ranks in one wait as in another, and nothing says which is behind:
                # the positions are said, no rank is named (its number is no evidence).
                text = (
                    f"the ranks wait in {len(groups)} different places and the watch cannot tell which holds "
                    f"the others (the same steps, no rank left the loop alone): {_culprit_text(waiting, None)}"
                    f"{fr_clause}"
                    + (
                        ""
                        if fr_text
                        else "; with the flight recorder on (`dynprof run --flight-recorder`) the watch would "
                        "name the rank that is missing"
                    )
                )
                return Decision("hang", text, [], states, fr_text, _waiting_key(waiting))
            # A majority in one wait is where the program's ranks are: the ranks elsewhere diverged
            # (another collective, another call site) and hold them.
            odd = [s for g in groups[1:] for s in g]
            text = (
                f"{_culprit_text(odd, None)}; {_the_others(len(main))} "
                f"in {main[0].collective} at {main[0].where}{fr_clause}"
            )
            culprits = [_culprit(s, f"waits in {s.collective} at {s.where}, not where the others wait") for s in odd]
            return Decision("hang", text, culprits[:MAX_CULPRITS], states, fr_text, _waiting_key(waiting))
        text = f"all {len(states)} ranks wait in {main[0].collective} at {main[0].where} and none moves{fr_clause}" + (
            ""
            if fr_text
            else "; with the flight recorder on (`dynprof run --flight-recorder`) "
            "the watch would name the rank that is missing"
        )
        return Decision("hang", text, [], states, fr_text, _waiting_key(waiting))
    # No rank waits in a collective.
    on_gpu = [s for s in states if s.state == "waiting-gpu"]
    if on_gpu and len(on_gpu) == len(states):
        text = (
            f"{head}: every rank waits for its GPU: {_culprit_text(on_gpu, None)}; the hang is on the devices "
            "(a GPU kernel that does not end, or a collective inside NCCL)"
            + (
                fr_clause
                if fr_text
                else "; with the flight recorder on (`dynprof run --flight-recorder`) the watch would say "
                "which NCCL collective each rank is in"
            )
        )
        return _hang_or_pending(
            text,
            f"{text}; not called a hang yet (seen for {waiting_for_s or 0:.0f} s of the {confirm_s:.0f} s asked)",
            waiting_for_s is None or waiting_for_s < confirm_s,
            [_culprit(s, s.detail) for s in on_gpu],
            states,
            fr_text,
            on_gpu,
        )
    stuck = [s for s in states if s.state in ("stopped", "in-c")]
    if stuck:
        rest = [s for s in states if s.state not in ("stopped", "in-c")]
        text = _culprit_text(stuck, None)
        if rest:
            text += "; " + _busy_text(rest)
        return Decision("hang", text, [_culprit(s, s.detail) for s in stuck][:MAX_CULPRITS], states, fr_text)
    moving = [s for s in states if s.state == "moving"]
    if moving:
        return Decision("busy", f"{head}: {_busy_text(states)}", [], states, fr_text)
    text = f"{head}, and no rank moves: {_culprit_text(states, None)}{fr_clause}"
    culprits = [_culprit(s, s.detail or s.state) for s in states][:MAX_CULPRITS]
    if waiting_for_s is None or waiting_for_s < confirm_s:
        # One look of a few seconds in which no rank spent CPU is also what a CPU-starved node
        # shows (a busy phase's DataLoader workers behind another job's processes): the same
        # ranks, still where they were, once ``confirm_s`` has passed, are a hang.
        return Decision(
            "pending",
            f"{text}; not called a hang yet (seen for {waiting_for_s or 0:.0f} s of the {confirm_s:.0f} s asked)",
            culprits,
            states,
            fr_text,
            waiting_key=_waiting_key(states),
        )
    return Decision("hang", text, culprits, states, fr_text, _waiting_key(states))


def meets_only(collective: str | None) -> bool:
    """Whether a collective only meets the other ranks and carries no data: a barrier, whoever
    provides it (torch.distributed's ``barrier`` and ``monitored_barrier``, the store's
    ``_store_based_barrier``, ``MPI_Barrier``, a backend's own ``c10d::...::barrier``). A rank
    waits in one once the work before it is done, which a collective that carries data (the
    gradients' all_reduce) does not say."""
    return collective is not None and "barrier" in collective.lower()


def _behind(groups: Sequence[Sequence[RankState]], tied: bool) -> tuple[list[RankState], str] | None:
    """The ranks that hold the others when every rank waits, but in different places, from the
    evidence of their positions (never their numbers):

    - the ranks in a barrier (:func:`meets_only`) while every other rank waits in a collective that
      carries data: they finished the work the others are still in (the loop), and the others'
      collective waits for them to come back to it;
    - else, where as many ranks wait in one place as in another (``tied``: no majority says where
      the program's ranks are), the ranks with the fewest steps, every rank's count known: the
      others made more, so they are behind.

    None when nothing tells them apart."""
    everyone = [s for g in groups for s in g]
    at_end = [s for s in everyone if meets_only(s.collective)]
    inside = [s for s in everyone if not meets_only(s.collective)]
    if at_end and inside:
        who = "it" if len(at_end) == 1 else "they"
        return at_end, f"{who} left the loop the others are in (a {at_end[0].collective} after it)"
    counted = [s.step for s in everyone if s.step is not None]
    steps = sorted(set(counted))
    if tied and len(steps) > 1 and len(counted) == len(everyone):  # every rank's count known
        low = [s for s in everyone if s.step == steps[0]]
        ahead = sorted({s.step for s in everyone if s.step is not None and s.step != steps[0]})
        more = f"{ahead[0]}" if len(ahead) == 1 else f"{ahead[0]}-{ahead[-1]}"
        who = "it is" if len(low) == 1 else "they are"
        return low, f"{who} behind: {steps[0]} steps where the others made {more}"
    return None


def _positions(states: Sequence[RankState]) -> str:
    """``in all_reduce at train_step (train.py:40)``, each distinct wait once."""
    seen: list[str] = []
    for s in states:
        place = f"in {s.collective} at {s.where}"
        if place not in seen:
            seen.append(place)
    return " and ".join(seen[:4]) + (f" and {len(seen) - 4} more places" if len(seen) > 4 else "")


def _the_others(n: int) -> str:
    """``the other rank waits``, ``the other 3 ranks wait``."""
    return "the other rank waits" if n == 1 else f"the other {n} ranks wait"


def _waiting_key(waiting: Sequence[RankState]) -> tuple[Any, ...]:
    return tuple(sorted((s.node, s.pid, s.collective or "", s.where) for s in waiting))


def _common_user_frame(states: Sequence[RankState]) -> str | None:
    """The innermost frame of the program's own code that every rank's stack passes through
    (``evaluate`` when the ranks are in different lines below it), or None."""
    chains = []
    for s in states:
        frames = [f for f in reversed(s.frames) if not f.native and not is_library_path(f.file)]
        if not frames:
            return None
        chains.append(frames)
    common: Frame | None = None
    for level in zip(*chains):
        if len({(f.function, f.file) for f in level}) != 1:
            break
        common = level[0]
    return where(common) if common is not None else None


def _moving_evidence(group: Sequence[RankState]) -> str:
    """What a group of moving ranks was measured doing across the look, each fact once, with how
    many of the group showed it where not all did: ``CPU +1.2-1.5 s in 3.0 s``, ``I/O +8.0 MB``,
    ``in disk I/O (process state D)``, ``stack changed``."""
    n = len(group)

    def of(ranks: Sequence[RankState], fact: str) -> str:
        return fact if len(ranks) == n else f"{len(ranks)} of {n}: {fact}"

    def spread(values: Sequence[float], unit: str, fmt: str = ".1f") -> str:
        lo, hi = min(values), max(values)
        return f"+{lo:{fmt}}{unit}" if f"{lo:{fmt}}" == f"{hi:{fmt}}" else f"+{lo:{fmt}}-{hi:{fmt}}{unit}"

    parts = []
    cpu = [s for s in group if "cpu" in s.moved_by and s.cpu_delta_s is not None]
    if cpu:
        span = max(s.span_s for s in cpu)
        parts.append(of(cpu, f"CPU {spread([s.cpu_delta_s or 0.0 for s in cpu], ' s')} in {span:.1f} s"))
    io = [s for s in group if "io" in s.moved_by and s.io_delta_b is not None]
    if io:
        parts.append(of(io, f"I/O {spread([(s.io_delta_b or 0) / 1e6 for s in io], ' MB')}"))
    disk = [s for s in group if "disk" in s.moved_by]
    if disk:
        parts.append(of(disk, "in disk I/O (process state D)"))
    changed = [s for s in group if "stack" in s.moved_by]
    if changed:
        parts.append(of(changed, "stack changed"))
    return ", ".join(parts)


def _busy_text(states: Sequence[RankState]) -> str:
    """Where the ranks of a job that works at something other than steps are, and what was
    measured of each (busy: no rank waits for a peer and some rank moves)."""
    if len(states) > 1 and all(s.state == "moving" for s in states):
        shared = _common_user_frame(states)
        outer = {s.where for s in states}
        if shared is not None and len(outer) > 1 and not shared.startswith("<module>"):
            return f"all ranks in {shared}, moving ({_moving_evidence(states)})"
    parts = []
    groups = _groups(states, lambda s: (s.state, s.where))
    for group in groups:
        who = "all ranks" if len(group) == len(states) and len(states) > 1 else ranks_text(group)
        state = group[0].state
        what = f"moving ({_moving_evidence(group)})" if state == "moving" else group[0].describe()
        parts.append(f"{who} in {group[0].where}, {what}")
    return "; ".join(parts)
