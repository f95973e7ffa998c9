"""The first stages of the RLVR training flow: the prompts table, and responses generated for one step's prompts.

* :class:`PromptsStage` (no input) — ``<data_dir>/<domain>.jsonl`` → the ``prompts`` table (one row per prompt:
  ``prompt_id, domain, tag, prompt, ground_truth``). Its fingerprint covers the files' bytes.
* :class:`GenerateStage` — ``prompts`` → ``responses`` (:data:`schemas.rlvr_tables.RESPONSES`): for the prompt ids
  of one step, ``n`` samples each from the engine pool's actors (chat template over the system prompt and the prompt
  text, seeded per prompt and step, so a re-run reproduces the same responses on the same engine). The engine's
  per-token log-probs land in ``infer_logprobs``.

Which prompts a step uses is :func:`step_prompt_ids`: a seeded permutation of the data set per epoch, cut into
batches of ``rollout_batch_size`` (ROLL iterates a shuffled dataloader the same way).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
from pydantic import Field

import stages.rewards  # noqa: F401  (registers the built-in workers)
from schemas.config import Frozen, options_set
from schemas.errors import ConfigError
from schemas.rlvr_tables import RESPONSES
from schemas.rollout_config import EngineIdentity, GeneratingArgs
from schemas.tables import TableSpec
from stages.generation.engines import SamplingSpec
from stages.partials import read_partials, sum_partials, write_partials
from stages.rewards.registry import required_services, resolve_worker, run_context
from stages.rlvr.example import DATA_DIR, row_id
from stages.rollout.driver import pool_source, resolve_model_dir
from stages.rollout.engine_pool import EnginePool
from stages.rollout.stages import EngineStage
from stages.stage import Stage, StageContext
from stages.storage import Location, read_manifest

CHECKOUT = DATA_DIR.parents[1]  # the repository the shipped data set lies in

PROMPTS = TableSpec(name="prompts", required={"prompt_id": pa.string(), "domain": pa.string(), "tag": pa.string(),
                                              "prompt": pa.string(), "ground_truth": pa.string()})


class PromptsSection(Frozen):
    data_dir: str = Field(..., description="Folder of the JSONL files: relative to the checkout when it lies inside "
                                           "it (the shipped data/rlvr), so a run folder resumes from a moved clone; "
                                           "else absolute (:func:`prompts_dir` reads it).")
    domains: tuple[str, ...] = Field(..., description="The domains read, one <domain>.jsonl each.")
    limit: int | None = Field(..., description="Prompts read per domain (None: all).")
    digest: str = Field(..., description="SHA-256 over the JSONL files read.")


def recorded_dir(folder: Path) -> str:
    """How a prompts section records ``folder``: relative to the checkout (``data/rlvr``) when it lies inside it, so
    the record names the same files from a clone elsewhere; else its absolute path."""
    where = folder.resolve()
    return where.relative_to(CHECKOUT).as_posix() if where.is_relative_to(CHECKOUT) else str(where)


def prompts_dir(data_dir: str) -> Path:
    """The folder a section's ``data_dir`` names: a relative one lies in this checkout (:func:`recorded_dir`); an
    absolute one (what run folders of earlier versions recorded) as it is."""
    path = Path(data_dir)
    return path if path.is_absolute() else CHECKOUT / path


def prompts_section(data_dir: str | None, domains: tuple[str, ...], limit: int | None,
                    field: str = "prompts") -> PromptsSection:
    """The section of :class:`PromptsStage`; refuses missing files with the list of what exists, and files that hold
    no prompt or a line that is not one (:func:`read_prompt_rows`: the rows the stage will read), so that the
    pre-flight finds them before Ray starts (``field``: the config section of the prompt set, for the message)."""
    folder = Path(data_dir) if data_dir else DATA_DIR
    h = hashlib.sha256()
    for domain in domains:
        path = folder / f"{domain}.jsonl"
        if not path.is_file():
            have = sorted(p.stem for p in folder.glob("*.jsonl")) if folder.is_dir() else []
            raise ConfigError(f"{field}: {path} does not exist; {field}.domains must name JSONL files in "
                              f"{folder} (found: {', '.join(have) or 'none'})")
        h.update(path.read_bytes())
    section = PromptsSection(data_dir=recorded_dir(folder), domains=tuple(domains), limit=limit, digest=h.hexdigest())
    read_prompt_rows(section, field, folder)
    return section


def resumed_section(section: PromptsSection, output: str) -> PromptsSection:
    """The section the prompts table committed at ``output`` recorded, when it read the same files (digest, domains,
    limit) from another place: a run folder whose checkout moved, or written by an earlier version with the absolute
    path of the shipped data, resumes with its own record (the same fingerprint) instead of being refused as
    written with another config. ``section`` otherwise."""
    manifest = read_manifest(Location.of(output))
    recorded = (manifest or {}).get("section")
    if manifest is None or manifest.get("stage") != PromptsStage.name or not isinstance(recorded, dict):
        return section
    try:
        old = PromptsSection.model_validate(recorded)
    except ValueError:  # not a prompts section of this version: the runner refuses the folder with its message
        return section
    same_files = old.model_copy(update={"data_dir": section.data_dir}) == section
    return old if same_files else section


def _prompt_lines(path: Path, field: str) -> list[str]:
    """The non-blank lines of the prompt file ``path``; a ConfigError when it is not UTF-8 or holds none."""
    try:
        lines = [ln for ln in path.read_bytes().decode("utf-8").splitlines() if ln.strip()]
    except UnicodeDecodeError as err:
        raise ConfigError(f"{field}: prompts file {path} is not UTF-8 text (offset {err.start}); a prompts file is "
                          "JSONL, one JSON object per line: save it as UTF-8") from None
    if not lines:
        raise ConfigError(f"{field}: prompts file {path} holds no prompts; write one JSON object per line with id, "
                          f"prompt and ground_truth, or remove '{path.stem}' from {field}.domains")
    return lines


def read_prompt_rows(s: PromptsSection, field: str = "prompts", folder: Path | None = None) -> list[dict]:
    """The prompt rows of the section's files (in ``folder``, as the config named it, default the section's
    :func:`prompts_dir`); each line must be a JSON object with the PROMPTS fields."""
    rows, seen = [], set()
    for domain in s.domains:
        path = (folder or prompts_dir(s.data_dir)) / f"{domain}.jsonl"
        lines = _prompt_lines(path, field)[: s.limit]
        for number, line in enumerate(lines, 1):
            try:
                task = json.loads(line)
                if not isinstance(task, dict):
                    raise TypeError(f"the line holds {type(task).__name__}, not a JSON object")
                row = {"prompt_id": str(task["id"]), "domain": str(task.get("domain", domain)),
                       "tag": str(task.get("tag", domain)), "prompt": str(task["prompt"]),
                       "ground_truth": str(task["ground_truth"])}
            except (ValueError, KeyError, TypeError) as err:
                raise ConfigError(f"prompts file {path}, line {number}: {err!r}; each line must be a JSON object "
                                  "with id, prompt and ground_truth (domain and tag optional)") from None
            if row["prompt_id"] in seen:
                raise ConfigError(f"prompts file {path}, line {number}: id {row['prompt_id']!r} occurs twice; "
                                  "prompt ids must be unique across the data set")
            seen.add(row["prompt_id"])
            rows.append(row)
    return rows


class PromptsStage(Stage):
    """JSONL prompt files → the ``prompts`` table."""

    name = "rlvr_prompts"
    version = "1"
    output_spec = PROMPTS
    section_model = PromptsSection
    input_specs: dict = {}

    def build(self, ctx: StageContext):
        import ray.data

        rows = read_prompt_rows(ctx.section)
        schema = PROMPTS.arrow_schema()
        return ray.data.from_arrow(pa.Table.from_pylist(rows, schema=schema))


def step_prompt_ids(all_ids: list[str], step: int, batch: int, seed: int) -> list[str]:
    """The prompt ids of ``step``: batch ``step`` of a permutation seeded per epoch (batches never straddle
    epochs; the last partial batch of an epoch is dropped unless the data set is smaller than one batch)."""
    if not all_ids:
        raise ConfigError("the prompts table is empty; point prompts.data_dir/domains at non-empty JSONL files")
    per_epoch = max(1, len(all_ids) // batch)
    epoch, index = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(len(all_ids))
    return [all_ids[i] for i in order[index * batch:(index + 1) * batch]]


class GenerateSection(Frozen):
    run_name: str
    step: int
    seed: int
    n: int
    prompt_ids: tuple[str, ...]
    system_prompt: str
    sequence_length: int
    generating_args: GeneratingArgs
    engine: EngineIdentity


def _sampling(s: GenerateSection, prompt_id: str):
    """The sampling request of one prompt: ``n`` samples, seeded by (seed, step, prompt id)."""
    g = s.generating_args
    seed = int.from_bytes(hashlib.sha256(f"rlvr:{s.seed}:{s.step}:{prompt_id}".encode()).digest()[:4], "little")
    return SamplingSpec(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, max_new_tokens=g.max_new_tokens,
                        stop=g.stop, seed=seed & 0x7FFFFFFF, n=s.n)


def _response_rows(s: GenerateSection, prompts: list[dict], results) -> dict[str, list]:
    cols: dict[str, list] = {name: [] for name in [*RESPONSES.required, "infer_logprobs"]}
    for r in sorted(results, key=lambda r: (r.request_index, r.sample_index)):
        p = prompts[r.request_index]
        cols["row_id"].append(row_id("rlvr", s.run_name, s.step, p["prompt_id"], r.sample_index))
        for key in ("prompt_id", "domain", "tag", "prompt", "ground_truth"):
            cols[key].append(p[key])
        cols["response"].append(r.text)
        cols["prompt_ids"].append(list(r.prompt_token_ids))
        cols["response_ids"].append(list(r.response_token_ids))
        cols["finish_reason"].append(r.finish_reason)
        cols["infer_logprobs"].append(np.asarray(r.logprobs, np.float32))
    return cols


class GenerateStage(EngineStage):
    """``prompts`` → ``responses`` of one step: ``n`` samples per selected prompt from the pool's engines (``ticker``:
    responses generated)."""

    name = "rlvr_generate"
    version = "1"
    output_spec = RESPONSES
    section_model = GenerateSection
    input_specs = {"prompts": PROMPTS}

    def build(self, ctx: StageContext):
        s: GenerateSection = ctx.section
        ticker = self.ticker
        loc = ctx.inputs["prompts"]
        table = pads.dataset(loc.parquet_files(), filesystem=loc.fs).to_table()
        by_id = {row["prompt_id"]: row for row in table.to_pylist()}
        missing = [p for p in s.prompt_ids if p not in by_id]
        if missing:
            raise ConfigError(f"prompts table {loc.path} has no prompt(s) {missing[:3]}; regenerate the step's "
                              "prompt list from this table")
        chosen = pa.Table.from_pylist([by_id[p] for p in s.prompt_ids], schema=PROMPTS.arrow_schema())
        handles, output = self.pool.handles(), ctx.output
        schema = RESPONSES.arrow_schema(present=[*RESPONSES.required, "infer_logprobs"])

        def generate_batch(batch: pa.Table) -> pa.Table:
            import ray

            prompts = batch.to_pylist()
            if not prompts:
                return schema.empty_table()
            first = prompts[0]["prompt_id"]
            actor = handles[s.prompt_ids.index(first) % len(handles)]
            specs = [_sampling(s, p["prompt_id"]) for p in prompts]
            results, seconds = ray.get(actor.complete.remote(s.system_prompt, [p["prompt"] for p in prompts], specs,
                                                             s.sequence_length))
            cols = _response_rows(s, prompts, results)
            write_partials(output, first, {"rows": len(cols["row_id"]), "generate_seconds": seconds,
                                           "response_tokens": sum(len(x) for x in cols["response_ids"]),
                                           "truncated": sum(f == "length" for f in cols["finish_reason"])})
            if ticker is not None:
                ticker.add(len(cols["row_id"]))
            return pa.table({f.name: pa.array(cols[f.name], f.type) for f in schema}, schema=schema)

        return self.on_engines(chosen, math.ceil(chosen.num_rows / len(handles)), generate_batch)

    def finalize(self, ctx: StageContext, written: Location):
        total = sum_partials(read_partials(written))
        rows = total.get("rows", 0.0)
        seconds = total.get("generate_seconds", 0.0)
        return {"generate/responses": rows, "generate/response_tokens": total.get("response_tokens", 0.0),
                "generate/truncated_rate": total.get("truncated", 0.0) / rows if rows else 0.0,
                "generate/engine_seconds": seconds,
                "generate/tokens_per_second": total.get("response_tokens", 0.0) / seconds if seconds else 0.0}, {}


# ---- the LLM judge's generation service ----------------------------------------------------------------------------

class EngineGenerate:
    """A picklable factory of the ``generate(prompts) -> list[str | None]`` service the LLM judge needs, over the
    engine actors of an :class:`~stages.rollout.engine_pool.EnginePool` (Ray actor handles pickle). The reward
    stage calls it once inside each process that scores its batches; the callable sends chat completions (one
    sample each, greedy by default) to the engines and returns the texts in prompt order (``None`` for a prompt that
    does not fit)."""

    def __init__(self, handles: list, system_prompt: str = "", max_new_tokens: int = 64,
                 temperature: float = 0.0, sequence_length: int = 2048, seed: int = 0) -> None:
        self.handles, self.system_prompt = list(handles), system_prompt
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.sequence_length, self.seed = sequence_length, seed

    def __call__(self):
        return self.generate

    def generate(self, prompts: list[str]) -> list[str | None]:
        import ray

        spec = SamplingSpec(temperature=self.temperature, max_new_tokens=self.max_new_tokens, seed=self.seed)
        texts: list[str | None] = [None] * len(prompts)
        results, _ = ray.get(self.handles[0].complete.remote(self.system_prompt, list(prompts),
                                                             [spec] * len(prompts), self.sequence_length))
        for r in results:
            texts[r.request_index] = r.text
        return texts


def needs_model(rewards) -> bool:
    """Whether a route of ``rewards`` (a RewardsConfig) names a worker that calls a model (the LLM judge)."""
    return any("generate" in required_services(resolve_worker(r.worker)) for r in rewards.routes.values())


def _may_call_a_model(rewards) -> bool:
    """:func:`needs_model`, or True where a route's worker cannot be resolved (the routes' own check reports it; an
    unknown worker might call a model)."""
    try:
        return needs_model(rewards)
    except ConfigError:
        return True


def check_judge_read(judge, routes: dict, flags: tuple[str, ...] = ()) -> None:
    """Refuse an LLM judge that nothing reads: options set in ``judge`` (a JudgeConfig; only those the config names,
    :func:`schemas.config.options_set`) or command-line ``flags`` for it (``--judge-model``), while no route of
    ``routes`` (config section -> RewardsConfig: every route set the command's config can score with) names a
    worker that calls a model. A ConfigError naming them, the routes' workers and the fix."""
    given = [*flags, *options_set(judge, "judge.")]
    if not given or any(_may_call_a_model(r) for r in routes.values()):
        return
    workers = "; ".join(f"{field}: " + ", ".join(f"{domain} -> {r.worker}" for domain, r in rewards.routes.items())
                        for field, rewards in routes.items())
    verb = "is" if len(given) == 1 else "are"
    raise ConfigError(f"{', '.join(given)} {verb} set, but no reward route calls a model (routes of {workers}), so "
                      "nothing reads the LLM judge's settings; remove them, or route a domain to the judge (e.g. "
                      f"{next(iter(routes))}.routes.<domain>: {{worker: llm_judge}})")


def reads_context(rewards, name: str) -> bool:
    """Whether a route of ``rewards`` names a worker that reads the run-time context value ``name`` (e.g. the
    detection worker's ``training_progress``). A run passes the value only then, so the reward stage's fingerprint
    changes only where the value changes its scores."""
    return any(name in run_context(resolve_worker(r.worker)) for r in rewards.routes.values())


def judge_pool(judge):
    """An engine pool over the judge model of ``judge`` (a JudgeConfig), for the routes that need a model
    (:func:`needs_model`); the caller closes it. The judge has its own engine: it is never the policy being trained."""
    check_judge_cpus(judge.engine)
    return EnginePool(judge.engine, pool_source(judge.model, resolve_model_dir(judge.model)), judge_window(judge))


def judge_window(judge) -> int:
    """The context window of the judge's engine: ``judge.engine.max_model_len``, else ``judge.sequence_length``."""
    return judge.engine.window(judge.sequence_length)


def check_judge_cpus(engine) -> None:
    """The judge's engines hold their CPUs while the reward stage runs beside them: at least one CPU of the cluster
    must stay free for the stage's Ray Data tasks, otherwise the stage waits forever (STACK.md)."""
    import ray

    held = engine.num_cpus_per_engine * engine.num_engines
    cpus = ray.cluster_resources().get("CPU", 0.0)
    if held and cpus - held < 1:
        raise ConfigError(f"judge.engine reserves {held:g} of the Ray cluster's {cpus:g} CPUs, which leaves less than "
                          "one for the reward stage, so it would wait forever; set judge.engine.num_cpus_per_engine: "
                          "0 (the judge computes only while the reward stage waits for it)")


def judge_services(rewards, judge, pool) -> dict:
    """``{"generate": EngineGenerate(...)}`` over the judge ``pool`` with ``judge``'s (a JudgeConfig) reply budget when
    a route of ``rewards`` needs a model, else {}."""
    if pool is None or not needs_model(rewards):
        return {}
    return {"generate": EngineGenerate(pool.handles(), max_new_tokens=judge.max_new_tokens,
                                       sequence_length=judge.sequence_length)}
