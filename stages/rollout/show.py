"""``rollflow show DIR``: a rollout's episodes turn by turn — observation, model text, parsed action, reward —
as plain text for a terminal. Reads the committed tables with pyarrow (no Ray), so it also works on a rollout that is
still running or was killed (it shows the turns committed so far)."""

from __future__ import annotations

import textwrap

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads

from schemas.errors import SchemaError
from stages.rollout.driver import EPISODES_DIR, committed_turn_dirs, reset_dir
from stages.storage import Location, read_table_schema

SHOW_COLUMNS = ["traj_id", "group_id", "env_id", "level_seed", "turn_idx", "observation", "next_observation",
                "text", "action_content", "action_valid", "action_effective", "reward", "format_penalty",
                "finish_reason", "response_truncated", "response_ids", "done", "stop_reason", "episode_return",
                "success"]


def _read(loc: Location, columns: list[str], env_ids: list[int] | None = None) -> pa.Table:
    if read_table_schema(loc, "rollout table", allow_empty=True) is None:  # names a missing or corrupt file
        return pa.table({c: [] for c in columns})
    dataset = pads.dataset(loc.parquet_files(), filesystem=loc.fs)
    where = pc.field("env_id").isin(env_ids) if env_ids is not None else None
    return dataset.to_table(columns=columns, filter=where)


def _indent(text: str, prefix: str) -> str:
    return textwrap.indent(text, prefix, lambda line: True)


def _clip(text: str, limit: int) -> str:
    text = text.rstrip()
    return text if len(text) <= limit else text[:limit] + f"… [{len(text) - limit} more chars]"


def _turn_lines(row: dict, max_text: int) -> list[str]:
    action = (f"{row['action_content']} (valid{', moved' if row['action_effective'] else ', no effect'})"
              if row["action_valid"] else f"none — format penalty {row['format_penalty']:+g}")
    cut = ", cut at max_new_tokens" if row["response_truncated"] else ""
    lines = ["", f"  turn {row['turn_idx'] + 1}",
             f"    model ({len(row['response_ids'])} tokens, {row['finish_reason']}{cut}):",
             _indent(_clip(row["text"], max_text) or "(empty)", "      | "),
             f"    action: {action}",
             f"    reward: {row['reward']:+g}   return so far: {row['episode_return']:+g}",
             "    state after:",
             _indent(row["next_observation"], "      ")]
    if row["done"]:
        lines.append(f"    episode over: {row['stop_reason']}{' (success)' if row['success'] else ''}")
    return lines


def render_rollout(output: str, episodes: int = 3, traj_id: str | None = None, max_text: int = 400) -> str:
    """The first ``episodes`` episodes of the rollout in ``output`` (or the one named ``traj_id``), turn by turn."""
    out = Location.of(output)
    reset_loc = reset_dir(output)
    if reset_loc is None:
        raise SchemaError(f"{out.path} holds no rollout (no {EPISODES_DIR}/ folder); pass the --output folder of "
                          "rollflow rollout")
    starts = _read(reset_loc, ["traj_id", "group_id", "env_id", "level_seed", "observation"])
    if traj_id is not None:
        starts = starts.filter(pc.field("traj_id") == traj_id)
        if starts.num_rows == 0:
            raise SchemaError(f"{out.path}: no episode with traj_id '{traj_id}'")
    starts = starts.sort_by("env_id").slice(0, max(episodes, 0) if traj_id is None else None)
    env_ids = starts.column("env_id").to_pylist()
    turn_tables = [_read(loc, SHOW_COLUMNS, env_ids) for loc in committed_turn_dirs(output)]
    by_episode: dict[str, list[dict]] = {t: [] for t in starts.column("traj_id").to_pylist()}
    for table in turn_tables:
        for row in table.to_pylist():
            by_episode[row["traj_id"]].append(row)
    blocks = [f"rollout {out.path}: {len(turn_tables)} turn table(s); showing {len(env_ids)} episode(s)"]
    for start in starts.to_pylist():
        turns = sorted(by_episode[start["traj_id"]], key=lambda r: r["turn_idx"])
        last = turns[-1] if turns else None
        status = (f"{len(turns)} turn(s), return {last['episode_return']:+g}, "
                  + (f"ended: {last['stop_reason']}{' (success)' if last['success'] else ''}" if last["done"]
                     else "still running") if last else "not played yet")
        lines = ["", "=" * 72, f"episode {start['traj_id']}  (level seed {start['level_seed']})", f"  {status}",
                 "  start:", _indent(start["observation"], "      ")]
        for row in turns:
            lines.extend(_turn_lines(row, max_text))
        blocks.append("\n".join(lines))
    return "\n".join(blocks)
