"""Cluster-level dispatch: routing jobs to engine workers (``router`` is pure: no torch, no
Redis)."""
