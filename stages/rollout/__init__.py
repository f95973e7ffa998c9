"""The multi-turn rollout (spec §11) as committed Ray Data stages: reset → turn 0 → turn 1 → ... → samples.

Pure parts (no Ray): :mod:`prompts` (chat-template token ids), :mod:`episode` (one turn of one episode),
:mod:`samples` (turn rows → training samples, metrics), :mod:`show` (terminal rendering). Ray parts:
:mod:`engine_pool` (long-lived engine actors), :mod:`stages` (the three stages), :mod:`driver` (``run_rollout``).
"""
