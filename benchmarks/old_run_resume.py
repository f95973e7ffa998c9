"""A run folder written before the stage and pipeline declarations (commit d423def) resumes with the new code with
every stage skipped (issue 43: "a run folder written before the change resumes after it").

For each pipeline (rlvr, agentic; --pipelines picks): ``rollflow train`` of a tiny two-step run (the configs of
tests/trainflow: the tiny random model, HF engine; RLVR with a validation, agentic with an evaluation each step) by
the code at --old-commit (a git worktree at --old-tree, imported through PYTHONPATH), then ``rollflow train --resume``
of that folder by this checkout's code. A pipeline passes when the resume exits 0, rewrites no manifest (every
manifest.json's bytes and mtime as the old code left them: each stage's fingerprint, computed by the new code, equals
the one the old code recorded, so the runner skipped it) and adds no output folder. Too heavy for the test suite (two
DeepSpeed runs per pipeline, minutes of CPU): run it under the heavy lock,

    flock /tmp/rollflow-heavy.lock timeout 1800 $PY benchmarks/old_run_resume.py

Last line: RESULT old_run_resume pipelines=... resumed_exit0=... manifests_unchanged=... no_new_outputs=...
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OLD_COMMIT = "d423def"


def _tiny_model() -> str:
    sys.path.insert(0, str(REPO))
    from stages.generation.model_store import tiny_random_model_dir

    return str(tiny_random_model_dir())


def _args(pipeline: str, runs_dir: Path, model: str) -> list[str]:
    """``rollflow train`` arguments of the tiny two-step runs tests/trainflow runs (run_name r). RLVR's prompts are
    read from a copy of the shipped ones beside the runs (``<runs_dir>/data``): a prompts section records its
    data_dir, which by default is the checkout's own data/rlvr, so two checkouts would differ there while a user who
    upgrades in place keeps the same folder."""
    common = ["--set", "run_name=r", "--set", f"runs_dir={runs_dir}", "--set", "max_steps=2",
              "--set", f"pretrain={model}", "--set", "train.actor_train.model_args.dtype=fp32"]
    if pipeline == "rlvr":
        data = runs_dir / "data"
        if not data.exists():
            shutil.copytree(REPO / "data/rlvr", data)
        return ["train", "--config", "configs/rlvr_train_math.yaml", *common, "--set", "engine.backend=hf",
                "--set", f"prompts.data_dir={data}", "--set", f"validation.prompts.data_dir={data}",
                "--set", "engine.options={}", "--set", "rollout_batch_size=2",
                "--set", "num_return_sequences_in_group=2", "--set", "generating_args.max_new_tokens=8",
                "--set", "train.actor_train.training_args.per_device_train_batch_size=2",
                "--set", "validation.eval_steps=2", "--set", "validation.prompts.limit=2"]
    return ["train", "--config", "configs/train_frozenlake_grpo.yaml", *common,
            "--set", "rollout.engine.backend=hf", "--set", "rollout.engine.options={}",
            "--set", "rollout.engine.dtype=float32", "--set", "rollout.env.num_env_groups=2",
            "--set", "rollout.env.group_size=2", "--set", "rollout_batch_size=4", "--set", "rollout.env.max_steps=2",
            "--set", "rollout.generating_args.max_new_tokens=8", "--set", "eval.num_env_groups=2",
            "--set", "eval.group_size=1", "--set", "eval.eval_steps=1", "--set", "train.max_ckpt_to_keep=1",
            "--set", "reward_normalization.method=identity", "--set", "train.actor_train.model_args.lora_rank=4",
            "--set", "train.actor_train.model_args.lora_target_modules=[q_proj,v_proj]"]


def _rollflow(code: Path, args: list[str]) -> subprocess.CompletedProcess:
    """``python -m flows.cli ARGS`` with ``code`` first on the import path, run in ``code`` (its configs/)."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    done = subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=code, env=env, capture_output=True,
                          text=True)
    print(f"  [{code.name}] rollflow {' '.join(args[:3])} ... -> exit {done.returncode}", flush=True)
    if done.returncode != 0:
        print(done.stdout[-3000:], done.stderr[-3000:], sep="\n", flush=True)
    return done


def _manifests(run: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(run)): (p.read_bytes(), p.stat().st_mtime_ns) for p in run.rglob("manifest.json")}


def _folders(run: Path) -> set[str]:
    return {str(p.relative_to(run)) for p in run.rglob("*") if p.is_dir() and not p.name.startswith(".")
            and "metrics" not in p.parts}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipelines", default="rlvr,agentic")
    parser.add_argument("--old-commit", default=OLD_COMMIT)
    parser.add_argument("--old-tree", default="/tmp/old")
    parser.add_argument("--work", default=None, help="where the runs go (default: a new temporary folder)")
    opts = parser.parse_args()
    old = Path(opts.old_tree)
    if not old.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(old), opts.old_commit], check=True)
    work = Path(opts.work or tempfile.mkdtemp(prefix="old_run_resume_"))
    model = _tiny_model()
    results = {"resumed_exit0": [], "manifests_unchanged": [], "no_new_outputs": []}
    pipelines = opts.pipelines.split(",")
    for pipeline in pipelines:
        runs = work / pipeline
        print(f"{pipeline}: the old code ({opts.old_commit}) writes {runs / 'r'}", flush=True)
        if _rollflow(old, _args(pipeline, runs, model)).returncode != 0:
            for key in results:
                results[key].append(False)
            continue
        run = runs / "r"
        before, folders = _manifests(run), _folders(run)
        print(f"  {len(before)} manifests written", flush=True)
        again = _rollflow(REPO, ["train", "--resume", str(run), "--no-report"])
        after = _manifests(run)
        changed = sorted(k for k in before if after.get(k) != before[k])
        new = sorted(_folders(run) - folders)
        print(f"  resumed by the new code: exit {again.returncode}, {len(changed)} manifest(s) rewritten "
              f"{changed[:5]}, new folders {new[:5]}", flush=True)
        results["resumed_exit0"].append(again.returncode == 0)
        results["manifests_unchanged"].append(not changed and set(after) == set(before))
        results["no_new_outputs"].append(not new)
    summary = " ".join(f"{k}={sum(v)}/{len(v)}" for k, v in results.items())
    print(f"RESULT old_run_resume pipelines={','.join(pipelines)} {summary}", flush=True)
    return 0 if all(all(v) for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
