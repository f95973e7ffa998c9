"""``rollflow report RUN``: PNG plots of a run's metrics per iteration and an HTML page with them, the final metrics
and sample episodes.

Reads the metrics table written by ``stages.metrics.MetricsLog`` (``runs/<run>/metrics/``) and writes
``runs/<run>/report/``: one PNG per plot in ``PLOTS`` that has data (every metric whose name matches the plot's
pattern is a line; the same name logged by two stages gives two lines), ``stage_time.png`` (per-stage wall time per
iteration, stacked bars) and ``index.html`` (images referenced by relative path, so the folder can be copied or
served as is). Plots without data are listed on the page and in the result as missing, with the names looked for.
The per-tag rollout metrics (``rollout/<tag>/...``, one set per environment of a mixed run) get a table of their last
values per stage (rollout, eval).

Sample episodes: a list of episodes given by the caller, else the turn tables of the last rollout found under the run
(``.../turns/turn_*/part-*.parquet``, schema ``stages.rollout.tables.TURNS``), else none. An episode is a list of turn
dicts ``{observation, text, action, reward}`` (extra keys ``action_valid``, ``next_observation``, ``done``,
``success`` are shown when present), or a dict ``{"title": str, "turns": [...]}``.
"""

from __future__ import annotations

import html
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from flows.pipeline_specs import PIPELINE_SPECS, ChanceLevel
from schemas.config import validate_config
from schemas.errors import RollflowError, SchemaError
from stages.algos.intervals import wilson
from stages.metrics import METRICS_DIR, TIME_PREFIX, read_metrics
from stages.storage import Location, local_side, read_table_schema

REPORT_DIR = "report"
MAX_LINES = 10  # lines per plot; more matching metrics are listed on the page, not drawn


@dataclass(frozen=True)
class PlotSpec:
    """One plot: a file stem, a title, and the regular expression (``re.search``) its metric names match."""

    stem: str
    title: str
    pattern: str
    ylabel: str = ""
    optional: bool = False  # drawn only for runs that log it (an asynchronous run), never listed as missing


PLOTS: tuple[PlotSpec, ...] = (
    PlotSpec("success_rate", "Success rate", r"(^|/)(success|success_rate)$", "fraction of episodes"),
    PlotSpec("valid_action_rate", "Valid-action rate", r"(^|/)(action_is_valid|valid_action_rate)$", "fraction of turns"),
    PlotSpec("reward", "Reward", r"(^|/)(score|scores|reward|rewards|episode_score|episode_return|"
                                 r"response_level_rewards|step_scores)(/mean)?$", "reward"),
    PlotSpec("kl", "KL", r"(^|/)(kl|approxkl|policykl|kl_loss)$", "nats"),
    PlotSpec("entropy", "Entropy", r"entropy", "nats"),
    PlotSpec("losses", "Losses", r"(^|/)(pg_loss|weighted_pg_loss|total_loss|loss)$", "loss"),
    # async_generation_ratio > 0 (issue 46): how far behind the trained policy each rollout played, and how long it
    # ran beside the previous iteration's later stages
    PlotSpec("staleness", "Rollout staleness", r"^rollout/staleness$", "training steps behind", optional=True),
    PlotSpec("overlap", "Generation beside training", r"^rollout/overlap_seconds$", "seconds", optional=True),
)
ASYNC_METRICS = ("rollout/staleness", "rollout/overlap_seconds")  # what the loop logs per rollout when r > 0


# ---- reading ----------------------------------------------------------------------------------------------------

def series(table: pa.Table, name: str, stage: str) -> tuple[np.ndarray, np.ndarray]:
    """``(iterations (n,), values (n,))`` of metric ``name`` logged by ``stage``, by iteration."""
    rows = table.filter(pc.and_(pc.equal(table["name"], name), pc.equal(table["stage"], stage)))
    rows = rows.sort_by("iteration")
    values = rows["value"].to_numpy(zero_copy_only=False).astype(float)
    return rows["iteration"].to_numpy(), values


def matching(table: pa.Table, pattern: str) -> list[tuple[str, str]]:
    """The ``(name, stage)`` pairs whose name matches ``pattern`` (``re.search``), sorted; time/ metrics excluded."""
    regex = re.compile(pattern)
    pairs = set(zip(table["name"].to_pylist(), table["stage"].to_pylist()))
    return sorted((n, s) for n, s in pairs if regex.search(n) and not n.startswith(TIME_PREFIX))


def final_metrics(table: pa.Table) -> list[tuple[str, str, int, float | None]]:
    """``(name, stage, iteration, value)`` of the last logged iteration of every metric, sorted by name."""
    last: dict[tuple[str, str], tuple[int, float | None]] = {}
    for name, stage, it, value in zip(table["name"].to_pylist(), table["stage"].to_pylist(),
                                      table["iteration"].to_pylist(), table["value"].to_pylist()):
        if (name, stage) not in last or it >= last[(name, stage)][0]:
            last[(name, stage)] = (it, value)
    return [(n, s, it, v) for (n, s), (it, v) in sorted(last.items())]


TAG_METRIC = re.compile(r"^rollout/(?P<tag>[^/]+)/(?P<what>episodes|success_rate|valid_action_rate|"
                        r"mean_episode_length|episode_score/mean)$")
TAG_COLUMNS = ("episodes", "success_rate", "valid_action_rate", "mean_episode_length", "episode_score/mean")


def per_tag_table(table: pa.Table) -> list[tuple[str, str, int, dict[str, float | None]]]:
    """``(stage, tag, iteration, {metric: value})`` of the last iteration of every stage's per-tag rollout metrics
    (``rollout/<tag>/...``, one row per environment tag of a mixed run), sorted by stage and tag."""
    rows: dict[tuple[str, str], tuple[int, dict[str, float | None]]] = {}
    for name, stage, it, value in final_metrics(table):
        found = TAG_METRIC.match(name)
        if found is None or found["tag"] in ("stop", "episode_score"):
            continue
        key = (stage, found["tag"])
        last_it, values = rows.get(key, (it, {}))
        if it > last_it:
            last_it, values = it, {}
        if it == last_it:
            values[found["what"]] = value
        rows[key] = (last_it, values)
    return [(stage, tag, it, values) for (stage, tag), (it, values) in sorted(rows.items())]


def stage_times(table: pa.Table) -> tuple[list[int], dict[str, np.ndarray]]:
    """Iterations and, per stage in the order first logged, its wall seconds in each of them (0 where it logged
    no time): ``(n,)`` arrays."""
    timed = table.filter(pc.is_valid(table["wall_s"]))
    iterations = sorted(set(timed["iteration"].to_pylist()))
    index = {it: i for i, it in enumerate(iterations)}
    out: dict[str, np.ndarray] = {}
    first_logged: dict[str, Any] = {}
    seen: set[tuple[int, str]] = set()
    for it, stage, wall, stamp in zip(timed["iteration"].to_pylist(), timed["stage"].to_pylist(),
                                      timed["wall_s"].to_pylist(), timed["timestamp"].to_pylist()):
        first_logged[stage] = min(stamp, first_logged.get(stage, stamp))
        if (it, stage) in seen:  # every row of a (iteration, stage) carries the same wall time
            continue
        seen.add((it, stage))
        out.setdefault(stage, np.zeros(len(iterations)))[index[it]] = wall
    order = sorted(out, key=lambda stage: (first_logged[stage], stage))  # pipeline order: first logged first
    return iterations, {stage: out[stage] for stage in order}


def async_table(table: pa.Table) -> list[tuple[int, float, float, float | None]]:
    """``(iteration, staleness, overlap seconds, rollout wall seconds or None)`` of every rollout an asynchronous run
    logged (``ASYNC_METRICS``, stage ``rollout``), by iteration; [] for a run in turn."""
    stale, overlap = (dict(zip(*series(table, name, "rollout"))) for name in ASYNC_METRICS)
    walls = table.filter(pc.and_(pc.equal(table["stage"], "rollout"), pc.is_valid(table["wall_s"])))
    wall = dict(zip(walls["iteration"].to_pylist(), walls["wall_s"].to_pylist()))
    return [(int(it), float(stale[it]), float(overlap.get(it, 0.0)), wall.get(int(it))) for it in sorted(stale)]


# The number of episodes behind a success rate: Wilson's 95 % interval of each point is drawn as a band.
_EPISODES_OF = ((re.compile(r"^rollout/success_rate$"), ("rollout/episodes",)),
                (re.compile(r"^rollout/(?P<tag>[^/]+)/success_rate$"), ("rollout/{tag}/episodes",)),
                (re.compile(r"^env/(?P<tag>[^/]+)/success$"), ("rollout/{tag}/episodes", "rollout/episodes")))


def success_band(table: pa.Table, name: str, stage: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``(iterations (n,), low (n,), high (n,))``: Wilson's 95 % interval of the success rate ``name`` of ``stage``
    at each iteration where the stage also logged how many episodes it rests on (``rollout/episodes``, or
    ``rollout/<tag>/episodes`` for one environment of a mixed run); None for other metrics or without counts."""
    for pattern, counts in _EPISODES_OF:
        found = pattern.match(name)
        if found is None:
            continue
        for count in counts:
            cx, n = series(table, count.format(**found.groupdict()), stage)
            if len(cx):
                break
        x, rate = series(table, name, stage)
        episodes = dict(zip(cx.tolist(), n.tolist()))
        keep = [i for i, it in enumerate(x.tolist()) if episodes.get(it, 0) > 0 and np.isfinite(rate[i])]
        if not keep:
            return None
        bounds = np.array([wilson(rate[i] * episodes[x[i]], int(round(episodes[x[i]]))) for i in keep])
        return x[keep], bounds[:, 0], bounds[:, 1]
    return None


def metric_band(table: pa.Table, name: str, stage: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The 95 % band of metric ``name`` of ``stage``, ``(iterations (n,), low (n,), high (n,))``: the interval the
    stage logged beside a mean (``<x>/mean`` with ``<x>/ci95_low`` and ``<x>/ci95_high``, e.g. RLVR's validation
    score), else a success rate's Wilson interval (:func:`success_band`); None when neither is known."""
    if name.endswith("/mean"):
        stem = name[: -len("/mean")]
        lx, low = series(table, f"{stem}/ci95_low", stage)
        hx, high = series(table, f"{stem}/ci95_high", stage)
        if len(lx) and np.array_equal(lx, hx):
            finite = np.isfinite(low) & np.isfinite(high)
            return lx[finite], low[finite], high[finite]
    return success_band(table, name, stage)


def run_chance_level(run: Path) -> ChanceLevel | None:
    """The chance-level reference of the run's held-out score, from its frozen config (``config.json``) and its
    pipeline's declaration (agentic: the random-legal policy on the evaluation's levels); None when the run has no
    frozen config or its pipeline declares none. A config this version cannot read (not UTF-8 JSON, not a mapping,
    an unknown pipeline, options that do not validate, an environment this install lacks) gives None: the plots are
    still worth drawing. Any other error is a bug and is raised."""
    path = run / "config.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:  # json.JSONDecodeError, UnicodeDecodeError
        return None
    pipeline = data.get("pipeline", "agentic") if isinstance(data, dict) else None
    if not isinstance(pipeline, str) or pipeline not in PIPELINE_SPECS:
        return None
    spec = PIPELINE_SPECS.get(pipeline)
    try:
        return spec.chance_level(validate_config(spec.config_model(), data, str(path)))
    except RollflowError:
        return None


# ---- plotting -----------------------------------------------------------------------------------------------------

def _figure():
    from matplotlib.figure import Figure  # the object API: no pyplot state, no GUI backend (renders with Agg)

    fig = Figure(figsize=(8.0, 4.0), dpi=100, layout="constrained")
    return fig, fig.add_subplot()


def plot_lines(table: pa.Table, spec: PlotSpec, path: Path, chance: ChanceLevel | None = None) -> list[str]:
    """Write ``path`` (PNG) with one line per matching ``(name, stage)``, each with its 95 % band where it is known
    (:func:`metric_band`), and ``chance`` (the success plot's chance
    level, with its interval) as a dashed line; returns the labels drawn."""
    fig, ax = _figure()
    pairs = matching(table, spec.pattern)
    names = [n for n, _ in pairs]
    labels = []
    banded: set[tuple] = set()  # one band per distinct interval: a run logs the same rate under several names
    for name, stage in pairs[:MAX_LINES]:
        x, y = series(table, name, stage)
        label = name if names.count(name) == 1 else f"{name} [{stage}]"
        line, = ax.plot(x, y, marker="o" if len(x) <= 30 else None, markersize=3, label=label)
        labels.append(label)
        band = metric_band(table, name, stage)
        if band is not None and len(band[0]) and (key := tuple(np.concatenate(band).round(6))) not in banded:
            banded.add(key)
            ax.fill_between(band[0], band[1], band[2], color=line.get_color(), alpha=0.15, linewidth=0)
            labels.append(f"{label}: 95 % interval")
    if chance is not None and spec.stem == "success_rate":
        label = f"{chance.label}: {chance.value:.3f} [{chance.low:.3f}, {chance.high:.3f}]"
        ax.axhline(chance.value, color="grey", linestyle="--", linewidth=1, label=label)
        ax.axhspan(chance.low, chance.high, color="grey", alpha=0.12, linewidth=0)
        labels.append(label)
    ax.set_title(spec.title)
    ax.set_xlabel("iteration")
    ax.set_ylabel(spec.ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, format="png")
    return labels


def plot_stage_times(table: pa.Table, path: Path) -> list[str]:
    """Write ``path`` (PNG): stacked bars of each stage's wall seconds per iteration; returns the stages drawn."""
    iterations, per_stage = stage_times(table)
    fig, ax = _figure()
    bottom = np.zeros(len(iterations))
    for stage, seconds in per_stage.items():
        ax.bar(iterations, seconds, bottom=bottom, label=stage)
        bottom += seconds
    ax.set_title("Wall time per iteration, by stage")
    ax.set_xlabel("iteration")
    ax.set_ylabel("seconds")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, format="png")
    return list(per_stage)


# ---- episodes -----------------------------------------------------------------------------------------------------

TURN_COLUMNS = ["traj_id", "turn_idx", "observation", "text", "action_content", "action_valid", "reward",
                "next_observation", "done", "success", "stop_reason"]


def find_turn_files(run: Location) -> list[str]:
    """Parquet files of the last rollout's turn tables under the run folder ``run`` (the last ``turns`` folder in
    path order; hidden folders, a runner's temporaries and an object store's attempts, are skipped), in turn order,
    as paths on its filesystem; empty when there is none. On an object store, the files each committed turn's
    manifest lists (:meth:`Location.parquet_files`)."""
    infos = run.fs.get_file_info(pafs.FileSelector(run.path, recursive=True))
    folders = sorted((i.path for i in infos if i.type == pafs.FileType.Directory and i.base_name == "turns"
                      and "/." not in i.path[len(run.path):]), key=lambda p: p.split("/"))  # Path order
    if not folders:
        return []
    turns = Location(run.fs, folders[-1])
    return [f for i in sorted(turns.list(), key=lambda i: i.base_name)
            if i.type == pafs.FileType.Directory and i.base_name.startswith("turn_")
            for f in _turn_files(Location(run.fs, i.path))]


def _turn_files(turn: Location) -> list[str]:
    """The Parquet files of the turn table ``turn``, checked to be those its manifest lists and readable (a
    SchemaError names the one that is not)."""
    read_table_schema(turn, "turn table", allow_empty=True)
    return turn.parquet_files()


def _read_turns(files: list[str], fs=None) -> pa.Table:
    tables = []
    for f in files:
        present = set(pq.read_schema(f, filesystem=fs).names)
        tables.append(pq.read_table(f, columns=[c for c in TURN_COLUMNS if c in present], filesystem=fs))
    return pa.concat_tables(tables, promote_options="default")


def episodes_from_turns(turns: pa.Table, max_episodes: int = 3) -> list[dict]:
    """Turn-table rows (TURNS columns; the reset rows, ``turn_idx`` -1, are skipped) → the first ``max_episodes``
    episodes (by ``traj_id`` order of appearance) as ``{"title", "turns"}`` dicts for render_episodes_html."""
    missing = [c for c in ("traj_id", "turn_idx", "observation", "text", "action_content", "reward")
               if c not in turns.column_names]
    if missing:
        raise SchemaError(f"turn table: missing columns {missing}; expected the rollout's turns table "
                          "(stages.rollout.tables.TURNS)")
    rows = turns.select([c for c in TURN_COLUMNS if c in turns.column_names]).to_pylist()
    order: list[str] = []
    by_traj: dict[str, list[dict]] = {}
    for row in rows:
        if row["turn_idx"] < 0:
            continue
        if row["traj_id"] not in by_traj:
            if len(order) == max_episodes:
                continue
            order.append(row["traj_id"])
            by_traj[row["traj_id"]] = []
        by_traj[row["traj_id"]].append({**row, "action": row.get("action_content")})
    return [{"title": f"episode {traj}", "turns": sorted(by_traj[traj], key=lambda r: r["turn_idx"])}
            for traj in order]


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return "" if value is None else str(value)


def render_episodes_html(episodes: Sequence[Sequence[dict] | dict]) -> str:
    """HTML (a fragment) of ``episodes``: per episode a table of turns with observation, model text, parsed action
    and reward. An episode is a list of turn dicts or ``{"title": ..., "turns": [...]}``. All text is escaped."""
    if not episodes:
        return "<p>No sample episodes (no rollout turn tables found in this run).</p>"
    parts = []
    for k, episode in enumerate(episodes):
        title = episode.get("title", f"episode {k}") if isinstance(episode, dict) else f"episode {k}"
        turns = episode.get("turns", []) if isinstance(episode, dict) else episode
        total = sum(float(t.get("reward") or 0.0) for t in turns)
        parts.append(f"<h3>{html.escape(str(title))} — {len(turns)} turns, return {total:.4g}</h3>")
        parts.append("<table class='episode'><tr><th>turn</th><th>observation</th><th>model text</th>"
                     "<th>action</th><th>reward</th></tr>")
        for i, turn in enumerate(turns):
            action = _fmt(turn.get("action"))
            if turn.get("action_valid") is False:
                action = f"{action} (invalid)" if action else "(no valid action)"
            after = turn.get("next_observation")
            done = " — done" + (" (success)" if turn.get("success") else "") if turn.get("done") else ""
            parts.append(
                f"<tr><td>{i + 1}{html.escape(done)}</td>"
                f"<td><pre>{html.escape(_fmt(turn.get('observation')))}</pre></td>"
                f"<td><pre>{html.escape(_fmt(turn.get('text')))}</pre></td>"
                f"<td>{html.escape(action)}"
                + (f"<pre>{html.escape(after)}</pre>" if after else "")
                + f"</td><td>{html.escape(_fmt(turn.get('reward')))}</td></tr>")
        parts.append("</table>")
    return "\n".join(parts)


# ---- the page -----------------------------------------------------------------------------------------------------

_CSS = """body{font-family:sans-serif;margin:2em;max-width:1200px}img{max-width:100%;border:1px solid #ddd}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 6px;vertical-align:top}
pre{margin:0;white-space:pre-wrap;font-size:12px;max-width:420px}.missing{color:#a40}"""


def _page(run_dir: Path | str, images: list[tuple[str, str]], missing: list[str], table: pa.Table,
          episodes_html: str, chance: ChanceLevel | None = None) -> str:
    rows = "\n".join(f"<tr><td>{html.escape(n)}</td><td>{html.escape(s)}</td><td>{it}</td><td>{_fmt(v)}</td></tr>"
                     for n, s, it, v in final_metrics(table))
    figures = "\n".join(f"<h3>{html.escape(title)}</h3><img src='{html.escape(name)}' alt='{html.escape(title)}'>"
                        for title, name in images)
    missing_html = ("<ul class='missing'>" + "".join(f"<li>{html.escape(m)}</li>" for m in missing) + "</ul>"
                    if missing else "")
    tag_rows = per_tag_table(table)
    per_tag = ""
    if tag_rows:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in ("stage", "tag", "iteration") + TAG_COLUMNS)
        body = "\n".join("<tr>" + "".join(f"<td>{html.escape(str(x))}</td>" for x in (stage, tag, it)) +
                         "".join(f"<td>{_fmt(values.get(c))}</td>" for c in TAG_COLUMNS) + "</tr>"
                         for stage, tag, it, values in tag_rows)
        per_tag = f"<h2>Per environment tag</h2><table><tr>{head}</tr>{body}</table>"
    overlapped = async_table(table)
    async_html = ""
    if overlapped:
        body = "\n".join(f"<tr><td>{it}</td><td>{stale:g}</td><td>{beside:.1f}</td><td>{_fmt(wall)}</td></tr>"
                         for it, stale, beside, wall in overlapped)
        mean = sum(x[1] for x in overlapped) / len(overlapped)
        total = sum(x[2] for x in overlapped)
        async_html = (f"<h2>Asynchronous generation</h2><p>Each rollout played with a policy {mean:.2f} training steps "
                      f"behind the trained one on average, and ran {total:.1f} s in all beside the previous "
                      "iteration's later stages.</p><table><tr><th>iteration</th><th>staleness (steps)</th>"
                      f"<th>overlap (s)</th><th>rollout (s)</th></tr>{body}</table>")
    iterations = sorted(set(table["iteration"].to_pylist()))
    span = f"iterations {iterations[0]}–{iterations[-1]}" if iterations else "no iterations logged"
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>rollflow report: {html.escape(_name(run_dir))}"
            f"</title><style>{_CSS}</style></head><body>"
            f"<h1>rollflow report: {html.escape(_name(run_dir))}</h1><p>{html.escape(str(run_dir))} — {span}, "
            f"{table.num_rows} metric rows</p><h2>Per iteration</h2>{_chance_html(chance)}{figures}{missing_html}"
            f"{per_tag}{async_html}"
            f"<h2>Final metrics</h2><table><tr><th>metric</th><th>stage</th><th>iteration</th><th>value</th></tr>"
            f"{rows}</table><h2>Sample episodes</h2>{episodes_html}</body></html>")


def _chance_html(chance: ChanceLevel | None) -> str:
    bands = ("Shaded bands: 95 % intervals (a success rate: Wilson's, over its episodes; a mean score: the interval "
             "its stage logged).")
    if chance is None:
        return f"<p>{bands}</p>"
    return (f"<p>{bands} Chance level (dashed): {html.escape(chance.label)}, {chance.value:.3f} (95 % "
            f"[{chance.low:.3f}, {chance.high:.3f}], {chance.episodes} episodes; {html.escape(chance.what)}).</p>")


def _name(run_dir: Path | str) -> str:
    return run_dir.name if isinstance(run_dir, Path) else run_dir.rstrip("/").rsplit("/", 1)[-1]


@dataclass
class Report:
    """What write_report wrote: the page, the plots by stem, and the plots skipped for lack of data."""

    html: Path
    plots: dict[str, Path]
    missing: list[str]
    chance: ChanceLevel | None = None  # the success plot's chance level, when the run's pipeline declares one


def check_run_folder(run_dir: str | Path) -> None:
    """What ``rollflow report`` refuses before it writes anything: a path that is not a folder, or a folder that is
    not a training run (neither its frozen config nor a metrics/ table: a report of it would only say so)."""
    run = Path(run_dir)
    if not run.is_dir():
        what = "is a file, not a folder" if run.exists() else "does not exist"
        raise SchemaError(f"report: run folder {run} {what}; pass a run folder (runs/<run>)")
    if not (run / "config.json").is_file() and not (run / METRICS_DIR).is_dir():
        raise SchemaError(f"report: {run} is not a run folder (it has neither config.json nor {METRICS_DIR}/); pass "
                          "the folder of a run started by `rollflow train` (runs/<run>)")


def write_report(run_dir: str | Path, episodes: Iterable[Sequence[dict] | dict] | None = None,
                 output: str | Path | None = None, max_episodes: int = 3) -> Report:
    """Write the plots and ``index.html`` of ``run_dir`` into ``output`` (default ``run_dir/report``; for a run
    folder on an object store, the report folder of its local side, stages/storage.py ``local_side``: plotting
    writes local files, and ``rollflow train`` uploads it into the run folder)."""
    where = Location.of(str(run_dir))
    run = Path(run_dir) if where.atomic_rename else Path(local_side(where))
    if not where.is_dir():
        what = "is a file, not a folder" if where.exists() else "does not exist"
        raise SchemaError(f"report: run folder {run_dir} {what}; pass a run folder (runs/<run>)")
    out = Path(output) if output else run / REPORT_DIR
    if out.exists() and not out.is_dir():
        raise SchemaError(f"report: {out} is a file, where the report's folder goes; move the file away, or pass "
                          "--output DIR for the report")
    table = read_metrics(str(run_dir))
    chance = run_chance_level(run)
    if episodes is None:  # read before anything is written: a damaged turn table fails the report, not half of it
        files = find_turn_files(where)
        episodes = episodes_from_turns(_read_turns(files, where.fs), max_episodes) if files else []
    out.mkdir(parents=True, exist_ok=True)
    plots: dict[str, Path] = {}
    images: list[tuple[str, str]] = []
    missing: list[str] = []
    if table.num_rows == 0:
        parts = run / METRICS_DIR if where.atomic_rename else where.child(METRICS_DIR).uri()
        missing.append(f"no metrics at all: {parts} has no part files (MetricsLog writes them)")
    for spec in PLOTS:
        if not matching(table, spec.pattern):
            if table.num_rows and not spec.optional:
                missing.append(f"{spec.title}: no metric name matches {spec.pattern!r}")
            continue
        path = out / f"{spec.stem}.png"
        plot_lines(table, spec, path, chance)
        plots[spec.stem] = path
        images.append((spec.title, path.name))
    if stage_times(table)[1]:
        path = out / "stage_time.png"
        plot_stage_times(table, path)
        plots["stage_time"] = path
        images.append(("Wall time per stage", path.name))
    elif table.num_rows:
        missing.append("Wall time per stage: no rows carry wall_s")
    page = out / "index.html"
    shown = Path(run_dir) if where.atomic_rename else where.uri()  # a store's run folder by its URI
    page.write_text(_page(shown, images, missing, table, render_episodes_html(list(episodes)[:max_episodes]), chance),
                    encoding="utf-8")
    return Report(html=page, plots=plots, missing=missing, chance=chance)
