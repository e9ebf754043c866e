"""What one command keeps of all its nodes' answers together: an :class:`AnswerBudget` of bytes
and JSON values shared by the nodes (each sure of a floor, the rest a pool), a node's draw on it
(:class:`AnswerShare`), and the manifests a command holds at once (:class:`ManifestBudget`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from dynprof.nodes import Node
from dynprof.units import human_bytes

# What one command holds of all its nodes' answers together (the bytes read, the JSON values
# decoded), whatever each node answers within its own bound: 64 nodes at 16 to 80 MiB and
# 500 000 values each would hold gigabytes. A decoded value costs ~100 bytes at worst (an
# empty object), and an answer's text is held once more while it is decoded, so these keep a
# job-wide command under ~1 GB. Each node is sure of half its equal share; the other half of
# the total goes to the nodes that need more, first come first served (an honest big node is
# not cut because a small one answered first). See AnswerBudget.
TOTAL_ANSWER_BYTES = 192 * 1024 * 1024
TOTAL_ANSWER_VALUES = 3_000_000
# What a command holds of artifacts' manifests together (a fetch holds one per node while it
# copies that node's files; the NCCL dumps' reader one per node while it reads its list): each
# manifest is read up to MAX_MANIFEST_ANSWER_BYTES and MAX_MANIFEST_ANSWER_VALUES, and a value
# of a crafted one costs up to ~150 bytes decoded (distinct keys, short strings), so 64 nodes at
# that bound held 1.2 GB. Honest manifests are a few KiB to a few hundred (a trace's spans:
# 10 000 values); 64 such fit many times over. See ManifestBudget.
TOTAL_MANIFEST_BYTES = 32 * 1024 * 1024
TOTAL_MANIFEST_VALUES = 1_000_000


class AnswerBudget:
    """The bytes and JSON values one command keeps of all its nodes' answers together.

    Each of the ``nodes`` is sure of ``total / (2 * nodes)`` (its floor); the other half of the
    total is a pool that any node draws on past its floor, while it lasts. With ``pooled``
    False there is no pool and the floor is the whole equal share, ``total / nodes``: for
    requests made one node at a time, whose answers the caller holds together. A caller that
    holds ``per_node`` answers of each node at once (the watch: a node's progress and its
    stacks) shares the total among ``nodes * per_node`` answers; ``nodes`` stays the count of
    nodes its message names. A node whose answer needs more than it can get is cut: its answer
    is dropped (what it drew goes back) and it is named as cut. Thread-safe: the nodes of a
    command are read at once."""

    def __init__(
        self,
        nodes: int,
        total_bytes: int = TOTAL_ANSWER_BYTES,
        total_values: int = TOTAL_ANSWER_VALUES,
        pooled: bool = True,
        per_node: int = 1,
    ) -> None:
        self.nodes = max(1, nodes)
        self.per_node = max(1, per_node)
        n = self.nodes * self.per_node  # the answers held at once
        self.total_bytes = total_bytes
        self.total_values = total_values
        self.floor_bytes = total_bytes // (2 * n) if pooled else total_bytes // n
        self.floor_values = total_values // (2 * n) if pooled else total_values // n
        self._lock = threading.Lock()
        self._pool_bytes = total_bytes - self.floor_bytes * n if pooled else 0
        self._pool_values = total_values - self.floor_values * n if pooled else 0
        self.held_bytes = 0  # what the kept answers hold now (for tests and reports)
        self.held_values = 0

    def share(self) -> AnswerShare:
        """What one node's request may keep: its floor, then the pool."""
        return AnswerShare(self)

    def _draw(self, what: str, amount: int) -> bool:
        with self._lock:
            if what == "bytes":
                if amount > self._pool_bytes:
                    return False
                self._pool_bytes -= amount
            else:
                if amount > self._pool_values:
                    return False
                self._pool_values -= amount
            return True

    def _give_back(self, pool_bytes: int, pool_values: int) -> None:
        with self._lock:
            self._pool_bytes += pool_bytes
            self._pool_values += pool_values

    def _count(self, nbytes: int, values: int) -> None:
        with self._lock:
            self.held_bytes += nbytes
            self.held_values += values

    def reason(self, what: str, node: Node) -> str:
        total = human_bytes(self.total_bytes) if what == "bytes" else f"{self.total_values} JSON values"
        each = f" ({self.per_node} each)" if self.per_node > 1 else ""
        return (
            f"cut: the answers of the {self.nodes} node(s){each} of this command are held to {total} together, "
            f"and the answer of {node} needed more than was left for it; ask fewer nodes at a time "
            "(--hosts), or less of each (e.g. one --job)"
        )


class ManifestBudget(AnswerBudget):
    """The manifests one command holds at once (:data:`TOTAL_MANIFEST_BYTES`), shared by its
    ``holders`` (the requests in flight at once); each share is given back when its manifest is
    dropped (:meth:`AnswerShare.done`)."""

    def __init__(self, holders: int) -> None:
        super().__init__(holders, TOTAL_MANIFEST_BYTES, TOTAL_MANIFEST_VALUES)

    def reason(self, what: str, node: Node) -> str:
        total = human_bytes(self.total_bytes) if what == "bytes" else f"{self.total_values} JSON values"
        return (
            f"cut: the artifact manifests this command holds at once are held to {total} together, and the "
            f"manifest of {node} needed more than was left for it; fetch from fewer nodes at a time (--hosts, "
            "--max-in-flight)"
        )


class AnswerShare:
    """One node's draw on an :class:`AnswerBudget` while its answer is read and decoded."""

    def __init__(self, budget: AnswerBudget) -> None:
        self.budget = budget
        self.bytes = 0
        self.values = 0
        self._pool_bytes = 0
        self._pool_values = 0
        self._kept = (0, 0)  # what keep() counted, until done()

    def take_bytes(self, amount: int) -> bool:
        """Room for ``amount`` more bytes of this answer; False (nothing taken) when none is left."""
        return self._take("bytes", amount)

    def take_values(self, amount: int) -> bool:
        """Room for ``amount`` more JSON values of this answer; False (nothing taken) when none is left."""
        return self._take("values", amount)

    def _take(self, what: str, amount: int) -> bool:
        """``amount`` more of ``what`` (``bytes`` or ``values``): from this answer's floor while it
        lasts, then drawn from the budget's pool."""
        held, pool = getattr(self, what), getattr(self, f"_pool_{what}")
        over = max(0, held + amount - (getattr(self.budget, f"floor_{what}") + pool))
        if over and not self.budget._draw(what, over):
            return False
        setattr(self, f"_pool_{what}", pool + over)
        setattr(self, what, held + amount)
        return True

    def release(self) -> None:
        """The answer is not kept: what it drew from the pool goes back."""
        self.budget._give_back(self._pool_bytes, self._pool_values)
        self.bytes = self.values = self._pool_bytes = self._pool_values = 0

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Around reading one answer: what it took is kept (:meth:`keep`) when the reading ends,
        and given back (:meth:`release`) when it raises."""
        try:
            yield
        except BaseException:
            self.release()
            raise
        self.keep()

    def keep(self) -> None:
        """The answer is kept: count what it holds."""
        self.budget._count(self.bytes, self.values)
        self._kept = (self.bytes, self.values)

    def done(self) -> None:
        """The answer kept is dropped: what it held is no longer counted, and what it drew from
        the pool goes back."""
        kept_bytes, kept_values = self._kept
        self.budget._count(-kept_bytes, -kept_values)
        self._kept = (0, 0)
        self.release()
