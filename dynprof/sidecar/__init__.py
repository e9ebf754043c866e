"""The sidecar: one HTTP server per node (`dynprof serve`), its page and its actions."""
