"""The job-wide layer: many nodes reached through their sidecars (client, discovery, node lists)."""
