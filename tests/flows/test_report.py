"""``write_report`` on a synthetic metrics table: PNGs exist and decode, the page references them, missing plots are
named, the final-metrics table holds the last values, episodes render escaped, turn tables are found."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flows.report import (PLOTS, episodes_from_turns, final_metrics, matching, render_episodes_html,
                          stage_times, write_report)
from schemas.errors import SchemaError
from stages.metrics import MetricsLog, read_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ITERATIONS = 6


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run with ROLL-named metrics for 6 iterations (no entropy metric) and two timed stages."""
    run = tmp_path_factory.mktemp("run")
    with MetricsLog(run, tensorboard=False) as log:
        for it in range(ITERATIONS):
            log.log(it, "rollout", {"env/FrozenLake/success": it / 10, "env/FrozenLake/action_is_valid": 0.5 + it / 20,
                                    "rollout/episode_score/mean": it - 1.0}, wall_s=10.0 + it)
            log.log(it, "train", {"actor/pg_loss": 1.0 / (it + 1), "actor/total_loss": 2.0 / (it + 1),
                                  "critic/kl": 0.01 * it, "actor/approxkl": 0.02 * it}, wall_s=5.0)
            log.log(it, "recompute", {"critic/kl": 0.03 * it})  # the same name from another stage, untimed
    return run


@pytest.fixture(scope="module")
def report(run_dir):
    return write_report(run_dir, episodes=[[{"observation": "_P\n_G", "text": "<answer>Right</answer> & more",
                                             "action": "Right", "reward": 1.0}]])


def _is_png(path: Path) -> bool:
    from matplotlib.image import imread

    if path.read_bytes()[:8] != PNG_SIGNATURE:
        return False
    image = imread(path)
    return image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_plots_written_for_metrics_that_exist(report):
    assert set(report.plots) == {"success_rate", "valid_action_rate", "reward", "kl", "losses", "stage_time"}
    for path in report.plots.values():
        assert path.parent == report.html.parent and _is_png(path), path


def test_missing_plots_are_named(report):
    assert len(report.missing) == 1 and report.missing[0].startswith("Entropy")
    assert not (report.html.parent / "entropy.png").exists()
    assert "Entropy: no metric name matches" in report.html.read_text()


def test_an_asynchronous_run_shows_its_staleness_and_overlap_and_a_run_in_turn_does_not(tmp_path, report):
    """async_generation_ratio > 0 (issue 46): the loop's rollout/staleness and rollout/overlap_seconds get a plot each
    and a per-iteration table with their summary; a run in turn (the module's) gets neither, nor a missing entry."""
    run = tmp_path / "async"
    with MetricsLog(run, tensorboard=False) as log:
        for it in range(3):
            log.log(it, "rollout", {"rollout/success_rate": 0.5, "rollout/staleness": float(min(it, 1)),
                                    "rollout/overlap_seconds": 2.0 * it}, wall_s=4.0)
            log.log(it, "train", {"actor/pg_loss": 1.0}, wall_s=3.0)
    rep = write_report(run, episodes=[])
    assert {"staleness", "overlap"} <= set(rep.plots) and all(_is_png(rep.plots[k]) for k in ("staleness", "overlap"))
    page = rep.html.read_text()
    assert "src='staleness.png'" in page and "src='overlap.png'" in page
    section = page.split("<h2>Asynchronous generation</h2>")[1].split("<h2>")[0]
    assert "0.67 training steps behind" in section and "6.0 s in all" in section, section
    rows = re.findall(r"<tr><td>(\d+)</td><td>([^<]*)</td><td>([^<]*)</td><td>([^<]*)</td></tr>", section)
    assert rows == [("0", "0", "0.0", "4"), ("1", "1", "2.0", "4"), ("2", "1", "4.0", "4")], section
    assert not {"staleness", "overlap"} & set(report.plots) and "Asynchronous" not in report.html.read_text()
    assert not [m for m in report.missing if "stale" in m or "overlap" in m.lower()]


def test_page_references_every_plot(report):
    page = report.html.read_text()
    sources = re.findall(r"<img src='([^']+)'", page)
    assert sorted(sources) == sorted(p.name for p in report.plots.values())
    for src in sources:
        assert (report.html.parent / src).is_file()


def test_page_final_metrics_are_last_values(report):
    page = report.html.read_text()
    assert f"<td>actor/pg_loss</td><td>train</td><td>{ITERATIONS - 1}</td><td>{1 / ITERATIONS:.4g}</td>" in page
    assert f"<td>critic/kl</td><td>recompute</td><td>{ITERATIONS - 1}</td><td>{0.03 * (ITERATIONS - 1):.4g}</td>" in page


def test_page_escapes_episode_text(report):
    page = report.html.read_text()
    assert "&lt;answer&gt;Right&lt;/answer&gt; &amp; more" in page
    assert "<answer>" not in page


def test_lines_per_plot_and_same_name_from_two_stages(run_dir):
    table = read_metrics(run_dir)
    kl = next(s for s in PLOTS if s.stem == "kl")
    assert matching(table, kl.pattern) == [("actor/approxkl", "train"), ("critic/kl", "recompute"),
                                           ("critic/kl", "train")]
    losses = next(s for s in PLOTS if s.stem == "losses")
    assert [n for n, _ in matching(table, losses.pattern)] == ["actor/pg_loss", "actor/total_loss"]


def test_stage_times_stack_per_iteration(run_dir):
    iterations, per_stage = stage_times(read_metrics(run_dir))
    assert iterations == list(range(ITERATIONS))
    assert list(per_stage) == ["rollout", "train"]  # in the order first logged; recompute logged no wall time
    np.testing.assert_allclose(per_stage["rollout"] + per_stage["train"], [15.0 + it for it in range(ITERATIONS)])


def test_final_metrics_rows(run_dir):
    final = {(n, s): (it, v) for n, s, it, v in final_metrics(read_metrics(run_dir))}
    assert final[("env/FrozenLake/success", "rollout")] == (ITERATIONS - 1, pytest.approx(0.5))
    assert final[("time/train", "train")] == (ITERATIONS - 1, 5.0)


def test_empty_run_gives_a_page_that_says_so(tmp_path):
    result = write_report(tmp_path)
    assert result.plots == {}
    assert "no metrics at all" in result.missing[0]
    assert "no metrics at all" in result.html.read_text()


def test_missing_run_folder_is_an_error(tmp_path):
    with pytest.raises(SchemaError, match="does not exist"):
        write_report(tmp_path / "nope")


def _turn_rows() -> pa.Table:
    rows = []
    for traj in ("t0", "t1", "t2"):
        for turn in (-1, 1, 0):  # the reset row and turns out of order
            rows.append({"traj_id": traj, "turn_idx": turn, "observation": f"obs {traj} {turn}",
                         "text": f"reply {turn}", "action_content": "Up" if turn == 0 else "",
                         "action_valid": turn == 0, "reward": float(turn), "next_observation": "next",
                         "done": turn == 1, "success": traj == "t1"})
    return pa.Table.from_pylist(rows)


def test_episodes_from_turns_orders_turns_and_skips_reset_rows():
    episodes = episodes_from_turns(_turn_rows(), max_episodes=2)
    assert [e["title"] for e in episodes] == ["episode t0", "episode t1"]
    assert [t["turn_idx"] for t in episodes[0]["turns"]] == [0, 1]
    assert episodes[0]["turns"][0]["action"] == "Up"
    html = render_episodes_html(episodes)
    assert html.count("<table class='episode'>") == 2
    assert "(no valid action)" in html and "done (success)" in html


def test_episodes_from_turns_names_missing_columns():
    with pytest.raises(SchemaError, match="reward"):
        episodes_from_turns(_turn_rows().drop(["reward"]))


def test_report_finds_the_last_rollouts_turn_tables(tmp_path):
    with MetricsLog(tmp_path, tensorboard=False) as log:
        log.log(0, "train", {"actor/entropy": 1.5})
    for it, traj in (("iter_0000", "old"), ("iter_0001", "new")):
        folder = tmp_path / it / "rollout" / "turns" / "turn_000"
        folder.mkdir(parents=True)
        pq.write_table(_turn_rows().append_column("tag", pa.array(["x"] * 9)).set_column(
            0, "traj_id", pa.array([traj] * 9)), folder / "part-00000.parquet")
    result = write_report(tmp_path)
    page = result.html.read_text()
    assert "episode new" in page and "episode old" not in page
    assert set(result.plots) == {"entropy"}


def test_report_command(run_dir, tmp_path):
    from typer.testing import CliRunner

    from flows.cli import app

    result = CliRunner().invoke(app, ["report", str(run_dir), "--output", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert f"report: {tmp_path / 'out' / 'index.html'}" in result.output
    assert "missing: Entropy" in result.output
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        ["index.html", "success_rate.png", "valid_action_rate.png", "reward.png", "kl.png", "losses.png",
         "stage_time.png"])


def test_report_command_on_a_missing_run_exits_2(tmp_path):
    from typer.testing import CliRunner

    from flows.cli import app

    result = CliRunner().invoke(app, ["report", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert "does not exist" in result.output


def test_per_tag_table_holds_each_stages_last_values_per_environment(tmp_path):
    """A mixed run: rollout/<tag>/... of two tags from two stages; the page gets a per-tag table of the last values,
    and the totals (rollout/success_rate, rollout/stop/..., rollout/episode_score/mean) are no tags."""
    from flows.report import per_tag_table

    with MetricsLog(tmp_path, tensorboard=False) as log:
        for it in range(2):
            for stage in ("rollout", "eval"):
                log.log(it, stage, {"rollout/success_rate": 0.5, "rollout/stop/max_steps": 1.0,
                                    "rollout/episode_score/mean": -0.1,
                                    "rollout/FrozenLake/success_rate": 0.25 + it,
                                    "rollout/FrozenLake/mean_episode_length": 3.0,
                                    "rollout/SimpleSokoban/success_rate": 0.125 + it,
                                    "rollout/SimpleSokoban/valid_action_rate": 0.5})
    rows = per_tag_table(read_metrics(tmp_path))
    assert [(stage, tag, it) for stage, tag, it, _ in rows] == [
        ("eval", "FrozenLake", 1), ("eval", "SimpleSokoban", 1), ("rollout", "FrozenLake", 1),
        ("rollout", "SimpleSokoban", 1)]
    assert rows[2][3] == {"success_rate": 1.25, "mean_episode_length": 3.0}
    assert rows[3][3] == {"success_rate": 1.125, "valid_action_rate": 0.5}
    page = write_report(tmp_path, episodes=[]).html.read_text()
    assert "Per environment tag" in page and "<td>SimpleSokoban</td>" in page and "<td>1.125</td>" in page


# ---- intervals and the chance level ---------------------------------------------------------------------------------
def _rates_run(folder: Path) -> Path:
    """Eval success rates with their episode counts (a mixed run's per-tag counts for one tag), and a rate logged
    without any count."""
    with MetricsLog(folder, tensorboard=False) as log:
        for it, (rate, episodes) in enumerate([(0.25, 128), (0.5, 128), (1.0, 32)]):
            log.log(it, "eval", {"rollout/success_rate": rate, "rollout/episodes": float(episodes),
                                 "env/FrozenLake/success": rate / 2, "rollout/FrozenLake/episodes": 64.0,
                                 "rollout/episode_score/mean": rate})
            log.log(it, "rollout", {"rollout/success_rate": rate})  # no count: no band
    return folder


def test_success_band_is_wilsons_interval_over_the_logged_episodes(tmp_path):
    from flows.report import success_band
    from stages.algos.intervals import wilson

    table = read_metrics(_rates_run(tmp_path))
    x, low, high = success_band(table, "rollout/success_rate", "eval")
    assert x.tolist() == [0, 1, 2]
    expected = [wilson(32, 128), wilson(64, 128), wilson(32, 32)]
    np.testing.assert_allclose(np.stack([low, high], 1), expected)
    assert high[2] == 1.0 and low[1] < 0.5 < high[1]
    # a tag's success rests on that tag's episodes, not the run's
    _, tag_low, tag_high = success_band(table, "env/FrozenLake/success", "eval")
    np.testing.assert_allclose([tag_low[0], tag_high[0]], wilson(0.125 * 64, 64))
    assert success_band(table, "rollout/success_rate", "rollout") is None  # no count logged
    assert success_band(table, "rollout/episodes", "eval") is None  # not a rate


def test_success_plot_draws_the_chance_level_and_bands(tmp_path):
    from flows.pipeline_specs import ChanceLevel
    from flows.report import plot_lines

    table = read_metrics(_rates_run(tmp_path / "run"))
    chance = ChanceLevel("random legal actions", 0.155, 0.134, 0.179, 1024, "test")
    success = next(s for s in PLOTS if s.stem == "success_rate")
    labels = plot_lines(table, success, tmp_path / "s.png", chance)
    assert "random legal actions: 0.155 [0.134, 0.179]" in labels
    assert "rollout/success_rate [eval]: 95 % interval" in labels
    assert "rollout/success_rate [rollout]: 95 % interval" not in labels
    assert _is_png(tmp_path / "s.png")
    reward = next(s for s in PLOTS if s.stem == "reward")
    assert not any(label.startswith("random legal") for label in plot_lines(table, reward, tmp_path / "r.png", chance))


def test_report_of_an_agentic_run_draws_the_random_legal_policy(tmp_path):
    """The chance level comes from the run's frozen config: the random-legal policy on its evaluation levels, equal
    to stages.rollout.baseline's; an RLVR run (no chance level declared) and a folder without config get none."""
    import json

    from schemas.config import load_config
    from schemas.rlvr_train_config import RLVRTrainConfig
    from schemas.train_flow_config import TrainFlowConfig
    from stages.rollout.baseline import evaluation_baseline

    repo = Path(__file__).resolve().parents[2]
    config = load_config(TrainFlowConfig, str(repo / "configs/train_frozenlake_quickstart.yaml"), {})
    run = _rates_run(tmp_path / "agentic")
    (run / "config.json").write_text(json.dumps(config.model_dump(mode="json")))
    report = write_report(run)
    expected = evaluation_baseline(config)
    assert report.chance is not None and report.chance.value == expected.success_rate
    assert (report.chance.low, report.chance.high) == expected.interval()
    assert report.chance.low < expected.success_rate < report.chance.high
    assert "Chance level (dashed): random legal actions" in report.html.read_text()

    rlvr = _rates_run(tmp_path / "rlvr")
    rlvr_config = load_config(RLVRTrainConfig, str(repo / "configs/rlvr_train_add2.yaml"), {})
    (rlvr / "config.json").write_text(json.dumps(rlvr_config.model_dump(mode="json")))
    assert write_report(rlvr).chance is None
    assert write_report(_rates_run(tmp_path / "bare")).chance is None


def test_a_mean_is_drawn_with_the_interval_its_stage_logged(tmp_path):
    """RLVR's validation logs val/score/mean with val/score/ci95_low and ci95_high: that band is drawn, and the
    interval metrics are no lines of their own."""
    from flows.report import metric_band, plot_lines

    with MetricsLog(tmp_path, tensorboard=False) as log:
        for it in range(3):
            log.log(it, "validation", {"val/score/mean": 0.2 + it / 10, "val/score/ci95_low": 0.1 + it / 10,
                                       "val/score/ci95_high": 0.3 + it / 10, "val/scored": 100.0})
    table = read_metrics(tmp_path)
    x, low, high = metric_band(table, "val/score/mean", "validation")
    assert x.tolist() == [0, 1, 2]
    np.testing.assert_allclose(low, [0.1, 0.2, 0.3])
    np.testing.assert_allclose(high, [0.3, 0.4, 0.5])
    reward = next(s for s in PLOTS if s.stem == "reward")
    assert plot_lines(table, reward, tmp_path / "r.png") == ["val/score/mean", "val/score/mean: 95 % interval"]


def test_a_config_this_install_cannot_measure_gives_the_report_without_a_chance_level_and_a_bug_is_raised(
        tmp_path, monkeypatch):
    """A frozen config that is not JSON, not a mapping, of an unknown pipeline, with options that do not validate or
    an environment this install lacks: the report is the one of a run without config. An error of the measuring code
    itself (a KeyError, an AttributeError) is a bug, and fails the report."""
    import json

    import flows.pipeline_specs
    from schemas.config import load_config
    from schemas.train_flow_config import TrainFlowConfig

    repo = Path(__file__).resolve().parents[2]
    frozen = load_config(TrainFlowConfig, str(repo / "configs/train_frozenlake_quickstart.yaml"), {}).model_dump(
        mode="json")
    rollout = frozen["rollout"]
    unmeasurable = {"not json": "{", "a list": "[1]", "unknown pipeline": json.dumps({**frozen, "pipeline": "x"}),
                    "invalid": json.dumps({**frozen, "max_steps": 0}),
                    "unknown env": json.dumps({**frozen, "rollout": {**rollout, "env": {**rollout["env"],
                                                                                        "tag": "NoSuchEnv"}}})}
    bare = write_report(_rates_run(tmp_path / "bare"))
    for name, text in unmeasurable.items():
        run = _rates_run(tmp_path / name)
        (run / "config.json").write_text(text)
        report = write_report(run)
        assert report.chance is None, name
        assert (report.missing, sorted(report.plots)) == (bare.missing, sorted(bare.plots)), name
        assert report.html.read_text().replace(name, "bare") == bare.html.read_text(), name

    run = _rates_run(tmp_path / "agentic")
    (run / "config.json").write_text(json.dumps(frozen))
    for bug in (KeyError("level"), AttributeError("'TurnSection' object has no attribute 'levels'")):
        def measure(config, bug=bug):
            raise bug
        monkeypatch.setattr(flows.pipeline_specs, "evaluation_baseline", measure)
        with pytest.raises(type(bug)):
            write_report(run)
