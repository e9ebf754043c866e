"""The memory plan: which blocks to recompute in backward to bring a step's peak under a budget.

One module per job, each imported by its own path (this package re-exports nothing):

- :mod:`.measurement` — the measured step as the plan reads it, and its one bounded decoder;
- :mod:`.predict` — the predicted peak of a set of checkpointed blocks, and the margin;
- :mod:`.solve` — the search for the cheapest set under a budget, the floor, the plan's document;
- :mod:`.recipes` — how to apply a plan in the usual frameworks;
- :mod:`.render` — the plan's text, and a ``memory-plan`` artifact's;
- :mod:`.capture` — one training step measured in the training process (with :mod:`.blocks`,
  :mod:`.meter`, :mod:`.timeline` and :mod:`.result`);
- :mod:`.apply`, :mod:`.applied` — ``dynprof run --checkpoint``: wrapping the chosen blocks, and
  what it applied as ``dynprof show`` renders it;
- :mod:`.ranks`, :mod:`.scale` — the plan of a job's ranks together, and of other batch sizes.

Only :mod:`.capture`, :mod:`.apply` and what they use touch torch, and only when asked.
"""
