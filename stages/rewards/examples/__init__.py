"""Worked examples of custom reward workers (docs/custom-reward-worker.md)."""
