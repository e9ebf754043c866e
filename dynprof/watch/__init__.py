"""The job watch: each node's live per-rank progress (read by its sidecar from the agents), the
stall, hang and straggler decisions made from it, and the verdicts they write (docs/watch.md)."""
