"""benchmarks/worker_group.py's pure helpers (issue 44): how a process is named as it goes from Ray's idle worker to an
actor, and the RESULT line from the rounds' figures."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
try:
    from worker_group import medians, result_line, updated_kind
finally:
    sys.path.remove(str(BENCHMARKS))


def test_a_ray_worker_is_named_by_the_first_actor_it_runs():
    python = "/venv/bin/python"
    kind = updated_kind(None, f"{python} /venv/lib/ray/_private/workers/default_worker.py --node-ip-address=1")
    assert kind == "workers/default_worker.py"
    kind = updated_kind(kind, "ray::IDLE")
    assert kind == "ray::IDLE"
    kind = updated_kind(kind, "ray::TrainWorker.step")
    assert kind == "ray::TrainWorker"
    assert updated_kind(kind, "ray::IDLE") == "ray::TrainWorker"  # an actor that idles stays what it was
    assert updated_kind(None, "/venv/lib/ray/core/src/ray/raylet/raylet --x", "raylet") == "raylet"


def test_the_result_line_holds_each_ways_medians_one_worker_first():
    def run(way, workers, start, cpu, kinds):
        return {"way": way, "workers": workers, "start_s": start, "step_s": 1.0, "close_s": 0.5, "cpu_s": cpu,
                "rss_gib": 2.0, "processes": sum(kinds.values()), "kinds": kinds}

    runs = [run("raytrain", 1, 20.0, 30.0, {"ray::TrainController": 1, "ray::RayTrainWorker": 1}),
            run("raytrain", 1, 16.0, 26.0, {"ray::RayTrainWorker": 2}),
            run("actors", 1, 9.0, 12.0, {"ray::TrainWorker": 1}),
            run("actors", 1, 11.0, 14.0, {"ray::TrainWorker": 1}),
            run("actors", 2, 12.0, 20.0, {"ray::TrainWorker": 2})]
    figures = medians(runs)
    assert figures["raytrain", 1]["start_s"] == 18.0 and figures["actors", 1]["cpu_s"] == 13.0
    assert figures["raytrain", 1]["kinds"] == {"ray::TrainController": 1, "ray::RayTrainWorker": 2}
    line = result_line(figures)
    assert line.startswith("RESULT raytrain_start_s=18.0 actors_start_s=10.0 raytrain_step_s=1.00 actors_step_s=1.00 "
                           "raytrain_processes=2 actors_processes=1 raytrain_cpu_s=28 actors_cpu_s=13 "), line
    assert line.endswith("actors_start_s_2w=12.0 actors_step_s_2w=1.00 actors_processes_2w=2 actors_cpu_s_2w=20 "
                         "actors_rss_gib_2w=2.00"), line
