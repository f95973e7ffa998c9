"""The pre-flight contract as a property over configs and files (issue 48): for every command that reads a config,
Hypothesis draws a mutation of a valid config of that command — an option of the wrong type, a value out of range
(nan, infinity), an unknown option, an option moved into the wrong section, a config of another command — or a
damage to the file — cut short, empty, another encoding, another format, a folder where the file goes, a file where
a folder goes — and the command must refuse it with exit status 2 and one ``error:`` message (naming the option for
the mutations), no traceback, nothing written, and every input unchanged byte for byte.

All of it is refused in the pre-flight, before Ray and Prefect would start (the catalogue's ``no_services`` makes
them fail the test), so each example runs in-process in a fraction of a second. ``derandomize`` draws the same cases
on every run, so a failure reproduces.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from flows.cli import app
from pydantic import ValidationError
from schemas.config import COMMAND_CONFIGS
from stages.example import ExampleSpec, generate
from tests.spine.conftest import SMALL
from tests.spine.helpers import REPO, read_table, tree_digest, write_samples
from tests.spine.test_bad_input_catalogue import no_services  # noqa: F401  (a fixture: Ray and Prefect cannot start)
from tests.spine.test_bad_input_commands import _advantaged

runner = CliRunner()

# command -> (its argv, with {config}, {output}, {samples}, {responses}, {advantaged}, {model}; the config it is given
# valid: a file of configs/ or the dump of its model's defaults)
COMMANDS = {
    "recompute": (["recompute", "--input", "{samples}", "--config", "{config}", "--output", "{output}"],
                  "configs/recompute_gigpo.yaml"),
    "demo": (["demo", "--run-dir", "{output}", "--config", "{config}"], "configs/recompute_grpo.yaml"),
    "deploy": (["deploy", "--interval", "60", "--input", "{samples}", "--output", "{output}", "--config", "{config}"],
               "configs/recompute_gigpo.yaml"),
    "score": (["score", "--input", "{responses}", "--config", "{config}", "--output", "{output}"],
              "configs/rlvr_math.yaml"),
    "rollout": (["rollout", "--config", "{config}", "--output", "{output}"], "configs/rollout_frozenlake.yaml"),
    "train": (["train", "--config", "{config}", "--set", "runs_dir={output}"], "configs/train_frozenlake_quickstart.yaml"),
    "train-rlvr": (["train", "--config", "{config}", "--set", "runs_dir={output}"], "configs/rlvr_train_math.yaml"),
    "plan": (["plan", "--config", "{config}", "--cpus", "2", "--gpus", "0"], "configs/train_frozenlake_gigpo.yaml"),
    "eval": (["eval", "--config", "{config}", "--output", "{output}"], "configs/train_frozenlake_quickstart.yaml"),
    "train-step": (["train-step", "--samples", "{advantaged}", "--checkpoint", "{model}", "--config", "{config}",
                    "--output", "{output}"], "schemas.train_config:TrainStepConfig"),
    "logprobs": (["logprobs", "--samples", "{samples}", "--checkpoint", "{model}", "--config", "{config}",
                  "--output", "{output}"], "schemas.train_config:ForwardConfig"),
    "values": (["values", "--samples", "{samples}", "--checkpoint", "{model}", "--config", "{config}", "--output",
                "{output}"], "schemas.train_config:ForwardConfig"),
}
# options whose value is free-form (constructor or backend keyword arguments, resources by name): not mutated
FREE_FORM = {"env_config", "options", "kwargs", "stage_resources", "custom_envs", "env_kwargs", "deepspeed_config"}
# the commands that take a training run's config of either pipeline (the config's ``pipeline`` picks the model)
RUN_COMMANDS = {"train", "train-rlvr", "plan", "eval"}
MUTATIONS = ("wrong_type", "out_of_range", "unknown_key", "wrong_section", "other_command")
DAMAGES = ("truncated", "empty", "utf16", "latin1", "ini_format", "parquet_bytes", "folder_for_file",
           "file_for_folder")
UNKNOWN = "zz_not_an_option"


def _model(command: str):
    base = COMMANDS[command][1]
    if ":" in base:
        return next(k for k in COMMAND_CONFIGS if k.model == base).resolve()
    data = yaml.safe_load((REPO / base).read_text())
    if data.get("pipeline") == "rlvr":
        return next(k for k in COMMAND_CONFIGS if k.model.endswith(":RLVRTrainConfig")).resolve()
    return next(k.resolve() for k in COMMAND_CONFIGS if set(data) <= {f.alias or n for n, f in
                                                                       k.resolve().model_fields.items()})


def _valid_config(command: str) -> dict:
    base = COMMANDS[command][1]
    if ":" in base:
        return json.loads(json.dumps(_model(command)().model_dump(mode="json")))
    return yaml.safe_load((REPO / base).read_text())


def _leaves(data: dict, path: tuple = ()) -> list[tuple[tuple, Any]]:
    """(key path, value) of the scalar options of ``data`` (not those inside free-form options)."""
    out = []
    for key, value in data.items():
        if key in FREE_FORM:
            continue
        if isinstance(value, dict):
            out += _leaves(value, (*path, key))
        elif isinstance(value, (bool, int, float, str)):
            out.append(((*path, key), value))
    return out


def _sections(data: dict, path: tuple = ()) -> list[tuple]:
    """Key paths of the sections (mappings of options) of ``data``, the top level included."""
    out = [path]
    for key, value in data.items():
        if isinstance(value, dict) and key not in FREE_FORM:
            out += _sections(value, (*path, key))
    return out


def _node(data: dict, path: tuple) -> dict:
    for key in path:
        data = data[key]
    return data


def _mutate(command: str, data: dict, draw) -> tuple[dict | bytes, str]:
    """A mutated copy of the config ``data`` of ``command`` (a mapping, or the bytes of another command's config
    file) and a word the refusal must contain (the option it names)."""
    kind = draw(st.sampled_from(MUTATIONS), label="mutation")
    data = json.loads(json.dumps(data))
    if kind == "other_command":
        own = _model(command)
        others = [c for c in COMMANDS if _model(c) is not own and ":" not in COMMANDS[c][1]
                  and not {command, c} <= RUN_COMMANDS]
        other = draw(st.sampled_from(sorted(others)), label="other command")
        return (REPO / COMMANDS[other][1]).read_bytes(), "is a config of rollflow"
    if kind == "unknown_key":
        where = draw(st.sampled_from(_sections(data)), label="section")
        _node(data, where)[UNKNOWN] = 1
        return data, UNKNOWN
    if kind == "wrong_section":
        nested = [(path, value) for path, value in _leaves(data) if len(path) > 1
                  and path[-1] not in {f.alias or n for n, f in _model(command).model_fields.items()}]
        assume(nested)
        path, value = draw(st.sampled_from(nested), label="option")
        del _node(data, path[:-1])[path[-1]]
        data[path[-1]] = value
        return data, path[-1]
    leaves = [(p, v) for p, v in _leaves(data) if kind == "wrong_type" or not isinstance(v, (bool, str))]
    path, value = draw(st.sampled_from(leaves), label="option")
    if kind == "wrong_type":
        bad = "many" if isinstance(value, (int, float)) and not isinstance(value, bool) else \
            "maybe" if isinstance(value, bool) else [1, 2]
    else:
        bad = draw(st.sampled_from([math.nan, math.inf, -math.inf]), label="value")
    _node(data, path[:-1])[path[-1]] = bad
    return data, path[-1]


def _damage(text: bytes, kind: str, draw) -> bytes | None:
    """The damaged bytes of a config file (None: the file is replaced by a folder)."""
    if kind == "truncated":
        return text[:draw(st.integers(1, len(text) - 1), label="cut at")]
    if kind == "empty":
        return b""
    if kind == "utf16":
        return text.decode().encode("utf-16")
    if kind == "latin1":
        return b"# r\xe9glages\n" + text
    if kind == "ini_format":
        return b"[config]\n" + b"".join(f"{k} = {v}\n".encode() for k, v in yaml.safe_load(text).items())
    if kind == "parquet_bytes":
        return b"PAR1\x15\x04\x15\x10\x15\x14L\x15\x02\x15\x00\x12\x00\x00" + bytes(range(256))
    return None


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, data_root, tiny_model) -> dict[str, str]:
    """Read-only valid inputs: a samples table, a responses table, an advantaged table, the tiny model."""
    from stages.rlvr.example import RLVRExampleSpec, write_rlvr_example

    root = tmp_path_factory.mktemp("config_property")
    samples = data_root / "config_property_samples"
    if not samples.exists():
        generate(ExampleSpec(samples=16, seed=5, rows_per_file=1000, **SMALL), str(samples))
    write_rlvr_example(RLVRExampleSpec(domains=("math",), n=8, limit=1), str(root / "responses"))
    return {"samples": str(samples), "responses": str(root / "responses"),
            "advantaged": write_samples(_advantaged(read_table(samples)), root / "advantaged"), "model": str(tiny_model)}


def _run(command: str, config: Path, work: Path, inputs: dict[str, str], file_for_folder: bool = False):
    """Run ``command`` on ``config`` in ``work``; the refusal's result. ``file_for_folder``: its input folder (or,
    for a command without one, its output's parent) is a file."""
    values = {**inputs, "config": str(config), "output": str(work / "out")}
    argv = [a.format(**values) for a in COMMANDS[command][0]]
    if file_for_folder:
        given = [v for k, v in inputs.items() if v in argv and k != "model"]
        target = given[0] if given else values["output"]
        argv = [str(work / "afile") if a == target else a for a in argv]
        if not given:
            argv = [a.replace(values["output"], str(work / "afile" / "out")) for a in argv]
    return runner.invoke(app, argv)


def _assert_refused(result, word: str | None = None) -> None:
    assert result.exit_code == 2, f"exit {result.exit_code}\n{result.output}\n{result.exception!r}"
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    usage = "Usage:" in result.output or "Invalid value" in result.output
    assert len(errors) == 1 or usage, f"one message:\n{result.output}"
    assert "Traceback" not in result.output
    if word is not None:
        assert word in " ".join(result.output.split()), f"{word!r} not named in:\n{result.output}"


def _digests(work: Path, inputs: dict[str, str]) -> dict:
    return {"work": tree_digest(work), **{k: tree_digest(v) for k, v in inputs.items() if k != "model"}}


PROPERTY = settings(max_examples=100, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much])


@PROPERTY
@given(data=st.data())
def test_a_mutated_config_is_refused_naming_the_option(inputs, no_services, data):
    command = data.draw(st.sampled_from(sorted(COMMANDS)), label="command")
    config, word = _mutate(command, _valid_config(command), data.draw)
    if isinstance(config, dict):  # a mutation the model accepts is no mistake (none should be: kept as a check)
        try:
            _model(command).model_validate(config)
            pytest.fail(f"{command}: the mutated config validates: {config}")
        except ValidationError:
            pass
    with tempfile.TemporaryDirectory(prefix="rollflow-config-property-") as tmp:
        work = Path(tmp)
        path = work / "config.yaml"
        path.write_bytes(config if isinstance(config, bytes) else yaml.safe_dump(config).encode())
        before = _digests(work, inputs)
        _assert_refused(_run(command, path, work, inputs), word)
        assert _digests(work, inputs) == before, "nothing is written and no input changes"


@PROPERTY
@given(data=st.data())
def test_a_damaged_config_file_or_path_is_refused(inputs, no_services, data):
    command = data.draw(st.sampled_from(sorted(COMMANDS)), label="command")
    kind = data.draw(st.sampled_from(DAMAGES), label="damage")
    assume(not (kind == "file_for_folder" and command == "plan"))  # plan reads no folder
    text = yaml.safe_dump(_valid_config(command)).encode()
    damaged = _damage(text, kind, data.draw) if kind != "file_for_folder" else text
    if kind == "truncated":  # a cut that leaves a valid config of fewer options is no damage anyone can see
        try:
            _model(command).model_validate(yaml.safe_load(damaged) or {"": None})
            assume(False)
        except (yaml.YAMLError, ValidationError, AttributeError, TypeError):
            pass
    with tempfile.TemporaryDirectory(prefix="rollflow-config-property-") as tmp:
        work = Path(tmp)
        (work / "afile").write_text("not a folder\n")
        path = work / "config.yaml"
        if damaged is None:
            path.mkdir()
        else:
            path.write_bytes(damaged)
        before = _digests(work, inputs)
        _assert_refused(_run(command, path, work, inputs, file_for_folder=kind == "file_for_folder"))
        assert _digests(work, inputs) == before, "nothing is written and no input changes"
