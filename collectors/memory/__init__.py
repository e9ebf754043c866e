"""CUDA memory snapshots: one capture kind, ``memory``, in one package.

An artifact of kind ``memory`` holds:

``snapshot.pickle``     ``torch.cuda.memory._snapshot()`` as PyTorch writes it (pickle protocol 4):
                        pytorch.org/memory_viz and ``python -m torch.cuda._memory_viz`` read it
``summary.json``        :func:`summary.summarize_snapshot` plus what the capture knew: trigger, the
                        failing allocation, free/total memory, allocator statistics, attribution,
                        advice, capture timings
``memory_summary.txt``  ``torch.cuda.memory_summary()`` of each device in use
``stack.txt``           the Python stack of the thread that hit the OOM (or asked for the snapshot)

The modules, by where they run:

:mod:`.capture`  in the training process: the snapshot, the failing thread's stack, who holds
                 the memory, the artifact. The agent loads it with :mod:`.policy` and nothing
                 else of this package; the summary and advice are loaded at the first capture.
:mod:`.policy`   memory-history policies: parsed by the CLI, applied by the agent.
:mod:`.reader`   snapshot pickles and artifacts read back: untrusted input, bounded.
:mod:`.summary`  figures computed from a snapshot (no torch needed).
:mod:`.advice`   size classes and advice from a summary.
:mod:`.render`   text and HTML (``render_artifact`` for ``dynprof show``, ``render_html`` for
                 ``dynprof memory-report``).
:mod:`.plan`     the memory plan, a package of its own (:mod:`collectors.memory.plan` lists its
                 modules): which blocks to recompute to fit a budget, measured in the training
                 process only when a plan is asked for.

This file holds only the artifact's layout, which every one of them shares.
"""

KIND = "memory"
SNAPSHOT_FILE = "snapshot.pickle"
SUMMARY_FILE = "summary.json"
MEMORY_SUMMARY_FILE = "memory_summary.txt"
STACK_FILE = "stack.txt"
