"""Run folders on an object store (issue 14, item 4; docs/object-storage.md), against a real local S3 server:
moto's server mode, one per module, on a free port. pyarrow reaches it through ``AWS_ENDPOINT_URL``.

The commit protocol: a stage writes under an attempt prefix inside its output folder and commits by writing the
manifest last; readers trust only what a manifest lists; a failed or killed attempt leaves the previous output as it
was and is removed by the next write. Checked in-process on the runner, with ``rollflow recompute`` killed by SIGKILL
mid-stage and resumed (equal to a local run), with a training checkpoint uploaded and trained from again, and with
the three ways an object store cannot be used (one error line, exit 2, nothing written).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from schemas.errors import SchemaError
from stages.example import ExampleSpec, generate
from stages.runner import run_stage
from stages.storage import ATTEMPT_KEY, Location, read_manifest, read_table_schema
from tests.processes import sigkill_when
from tests.spine.conftest import SMALL
from tests.spine.helpers import GIGPO, assert_tables_equal, config, read_table, run_recompute
from tests.spine.test_runner import CopySection, CopyStage

BUCKET = "rollflow-test"
ROLLFLOW = [sys.executable, "-m", "flows.cli"]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server in this process with one bucket; this process's AWS_* variables point at it (restored
    after the module). Yields the environment to give child processes."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "rollflow-test",
           "AWS_SECRET_ACCESS_KEY": "rollflow-test", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    pafs.S3FileSystem(endpoint_override=f"{host}:{port}", scheme="http", allow_bucket_creation=True
                      ).create_dir(BUCKET)
    try:
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def objects(uri: str) -> dict[str, int]:
    """``relative key -> size`` of every object under ``uri``."""
    loc = Location.of(uri)
    if not loc.exists():
        return {}
    return {i.path[len(loc.path) + 1:]: i.size
            for i in loc.fs.get_file_info(pafs.FileSelector(loc.path, recursive=True)) if i.type == pafs.FileType.File}


def read_s3_table(uri: str) -> pa.Table:
    """A table as a reader sees it: the files its manifest lists, in order."""
    loc = Location.of(uri)
    return pa.concat_tables([pq.read_table(p, filesystem=loc.fs) for p in loc.parquet_files()])


def s3_bytes(uri: str) -> list[bytes]:
    loc = Location.of(uri)
    out = []
    for path in loc.parquet_files():
        with loc.fs.open_input_stream(path) as f:
            out.append(f.read())
    return out


# ---- the protocol on the runner ------------------------------------------------------------------------------------
def test_failed_stage_keeps_the_previous_output_and_stale_attempts_are_removed(s3, step_set, ray_cluster):
    out = f"s3://{BUCKET}/proto/copy"
    first = run_stage(CopyStage(), CopySection(tag="a"), {"samples": step_set}, out, batch_rows=100)
    assert not first.skipped and first.output == out
    committed = objects(out)
    manifest = read_manifest(Location.of(out))
    attempt = manifest[ATTEMPT_KEY]
    assert sorted(committed) == sorted(["manifest.json", *(o["name"] for o in manifest["objects"])])
    assert all(name.startswith(f"{attempt}/") for name in committed if name != "manifest.json")
    assert_tables_equal(read_s3_table(out), read_table(step_set), "copy on s3")

    with pytest.raises(RuntimeError, match="boom"):  # fails in its second batch, after writing the first
        run_stage(CopyStage(), CopySection(fail="runtime", tag="b"), {"samples": step_set}, out, force=True,
                  batch_rows=100)
    assert objects(out) == committed, "a failed attempt leaves the committed output exactly as it was"

    # a killed attempt's parts (no manifest names them) are never read, and the next write removes them
    stray = Location.of(f"{out}/.attempt-1-dead")
    with stray.fs.open_output_stream(f"{stray.path}/00000000.parquet") as f:
        pq.write_table(read_table(step_set).slice(0, 5), f)
    assert len(Location.of(out).parquet_files()) == len(manifest["files"])
    assert_tables_equal(read_s3_table(out), read_table(step_set), "stray attempt ignored")
    again = run_stage(CopyStage(), CopySection(tag="a"), {"samples": step_set}, out, batch_rows=100)
    assert again.skipped and objects(out) == committed, "the up-to-date output is kept, the stray attempt removed"

    replaced = run_stage(CopyStage(), CopySection(tag="b"), {"samples": step_set}, out, force=True, batch_rows=100)
    new = read_manifest(Location.of(out))
    assert not replaced.skipped and new[ATTEMPT_KEY] != attempt
    assert {n.split("/")[0] for n in objects(out)} == {"manifest.json", new[ATTEMPT_KEY]}, "the old attempt is gone"
    assert_tables_equal(read_s3_table(out), read_table(step_set), "replaced")


# ---- rollflow recompute on s3://, killed mid-stage and resumed ----------------------------------------------------
def _advantages_in_progress(uri: str) -> bool:
    """The advantages stage has recorded at least one batch under an attempt of ``uri`` (not committed yet)."""
    names = objects(uri)
    return "manifest.json" not in names and any("/_partials/" in n for n in names)


@pytest.mark.slow
def test_recompute_on_s3_killed_mid_stage_resumes_to_the_local_output(s3, cli_env, ray_cluster, tmp_path):
    spec = ExampleSpec(samples=400, seed=1, rows_per_file=120, **SMALL)  # step_set's rows, uploaded
    samples, run = f"s3://{BUCKET}/kill/samples", f"s3://{BUCKET}/kill/run"
    generate(spec, samples)
    local_samples = str(tmp_path / "samples")
    generate(spec, local_samples)
    rows = 25  # 16 batches: the kill lands inside the advantages stage
    cmd = [*ROLLFLOW, "recompute", "--input", samples, "--config", GIGPO, "--output", run,
           "--set", f"runtime.batch_rows={rows}", "--set", "runtime.num_cpus=2"]
    env = {**cli_env, **s3, "PYTHONPATH": str(REPO)}
    sigkill_when(cmd, lambda: _advantages_in_progress(f"{run}/advantaged"), tmp_path / "killed.log", env=env,
                 cwd=str(REPO), timeout_s=400, what="the advantages stage")

    assert "manifest.json" in objects(f"{run}/rewarded"), "the first stage was committed before the kill"
    left = objects(f"{run}/advantaged")
    assert left and "manifest.json" not in left, "the killed stage left parts under its attempt, no manifest"
    assert Location.of(f"{run}/advantaged").parquet_files() == []  # a reader trusts nothing of it
    with pytest.raises(SchemaError, match="holds no .parquet files"):
        read_table_schema(Location.of(f"{run}/advantaged"), "advantaged")

    rerun = subprocess.run(cmd, env=env, cwd=str(REPO), capture_output=True, text=True, timeout=500,
                           start_new_session=True)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    lines = rerun.stdout.splitlines()
    assert "up to date, skipped" in lines[0] and "computed in" in lines[1], rerun.stdout[:2000]
    manifest = read_manifest(Location.of(f"{run}/advantaged"))
    assert {n.split("/")[0] for n in objects(f"{run}/advantaged")} == {"manifest.json", manifest[ATTEMPT_KEY]}

    reference = tmp_path / "reference"
    run_recompute(local_samples, str(reference), config(GIGPO, runtime={"batch_rows": rows}))
    for name in ("rewarded", "advantaged"):
        assert_tables_equal(read_s3_table(f"{run}/{name}"), read_table(reference / name), name)
        local_bytes = [p.read_bytes() for p in sorted((reference / name).glob("*.parquet"))]
        assert s3_bytes(f"{run}/{name}") == local_bytes, f"{name}: the Parquet files differ from the local run's"
        local_manifest = read_manifest(Location.of(str(reference / name)))
        assert read_manifest(Location.of(f"{run}/{name}"))["fingerprint"] == local_manifest["fingerprint"]


# ---- a store that cannot be used: one line, exit 2, nothing written -------------------------------------------------
@pytest.mark.parametrize("case", ["unreachable endpoint", "missing bucket", "missing credentials",
                                  "refused credentials"])
def test_unusable_store_gives_one_error_line_and_writes_nothing(case, s3, step_set, monkeypatch):
    import moto.settings

    from flows.cli import app

    before = objects(f"s3://{BUCKET}")
    bucket = BUCKET
    if case == "unreachable endpoint":
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # the discard port: nothing listens
    elif case == "missing bucket":
        bucket = "no-such-bucket"
    else:  # the server checks signatures; its IAM knows no key
        monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
        if case == "missing credentials":
            monkeypatch.delenv("AWS_ACCESS_KEY_ID")
            monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
        else:
            monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG0")
    result = CliRunner().invoke(app, ["recompute", "--input", step_set, "--config", GIGPO,
                                      "--output", f"s3://{bucket}/bad/run"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    expected = {"unreachable endpoint": "cannot reach s3://rollflow-test (endpoint http://127.0.0.1:9)",
                "missing bucket": "bucket no-such-bucket does not exist",
                "missing credentials": "no credentials are set; set AWS_ACCESS_KEY_ID",
                "refused credentials": "the credentials (AWS_ACCESS_KEY_ID) were refused"}[case]
    assert expected in lines[0], lines[0]
    monkeypatch.undo()
    assert objects(f"s3://{BUCKET}") == before, "nothing was written"


def test_a_store_failing_after_the_check_still_gives_one_error_line(s3, step_set, monkeypatch):
    """The check runs once per bucket, endpoint and credentials in a process; access refused later (the same key
    revoked) still ends the command with one line and exit 2, not a traceback."""
    import moto.settings

    from flows.cli import app

    Location.of(f"s3://{BUCKET}/later")  # checked, and cached, while access works
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    result = CliRunner().invoke(app, ["recompute", "--input", step_set, "--config", GIGPO,
                                      "--output", f"s3://{BUCKET}/later/run"])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert "access to s3://rollflow-test" in result.output and "were refused" in result.output, result.output


def test_uri_options_are_refused_with_the_environment_variables_to_use(s3):
    with pytest.raises(Exception, match="AWS_ENDPOINT_URL") as err:
        Location.of(f"s3://{BUCKET}/run?endpoint_override=127.0.0.1:1&scheme=http")
    assert f"pass s3://{BUCKET}/run" in str(err.value)
