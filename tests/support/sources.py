"""A watch's progress source where nothing is wrong: one node, two ranks of the job that step
every poll."""

from __future__ import annotations

from dynprof.watch.model import NodeProgress, RankProgress
from dynprof.watch.sources import NodeRead


class SteppingSource:
    """Node ``host`` with ranks 0 and 1 at step ``int(t)``, each last stepped at ``t``; each
    poll first moves the clock ``t`` on by ``tick`` seconds (none by default: the test moves it)."""

    def __init__(self, host: str, tick: float = 0.0) -> None:
        self.host = host
        self.tick = tick
        self.t = 1000.0

    def nodes(self) -> list[str]:
        return [self.host]

    def progress(self, job: str, fresh: bool = False) -> list[NodeRead]:
        self.t += self.tick
        rows = [
            RankProgress(
                job=job,
                rank=r,
                world_size=2,
                pid=100 + r,
                host=self.host,
                step=int(self.t),
                last_step_at=self.t,
                last_step_age_s=0.0,
                step_time_s=0.1,
                polled_at=self.t,
            )
            for r in (0, 1)
        ]
        return [NodeRead(self.host, NodeProgress(host=self.host, time=self.t, poll_every_s=1.0, ranks=rows))]
