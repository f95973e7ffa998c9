"""``rollflow score`` (offline scoring of stored responses, optionally the whole RLVR chain) and
``rollflow rlvr-example`` (a responses table from data/rlvr with hand-written answers). 
The stages run through the one runner (``flows.rlvr.score_responses``, shared with the RLVR training flow):
a re-run with the same input and config skips, a changed config needs ``--force`` or another output folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from flows.cli.app import app
from flows.cli.common import OverrideOpt, connect, fail as _fail, guard as _guard

# Each command imports what it runs inside its function (config models: pydantic; tables: pyarrow; flows: Prefect;
# Ray; torch), so `rollflow --help` and every command load their own libraries only (CONTRIBUTING.md, imports).


def score_summary(input_dir: str, scored_dir: str, domain_column: str) -> list[str]:
    """Per-domain lines: rows, unscored rows, mean score, worker(s)."""
    import numpy as np
    import pyarrow.dataset as pads

    from stages.storage import Location

    def read(where: str, columns: list[str]):
        loc = Location.of(where)
        return pads.dataset(loc.parquet_files(), filesystem=loc.fs).to_table(columns=columns)

    responses = read(input_dir, ["row_id", domain_column])
    scored = read(scored_dir, ["row_id", "scores", "reward_worker"])
    by_id = dict(zip(scored.column("row_id").to_pylist(), zip(scored.column("scores").to_pylist(),
                                                               scored.column("reward_worker").to_pylist())))
    lines = [f"{domain_column:<14} {'rows':>7} {'unscored':>9} {'mean score':>11}  worker"]
    domains = responses.column(domain_column).to_pylist()
    for domain in dict.fromkeys(domains):
        ids = [i for i, d in zip(responses.column("row_id").to_pylist(), domains) if d == domain]
        values = [by_id[i][0] for i in ids]
        valid = np.array([v for v in values if v is not None], dtype=np.float64)
        workers = sorted({by_id[i][1] for i in ids})
        mean = f"{valid.mean():.3f}" if valid.size else "-"
        lines.append(f"{str(domain):<14} {len(ids):>7,} {values.count(None):>9,} {mean:>11}  {', '.join(workers)}")
    return lines


def _with_judge(cfg, judge_model: Path | None, backend: str | None):
    """``cfg`` with the judge model / engine backend given on the command line (they win over the config's)."""
    judge = cfg.judge
    if judge_model is not None:
        judge = judge.model_copy(update={"model": str(judge_model)})
    if backend is not None:
        judge = judge.model_copy(update={"engine": judge.engine.model_copy(update={"backend": backend})})
    return cfg.model_copy(update={"judge": judge})


@app.command()
def score(input: Path = typer.Option(..., "--input", help="Folder of stored responses (a responses table)."),
          config: Path = typer.Option(..., "--config", help="YAML config (configs/rlvr_*.yaml)."),
          output: Path = typer.Option(..., "--output", help="Folder for scored/ (and samples/, rewarded/, advantaged/)."),
          overrides: Optional[list[str]] = OverrideOpt,
          advantages: bool = typer.Option(False, "--advantages", help="Also run the RLVR chain: sample masks, "
                                                                      "normalised rewards, token rewards and "
                                                                      "advantages (the training table)."),
          force: bool = typer.Option(False, "--force", help="Recompute even if outputs are up to date."),
          judge_model: Optional[Path] = typer.Option(None, "--judge-model", help="HF checkpoint of the LLM judge "
                                                                                 "(default: the config's judge.model, "
                                                                                 "else the default model)."),
          judge_backend: Optional[str] = typer.Option(None, "--judge-backend", help="Engine of the judge: vllm or hf "
                                                                                    "(default: judge.engine.backend)."
                                                      )) -> None:
    """Score stored responses with the reward workers of the config (offline), optionally up to advantages. An
    llm_judge route runs its judge model in a generation engine started here."""
    from schemas.config import load_config, parse_overrides
    from schemas.rlvr_config import RLVRConfig

    if judge_backend not in (None, "vllm", "hf"):
        _fail(ValueError(f"--judge-backend {judge_backend!r} must be vllm or hf"))
    cfg = _guard(lambda: load_config(RLVRConfig, config, parse_overrides(overrides or [])))
    from stages.rlvr.generate import check_judge_read, needs_model

    flags = tuple(flag for flag, value in (("--judge-model", judge_model), ("--judge-backend", judge_backend))
                  if value is not None)
    _guard(lambda: check_judge_read(cfg.judge, {"rewards": cfg.rewards}, flags))  # a judge that nothing would read
    from flows.rlvr import score_steps
    from stages.preflight import check_command_output, check_steps

    steps = score_steps(str(input), str(output), cfg, advantages=advantages)
    _guard(lambda: check_command_output("rollflow score", str(output), steps, {"--input": str(input)}))
    _guard(lambda: check_steps(steps))  # before Ray starts
    if advantages:  # the chain's groups, on the input: before its first stage commits
        from stages.rlvr.stages import check_response_groups

        _guard(lambda: check_response_groups(str(input), cfg.rewards.domain_column, cfg.num_return_sequences_in_group))
    cfg = _with_judge(cfg, judge_model, judge_backend)
    if needs_model(cfg.rewards):
        from stages.generation.engines import check_engine_options

        _guard(lambda: check_engine_options(cfg.judge.engine.backend, cfg.judge.engine.options, "judge.engine.options"))
    connect(cfg.runtime)
    from flows.rlvr import score_responses
    from stages.rlvr.generate import judge_pool, judge_services

    pool = _guard(lambda: judge_pool(cfg.judge)) if needs_model(cfg.rewards) else None
    try:
        services = judge_services(cfg.rewards, cfg.judge, pool)
        results = _guard(lambda: score_responses(str(input), str(output), cfg, advantages=advantages, force=force,
                                                 services=services))
    finally:
        if pool is not None:
            pool.close()
    for name, r in results.items():
        state = "up to date, skipped" if r.skipped else f"computed in {r.seconds:.1f}s"
        typer.echo(f"{name:<14} {r.output}  ({r.rows:,} rows, {state})")
    typer.echo("")
    for line in _guard(lambda: score_summary(str(input), results["scored"].output, cfg.rewards.domain_column)):
        typer.echo(line)
    if "advantaged" in results:
        m = {**results["rewarded"].metrics, **results["advantaged"].metrics}
        typer.echo("")
        for key in ("actor/samples_used", "actor/samples_total", "actor/final_mask_tokens", "critic/kl",
                    "critic/kl_coef", "critic/advantages/mean"):
            if key in m:
                typer.echo(f"  {key:<26} {m[key]:.6g}")


@app.command("rlvr-example")
def rlvr_example(output: Path = typer.Option(..., "--output", help="New folder for the responses table."),
                 samples_per_prompt: int = typer.Option(8, "--samples-per-prompt", min=1, help="Responses per prompt (n)."),
                 limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Prompts per domain (default: "
                                                                                   "all)."),
                 domains: str = typer.Option("math,code,mcq,ifeval", "--domains", help="Comma-separated domains."),
                 seed: int = typer.Option(0, "--seed", min=0, help="Seed of the answers drawn.")) -> None:
    """Write a responses table from data/rlvr with hand-written correct/incorrect/garbage answers (no model)."""
    from stages.rlvr.example import RLVRExampleSpec, write_rlvr_example

    names = tuple(d.strip() for d in domains.split(",") if d.strip())
    from stages.outputs import check_output

    from stages.storage import Location

    if not _guard(lambda: Location.of(str(output)).exists()):
        _guard(lambda: check_output(str(output), None))  # not inside a committed table (an existing folder: the writer)
    try:
        manifest = write_rlvr_example(RLVRExampleSpec(domains=names, n=samples_per_prompt, limit=limit, seed=seed),
                                      str(output))
    except (ValueError, FileExistsError) as err:
        _fail(err)
    kinds = ", ".join(f"{v} {k}" for k, v in manifest["kinds"].items())
    typer.echo(f"wrote {manifest['rows']:,} responses to {manifest['prompts']} prompts ({kinds}) to {output}")
