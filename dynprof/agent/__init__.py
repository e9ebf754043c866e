"""The dynprof in-process agent.

Start it with ``dynprof run -- CMD``, with ``DYNPROF=1`` (the package's .pth start-up hook),
or from code::

    import dynprof.agent
    dynprof.agent.start()

It is dormant until asked: one daemon thread blocked on a Unix socket and one optimizer-step
hook. It never initialises CUDA and never lets its own failures reach the job.
"""

from dynprof.agent._agent import Agent, get, shutdown, start

__all__ = ["Agent", "get", "shutdown", "start"]
