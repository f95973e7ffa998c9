"""Generator of realistic stored trajectories (FrozenLake/Sokoban-shaped), for the example, tests and benchmarks.

Groups of ``group_size`` episodes share a level (seed); every episode starts in the level's start state (a repeated
anchor state), later turns revisit a small set of states, so GiGPO's state groups have real sizes. Step rewards follow
the environment's shape: FrozenLake gives ``format_penalty`` for unparseable replies and 1 for reaching the goal;
Sokoban gives −0.1 per step, +1 per box placed and +10 for solving. Token data is random but well-formed: prompt
tokens, then response tokens (``response_len`` range), log-probs on response positions, next-token aligned.

Rows are either step-level (one per turn, with ``state_hash``) or trajectory-level (one per episode: turns
interleaved as observation and response segments). Output is written in chunks, so memory does not grow with ``N``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from schemas.errors import ConfigError
from schemas.tables import SAMPLES
from stages.commit import commit_folder
from stages.storage import MANIFEST, Location

VOCAB = 49152


@dataclass(frozen=True)
class ExampleSpec:
    samples: int = 2048
    seed: int = 0
    group_size: int = 8
    env: str = "frozenlake"  # frozenlake | sokoban
    level: str = "step"  # step | trajectory
    max_turns: int = 5
    response_len: tuple[int, int] = (64, 512)
    prompt_len: tuple[int, int] = (40, 120)
    states_per_level: int = 6
    with_values: bool = True
    rows_per_file: int = 8192


def row_id(*parts: object) -> str:
    """Deterministic row id: SHA-256 of the joined parts (never uuid4 or Python's hash())."""
    return hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()[:24]


def state_hash(observation: str) -> str:
    """ROLL's state hash: hex SHA-256 of ``"str:" + observation`` (spec §11.2)."""
    return hashlib.sha256(("str:" + observation).encode()).hexdigest()


def _episode_rewards(rng: np.random.Generator, env: str, turns: int) -> np.ndarray:
    """Per-turn rewards ``(turns,)`` of one episode shaped like ``env``'s."""
    if env == "frozenlake":
        r = np.where(rng.random(turns) < 0.3, -0.01, 0.0)
        if rng.random() < 0.35:
            r[-1] = 1.0
    else:
        r = np.full(turns, -0.1)
        r += np.where(rng.random(turns) < 0.15, 1.0, 0.0)
        if rng.random() < 0.25:
            r[-1] += 10.0
    return r.astype(np.float32)


def _plan_chunk(rng: np.random.Generator, spec: ExampleSpec, first_group: int, target_rows: int) -> list[dict]:
    """Episodes of whole groups until ``target_rows`` rows: one dict per episode with its turns and states."""
    episodes: list[dict] = []
    rows = 0
    g = first_group
    while rows < target_rows:
        level_seed = spec.seed * 1_000_003 + g
        group_id = f"{spec.env}_{g}_0_{level_seed}"
        for e in range(spec.group_size):
            turns = int(rng.integers(1, spec.max_turns + 1))
            states = [0] + list(rng.integers(1, spec.states_per_level, size=turns - 1))
            episodes.append({"group": g, "group_id": group_id, "traj_id": f"{group_id}_{e}", "episode": e,
                             "turns": turns, "rewards": _episode_rewards(rng, spec.env, turns),
                             "states": [state_hash(f"level{level_seed}:state{s}") for s in states]})
            rows += turns if spec.level == "step" else 1
        g += 1
    return episodes


def _segments(rng, spec: ExampleSpec, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and response lengths for ``n`` turns."""
    p = rng.integers(spec.prompt_len[0], spec.prompt_len[1] + 1, size=n)
    r = rng.integers(spec.response_len[0], spec.response_len[1] + 1, size=n)
    return p, r


def _token_columns(rng, spec: ExampleSpec, seg_layout: list[list[tuple[int, int]]]) -> dict[str, pa.Array]:
    """Build ``input_ids``, ``response_mask`` and the next-token float columns from per-row (prompt, response)
    segment lengths. ``seg_layout[b]`` lists the turns of row ``b``."""
    lengths = np.array([sum(p + r for p, r in segs) for segs in seg_layout], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    n = int(offsets[-1])
    ids = rng.integers(0, VOCAB, size=n, dtype=np.int32)
    mask = np.zeros(n, dtype=np.int8)
    pos = 0
    for segs in seg_layout:
        for p, r in segs:
            mask[pos + p: pos + p + r] = 1
            pos += p + r
    # next-token columns: drop the first position of each row's mask → (L-1) entries per row
    nt_keep = np.ones(n, dtype=bool)
    nt_keep[offsets[:-1][lengths > 0]] = False
    nt_mask = mask[nt_keep].astype(np.float32)
    nt_offsets = np.concatenate([[0], np.cumsum(np.maximum(lengths - 1, 0))])
    m = len(nt_mask)
    infer = (-rng.gamma(0.6, 1.2, size=m)).astype(np.float32) * nt_mask
    old = (infer + rng.normal(0, 0.02, size=m).astype(np.float32)) * nt_mask
    ref = (old + rng.normal(0, 0.05, size=m).astype(np.float32)) * nt_mask
    cols = {
        "input_ids": pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(ids)),
        "response_mask": pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(mask)),
    }
    for name, vals in (("infer_logprobs", infer), ("old_log_probs", np.minimum(old, 0)),
                       ("ref_log_probs", np.minimum(ref, 0))):
        cols[name] = pa.ListArray.from_arrays(pa.array(nt_offsets, pa.int32()), pa.array(vals, pa.float32()))
    if spec.with_values:
        values = rng.normal(0.2, 0.3, size=m).astype(np.float32)
        cols["values"] = pa.ListArray.from_arrays(pa.array(nt_offsets, pa.int32()), pa.array(values, pa.float32()))
    return cols


def _chunk_table(rng, spec: ExampleSpec, episodes: list[dict]) -> pa.Table:
    ident: dict[str, list] = {k: [] for k in ("row_id", "group_id", "traj_id", "turn_idx", "num_turns", "tag",
                                              "score", "episode_score", "state_hash", "prompt_len")}
    layout: list[list[tuple[int, int]]] = []
    tag = "FrozenLake" if spec.env == "frozenlake" else "SimpleSokoban"
    for ep in episodes:
        p, r = _segments(rng, spec, ep["turns"])
        episode_score = float(ep["rewards"].sum())
        per_row = range(ep["turns"]) if spec.level == "step" else [0]
        for t in per_row:
            ident["row_id"].append(row_id(spec.seed, "example", ep["group_id"], ep["episode"], t))
            ident["group_id"].append(ep["group_id"])
            ident["traj_id"].append(ep["traj_id"])
            ident["turn_idx"].append(t)
            ident["num_turns"].append(ep["turns"])
            ident["tag"].append(tag)
            ident["episode_score"].append(episode_score)
            if spec.level == "step":
                ident["score"].append(float(ep["rewards"][t]))
                ident["state_hash"].append(ep["states"][t])
                ident["prompt_len"].append(int(p[t]))
                layout.append([(int(p[t]), int(r[t]))])
            else:
                ident["score"].append(episode_score)
                ident["state_hash"].append(None)
                ident["prompt_len"].append(int(p[0]))
                layout.append([(int(a), int(b)) for a, b in zip(p, r)])
    cols = {k: pa.array(v, type=SAMPLES.arrow_schema().field(k).type if k in SAMPLES.required else None)
            for k, v in ident.items()}
    cols["state_hash"] = pa.array(ident["state_hash"], pa.string())
    cols["prompt_len"] = pa.array(ident["prompt_len"], pa.int32())
    cols.update(_token_columns(rng, spec, layout))
    schema = SAMPLES.arrow_schema(present=list(cols))
    return pa.table({f.name: cols[f.name].cast(f.type) for f in schema}, schema=schema)


def _check_spec(spec: ExampleSpec) -> None:
    """Reject settings that would loop forever (``group_size`` 0) or fail deep inside numpy."""
    for name in ("samples", "group_size", "max_turns", "states_per_level", "rows_per_file"):
        if getattr(spec, name) < 1:
            raise ConfigError(f"example {name} ({getattr(spec, name)}) must be at least 1; pass a positive value")
    for name in ("response_len", "prompt_len"):
        low, high = getattr(spec, name)
        if not 0 <= low <= high:
            raise ConfigError(f"example {name} ({low}, {high}) must satisfy 0 <= min <= max; e.g. --min-response 8 "
                              "--max-response 32")
    if spec.env not in ("frozenlake", "sokoban") or spec.level not in ("step", "trajectory"):
        raise ConfigError(f"example env '{spec.env}' / level '{spec.level}': env must be frozenlake or sokoban and "
                          "level step or trajectory")


def generate(spec: ExampleSpec, output: str) -> dict:
    """Write ``spec.samples`` rows (rounded up to whole groups) as Parquet parts plus a manifest into ``output``.

    Returns the manifest. Written atomically: a temporary folder renamed into place (on an object store, the
    runner's attempt protocol: stages/commit.py ``commit_folder``).
    """
    _check_spec(spec)
    out = Location.of(output)
    if out.exists() and (out.atomic_rename or out.list()):
        raise FileExistsError(f"{out.path} already exists; choose a new --output folder or delete it first")
    params = asdict(spec)
    fingerprint = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()
    if not out.atomic_rename:
        return commit_folder(out, fingerprint, lambda folder: _write_parts(spec, folder), who="example",
                             other="another table")[0]
    tmp = out.parent.child(f".{out.name}.tmp-example")
    tmp.rmtree()
    tmp.fs.create_dir(tmp.path, recursive=True)
    manifest = {**_write_parts(spec, tmp), "fingerprint": fingerprint}
    tmp.child(MANIFEST).write_text(json.dumps(manifest, indent=1))
    tmp.rename(out)
    return manifest


def _write_parts(spec: ExampleSpec, folder) -> dict:
    """Write the example rows of ``spec`` as part-*.parquet into the Location ``folder``; return the manifest
    without its fingerprint."""
    rows, files, group = 0, [], 0
    chunk_idx = 0
    while rows < spec.samples:
        rng = np.random.default_rng([spec.seed, chunk_idx])
        episodes = _plan_chunk(rng, spec, group, min(spec.rows_per_file, spec.samples - rows))
        group = episodes[-1]["group"] + 1
        table = _chunk_table(rng, spec, episodes)
        name = f"part-{chunk_idx:05d}.parquet"
        with folder.fs.open_output_stream(f"{folder.path}/{name}") as f:
            pq.write_table(table, f)
        files.append({"name": name, "rows": table.num_rows})
        rows += table.num_rows
        chunk_idx += 1
    return {"stage": "example", "version": "1", "table": "samples", "rows": rows, "files": files,
            "groups": group, "params": asdict(spec)}
