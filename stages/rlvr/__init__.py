"""The RLVR data side: the reward stage over ``responses`` tables and the RLVR chain (spec §0.4, §3, §2.4, §4.3).

``chain`` is pure numpy (no Ray); ``stages`` holds the Ray Data stages run by ``stages.runner.run_stage``;
``example`` writes an offline ``responses`` table from ``data/rlvr``. Import the stages from
``stages.rlvr.stages`` (this package does not import Ray).
"""
