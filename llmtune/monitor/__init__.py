"""Observing a run: metrics records and FLOPs (metrics.py), the console, the trackers, the plots."""
