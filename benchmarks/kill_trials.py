"""Randomised SIGKILL trials (issue 17): kill a rollflow command's whole process group (the CLI, its local Ray
cluster, Prefect's ephemeral server) at a random moment — once or twice in a row — then run it again to the end,
and compare every committed table with an uninterrupted run's.

Commands (each on small inputs it makes itself, nothing downloaded):

* ``score``: ``rollflow score --advantages`` on the shipped RLVR example set (reward workers, the RLVR chain);
* ``recompute``: ``rollflow recompute`` (GiGPO) on a generated step-level set;
* ``rollout``: ``rollflow rollout`` of FrozenLake on the tiny random model (HF engine), killed inside its turns;
* ``train``: ``rollflow train`` on the quickstart config (the default model, vLLM, DeepSpeed; 2 iterations), killed
  anywhere — rollout, log-probs, training, checkpoint writing, evaluation — and resumed with ``--resume``; the tables
  of both iterations, the evaluations and the final checkpoint's weights are compared;
* ``train-step``: ``rollflow train-step`` (one PPO step, 2 epochs, DeepSpeed in the training workers) of the tiny random
  model on a generated advantaged table (tests/train/tables.py); its checkpoint's weights are compared bit for bit.

Kill delays are drawn uniformly over the uninterrupted run's wall time (seeded). A trial passes when the rerun exits
0 and every table the reference committed is committed again with the same rows (by row_id) and equal values (floats
within 1e-5). ``make test`` keeps one train trial on the tiny model (tests/trainflow: a SIGKILL after a weights-only
checkpoint); the quickstart trials are here.

    python benchmarks/kill_trials.py --command score --trials 4 --seed 0

``--samples N`` sizes the generated step-level set of ``recompute`` and ``stage`` (default 4,000 rows); ``--per-file``
compares the tables file by file instead — each file's Arrow table digested (SHA-256 of its IPC stream, so equal
values bit for bit and the same files), one file in memory at a time — and deletes the reference's outputs once
digested and each trial's once compared: at 2M rows (``--samples 2000000``, ~9 GB of samples) an advantaged table
is ~19 GB, too large to hold as Python lists or to keep twice on disk. ``--root DIR``: work there (default: a new
folder under the system's temporary folder). ``--set KEY=VALUE`` adds a config override to the recompute command
(``runtime.data_memory_mb=64``: its rewards step runs in hash partitions from 32,768 rows).

    python benchmarks/kill_trials.py --command recompute --samples 2000000 --per-file --trials 1 --root /work/x

Last line: ``RESULT command=... trials=N identical=K double_kills=D``.

``--sigint`` runs Ctrl-C trials instead (issue 48): SIGINT to each command's whole process group, as a terminal
sends it, at a few points spread over its uninterrupted wall time (``--points``, at k/(points+1) of it); each
command's own services (a local Ray cluster, Prefect's ephemeral server) are started as a user's are. A trial
measures the seconds from the SIGINT to the command's exit and checks exit status 130, exactly one line on the
console after the interrupt (``interrupted: ...``, what is committed and how to resume), no traceback and no log
record, and that nothing is half-written (a table folder or a checkpoint folder without its manifest, outside the
commit protocol's temporary folders); then runs the command that line names and compares its tables (a checkpoint's
weights) with the uninterrupted run's. The commands: the five above and ``stage`` (``rollflow stage
response_rewards`` with another normalization, on a recompute made first); train is the heavy one (the default model,
vLLM and DeepSpeed), so the default leaves it out.

    python benchmarks/kill_trials.py --sigint --commands recompute,score,stage,rollout,train-step --points 2

Last line: ``RESULT sigint commands=... sigint_trials=N sigint_max_exit_s=S sigint_exit_130=K sigint_one_line=K
sigint_half_written=K sigint_resumed_identical=K``.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def rollflow(*args: str) -> list[str]:
    return [sys.executable, "-m", "flows.cli", *args]


def prepare(command: str, root: Path, samples_rows: int = 4000) -> tuple[list[str], list[str]]:
    """(the command's arguments without --output, the table folders it commits under its output)."""
    if command == "score":
        responses = root / "responses"
        subprocess.run(rollflow("rlvr-example", "--output", str(responses), "--limit", "3"), check=True, cwd=REPO,
                       capture_output=True)
        return (["score", "--input", str(responses), "--config", "configs/rlvr_mixed.yaml", "--advantages"],
                ["scored", "samples", "rewarded", "advantaged"])
    if command == "recompute":
        samples = root / "samples"
        subprocess.run(rollflow("example", "--output", str(samples), "--samples", str(samples_rows), "--seed", "1"),
                       check=True, cwd=REPO, capture_output=True)
        return (["recompute", "--input", str(samples), "--config", "configs/recompute_gigpo.yaml", "--set",
                 "runtime.batch_rows=200"], ["rewarded", "advantaged"])
    if command == "rollout":
        from stages.generation.model_store import tiny_random_model_dir

        sets = ["engine.backend=hf", "engine.options={}", "engine.dtype=float32", "env.num_env_groups=2",
                "env.group_size=2", "env.max_steps=3", "generating_args.max_new_tokens=8"]
        args = ["rollout", "--config", "configs/rollout_frozenlake.yaml", "--checkpoint", str(tiny_random_model_dir())]
        for item in sets:
            args += ["--set", item]
        return args, ["episodes", "samples"]
    if command == "stage":
        base = root / "base"
        samples = root / "samples"
        subprocess.run(rollflow("example", "--output", str(samples), "--samples", str(samples_rows), "--seed", "1"),
                       check=True, cwd=REPO, capture_output=True)
        subprocess.run(rollflow("recompute", "--input", str(samples), "--config", "configs/recompute_gigpo.yaml",
                                "--set", "runtime.batch_rows=200", "--output", str(base)), check=True, cwd=REPO,
                       capture_output=True)
        return (["stage", "response_rewards", "--from", str(base / "rewarded"), "--set",
                 "reward_normalization.method=mean"], ["."])
    if command == "train-step":
        from stages.generation.model_store import tiny_random_model_dir
        from tests.train.tables import advantaged_rows, write_table

        samples = write_table(advantaged_rows(48, lengths=(6, 40), seed=7, multi_turn=True), root / "advantaged",
                              parts=3)
        config = root / "train.yaml"
        config.write_text("adv_estimator: grpo\nppo_epochs: 2\nactor_train:\n  training_args:\n"
                          "    learning_rate: 1.0e-3\n    per_device_train_batch_size: 4\n"
                          "  max_tokens_per_microbatch_in_train: 64\n")
        return (["train-step", "--samples", str(samples), "--checkpoint", str(tiny_random_model_dir()), "--config",
                 str(config)], [])
    if command == "train":
        per_iteration = ["rollout/samples", "logprobs", "rewarded", "advantaged", "eval/samples"]
        return (["train", "--config", "configs/train_frozenlake_quickstart.yaml", "--no-report"],
                [f"{RUN}/{t}" for t in ["eval_base/samples"] + [f"iter_{k:04d}/{t}" for k in (0, 1)
                                                                for t in per_iteration]])
    raise SystemExit(f"unknown command {command}")


def half_written(output: Path) -> list[Path]:
    """The table folders (Parquet files) and checkpoint folders (safetensors) under ``output`` without a manifest,
    outside the commit protocol's temporary folders (``.<name>.tmp-*``, removed by the next run) and a run's
    ``metrics`` folder (beside its config.json), whose parts are each renamed into place whole (stages/metrics.py) and
    which has no manifest in an uninterrupted run either."""
    folders = {p.parent for pattern in ("*.parquet", "*.safetensors") for p in output.rglob(pattern)}
    return sorted(f for f in folders if not any(part.startswith(".") for part in f.relative_to(output.parent).parts)
                  and not (f / "manifest.json").exists()
                  and not (f.name == "metrics" and (f.parent / "config.json").exists()))


RUN = "quickstart"  # every trial's run has the same name (it is part of every row id), in its own runs_dir


def command_line(args: list[str], output: Path) -> list[str]:
    """The command writing into ``output``: a training run is ``output/quickstart`` (``runs_dir`` = ``output``; a
    second call resumes it: the same config is the same run), other commands take ``--output``."""
    if args[0] == "train":
        return rollflow(*args, "--set", f"runs_dir={output}", "--set", f"run_name={RUN}")
    return rollflow(*args, "--output", str(output))


def same_weights(a: Path, b: Path) -> bool:
    """The safetensors weights of two checkpoint folders are equal, bit for bit."""
    import torch

    from stages.train.checkpoint import load_weights

    x, y = load_weights(str(a)), load_weights(str(b))
    return bool(x) and x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def run(args: list[str], output: Path, env: dict, kill_after: float | None) -> tuple[int, float]:
    """Run ``rollflow ARGS --output OUTPUT``; with ``kill_after`` SIGKILL its process group after that many seconds
    (if it is still running). Returns (exit status, seconds)."""
    start = time.monotonic()
    with open(output.parent / f"{output.name}.log", "a") as log:
        proc = subprocess.Popen(command_line(args, output), cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the group (Ray, Prefect) gone before the next attempt
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.5)
    return proc.returncode, time.monotonic() - start


def read(folder: Path):
    import pyarrow.dataset as pads

    table = pads.dataset(sorted(str(p) for p in folder.glob("*.parquet")), format="parquet").to_table()
    key = "row_id" if "row_id" in table.column_names else table.column_names[0]
    return table.sort_by(key)


def same(a, b) -> bool:
    if a.num_rows != b.num_rows or a.column_names != b.column_names:
        return False
    for name in a.column_names:
        x, y = a.column(name).to_pylist(), b.column(name).to_pylist()
        if x == y:
            continue
        try:
            fx = np.concatenate([np.ravel(np.asarray(v, dtype=float)) for v in x])
            fy = np.concatenate([np.ravel(np.asarray(v, dtype=float)) for v in y])
        except (TypeError, ValueError):
            return False
        if fx.shape != fy.shape or not np.allclose(fx, fy, rtol=1e-5, atol=1e-5, equal_nan=True):
            return False
    return True


def file_digests(folder: Path) -> list[tuple[str, int, str]]:
    """(name, rows, SHA-256 of the Arrow IPC stream of its table) of each Parquet file of ``folder``, in name order;
    one file in memory at a time."""
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    out = []
    for path in sorted(folder.glob("*.parquet")):
        table = pq.read_table(path).combine_chunks()
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        out.append((path.name, table.num_rows, hashlib.sha256(sink.getvalue()).hexdigest()))
        del table, sink
    return out


def interrupt(args: list[str], output: Path, env: dict, after: float) -> dict:
    """Run the command into ``output`` and SIGINT its whole process group after ``after`` seconds (if it is still
    running). Returns its exit status, the seconds from the SIGINT to its exit (None: it ended first; a command
    that outlives the SIGINT by 120 s is SIGKILLed, status None), and what it printed after the SIGINT."""
    out_log, err_log = output.parent / f"{output.name}.stdout", output.parent / f"{output.name}.stderr"
    with open(out_log, "w") as out, open(err_log, "w") as err:
        proc = subprocess.Popen(command_line(args, output), cwd=REPO, env=env, stdout=out, stderr=err,
                                start_new_session=True)
        exit_s = None
        try:
            proc.wait(timeout=after)
        except subprocess.TimeoutExpired:
            printed = out_log.stat().st_size, err_log.stat().st_size
            os.killpg(proc.pid, signal.SIGINT)
            sent = time.monotonic()
            try:
                proc.wait(timeout=120)
                exit_s = time.monotonic() - sent
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        else:
            printed = None
        _wait_group(proc.pid)
    after_out = out_log.read_text()[printed[0]:] if printed else ""
    after_err = err_log.read_text()[printed[1]:] if printed else ""
    return {"rc": proc.returncode if exit_s is not None or printed is None else None, "exit_s": exit_s,
            "printed": after_out + after_err, "stderr": after_err}


def _wait_group(pgid: int, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)


def resume_command(line: str) -> list[str]:
    """The command the interrupted command's line names (``... resume with rollflow ARGS``), as an argv."""
    words = shlex.split(line.rsplit("resume with ", 1)[1])
    assert words[0] == "rollflow", line
    return rollflow(*words[1:])


def sigint_trials(names: list[str], points: int, root: Path, env: dict, samples_rows: int = 4000) -> None:
    """The Ctrl-C trials of each command in ``names`` at ``points`` points; prints a table and the RESULT line."""
    print(f"{'command':<10} {'SIGINT at (s)':>13} {'rc':>4} {'exit (s)':>9} {'one line':>9} {'half-written':>12} "
          f"{'resume rc':>10} {'identical':>10}")
    rows = []
    for name in names:
        work = root / name
        work.mkdir()
        command, tables = prepare(name, work, samples_rows)
        rc, wall = run(command, work / "reference", env, None)
        if rc != 0:
            raise SystemExit(f"{name}: the uninterrupted run failed (rc {rc}); see {work / 'reference.log'}")
        reference = {t: read(work / "reference" / t) for t in tables}
        for k in range(1, points + 1):
            at = wall * k / (points + 1)
            out = work / f"sigint{k}"
            trial = interrupt(command, out, env, at)
            if trial["exit_s"] is None and trial["rc"] is not None:
                print(f"{name:<10} {at:>13.1f} finished before the interrupt")
                continue
            lines = trial["stderr"].splitlines()
            one_line = (len(lines) == 1 and lines[0].startswith("interrupted: ") and
                        trial["printed"].strip() == lines[0])  # so no traceback, no log record either
            partial = half_written(out) if out.exists() else []
            resumed_rc = None
            if lines and "resume with " in lines[-1]:
                argv = resume_command(lines[-1])
                with open(work / f"sigint{k}.resume.log", "w") as log:
                    resumed_rc = subprocess.run(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                start_new_session=True).returncode
            ok = resumed_rc == 0 and all((out / t / "manifest.json").exists() and same(read(out / t), reference[t])
                                         for t in tables)
            if name == "train" and ok:
                last = f"{RUN}/iter_0001/checkpoint"
                ok = same_weights(out / last, work / "reference" / last)
            if name == "train-step" and ok:
                ok = (out / "manifest.json").exists() and same_weights(out, work / "reference")
            rows.append((trial["rc"], trial["exit_s"], one_line, ok, len(partial)))
            exit_s = f"{trial['exit_s']:.1f}" if trial["exit_s"] is not None else "-"
            print(f"{name:<10} {at:>13.1f} {str(trial['rc']):>4} {exit_s:>9} {str(one_line):>9} {len(partial):>12} "
                  f"{str(resumed_rc):>10} {str(ok):>10}" + (f"  half-written: {partial}" if partial else ""))
    exits = [r[1] for r in rows if r[1] is not None]
    print(f"RESULT sigint commands={','.join(names)} sigint_trials={len(rows)} "
          f"sigint_max_exit_s={max(exits) if exits else float('nan'):.1f} "
          f"sigint_exit_130={sum(r[0] == 130 for r in rows)} sigint_one_line={sum(r[2] for r in rows)} "
          f"sigint_half_written={sum(r[4] for r in rows)} sigint_resumed_identical={sum(r[3] for r in rows)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--command", default="score", choices=["score", "recompute", "rollout", "train"])
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sigint", action="store_true", help="Ctrl-C trials (SIGINT to the process group) of "
                                                             "--commands instead of SIGKILL trials of --command")
    parser.add_argument("--commands", default="recompute,score,stage,rollout,train-step",
                        help="--sigint: comma-separated, of score, recompute, rollout, stage, train-step, train")
    parser.add_argument("--points", type=int, default=2, help="--sigint: interrupts per command")
    parser.add_argument("--samples", type=int, default=4000, help="rows of the generated set (recompute, stage)")
    parser.add_argument("--per-file", action="store_true", help="compare file by file by digests, deleting each "
                                                                "output once compared (large sets)")
    parser.add_argument("--root", type=Path, default=None, help="folder to work in (default: a new temporary one)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="recompute: a config override for the command (repeatable), e.g. "
                             "runtime.data_memory_mb=64 to run the rewards step in partitions")
    args = parser.parse_args()
    if args.per_file and (args.sigint or args.command == "train"):
        parser.error("--per-file compares the tables of SIGKILL trials of score, recompute or rollout; a train "
                     "trial also compares its checkpoint, which the deletion would remove")
    rng = random.Random(args.seed)
    prefix = f"rollflow-{'sigint' if args.sigint else 'kill-' + args.command}-"
    if args.root:
        args.root.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=prefix, dir=args.root))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PREFECT_API_URL")}
    env.update({"PREFECT_HOME": str(root / "prefect"), "RAY_USAGE_STATS_ENABLED": "0", "PYTHONHASHSEED": "0"})
    if args.sigint:
        print(f"work in {root}")
        env["PYTHONUNBUFFERED"] = "1"  # what a command printed before the SIGINT is in its files by then
        sigint_trials([c.strip() for c in args.commands.split(",") if c.strip()], args.points, root, env,
                      args.samples)
        return
    command, tables = prepare(args.command, root, args.samples)
    for item in args.set if args.command == "recompute" else []:
        command += ["--set", item]
    rc, wall = run(command, root / "reference", env, None)
    if rc != 0:
        raise SystemExit(f"the uninterrupted run failed (rc {rc}); see {root / 'reference.log'}")
    load = file_digests if args.per_file else read
    reference = {t: load(root / "reference" / t) for t in tables}
    if args.per_file:
        shutil.rmtree(root / "reference")
    print(f"{args.command}: uninterrupted run {wall:.0f} s; tables {', '.join(tables)}; work in {root}")
    print(f"{'trial':>5} {'kills at (s)':>16} {'rerun rc':>9} {'identical':>10}")
    identical = doubles = 0
    for trial in range(args.trials):
        out = root / f"trial{trial}"
        kills = [rng.uniform(0, wall)]
        if rng.random() < 0.5:  # two kills in a row: the rerun itself is killed once more
            kills.append(rng.uniform(0, wall))
            doubles += 1
        for delay in kills:
            run(command, out, env, delay)
        rc, _ = run(command, out, env, None)
        if args.per_file:
            ok = rc == 0 and all((out / t / "manifest.json").exists() and file_digests(out / t) == reference[t]
                                 for t in tables)
            shutil.rmtree(out, ignore_errors=True)
        else:
            ok = rc == 0 and all((out / t / "manifest.json").exists() and same(read(out / t), reference[t])
                                 for t in tables)
        if args.command == "train":  # and the trained policy: the last checkpoint's weights, bit for bit
            last = f"{RUN}/iter_0001/checkpoint"
            ok = ok and same_weights(out / last, root / "reference" / last)
        identical += ok
        print(f"{trial:>5} {' + '.join(f'{k:.1f}' for k in kills):>16} {rc:>9} {str(ok):>10}")
    print(f"RESULT command={args.command} trials={args.trials} identical={identical} double_kills={doubles}")


if __name__ == "__main__":
    main()
