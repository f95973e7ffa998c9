"""Run folders on an object store (issue 14, item 4; docs/object-storage.md), against a real local S3 server:
moto's server mode, one per module, on a free port. pyarrow reaches it through ``AWS_ENDPOINT_URL``.

The commit protocol: a stage writes under an attempt prefix inside its output folder and commits by writing the
manifest last; readers trust only what a manifest lists; a failed or killed attempt leaves the previous output as it
was and is removed by the next write. Checked on the runner's commit, with ``rollflow recompute`` killed by SIGKILL at
its commit point and resumed (equal to a local run byte for byte), with the metrics table, and with the ways an
object store cannot be used (one error line, exit 2, nothing written). Training checkpoints on s3:// are tested with
the train-step command (tests/train/test_stage.py), and a whole training run on s3://, SIGKILLed and resumed, in
tests/trainflow/test_async_rollout.py.
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from schemas.errors import ConfigError, SchemaError
from stages.example import ExampleSpec, generate
from stages.storage import ATTEMPT_KEY, MANIFEST, Location, read_manifest, read_table_schema
from tests.objstore import BUCKET, objects, read_s3_table, s3  # noqa: F401  (s3: the module's S3 server, a fixture)
from tests.processes import sigkill_when
from tests.spine.conftest import SMALL
from tests.spine.helpers import GIGPO, assert_tables_equal, flow_runs, read_table

ROLLFLOW = [sys.executable, "-m", "flows.cli"]
REPO = Path(__file__).resolve().parents[2]


def s3_bytes(uri: str) -> list[bytes]:
    loc = Location.of(uri)
    out = []
    for path in loc.parquet_files():
        with loc.fs.open_input_stream(path) as f:
            out.append(f.read())
    return out


# ---- the protocol on the runner ------------------------------------------------------------------------------------
def _fill_with(table: pa.Table, fail_after: int | None = None):
    """A ``commit_folder`` fill writing ``table`` as two parts (``fail_after=1``: raise after the first)."""
    def fill(folder: Location) -> dict:
        files = []
        for i, part in enumerate((table.slice(0, 100), table.slice(100))):
            if fail_after is not None and i == fail_after:
                raise RuntimeError("boom after the first part")
            with folder.fs.open_output_stream(f"{folder.path}/{i:08d}.parquet") as f:
                pq.write_table(part, f)
            files.append({"name": f"{i:08d}.parquet", "rows": part.num_rows})
        return {"files": files, "rows": table.num_rows}
    return fill


def test_failed_write_keeps_the_previous_output_and_stale_attempts_are_removed(s3, step_set):
    from stages.commit import commit_folder

    table = read_table(step_set)
    out = Location.of(f"s3://{BUCKET}/proto/copy")
    commit = dict(who="test", other="another output")
    manifest, skipped = commit_folder(out, "fp-a", _fill_with(table), **commit)
    committed, attempt = objects(out.uri()), manifest[ATTEMPT_KEY]
    assert not skipped and read_manifest(out) == manifest
    assert sorted(committed) == sorted(["manifest.json", *(o["name"] for o in manifest["objects"])])
    assert all(name.startswith(f"{attempt}/") for name in committed if name != "manifest.json")
    assert_tables_equal(read_s3_table(out.uri()), table, "committed")

    with pytest.raises(RuntimeError, match="boom"):  # fails after writing a part of its replacement
        commit_folder(out, "fp-b", _fill_with(table, fail_after=1), force=True, **commit)
    assert objects(out.uri()) == committed, "a failed attempt leaves the committed output exactly as it was"

    # a killed attempt's parts (no manifest names them) are never read, and the next write removes them
    with out.fs.open_output_stream(f"{out.path}/.attempt-1-dead/00000000.parquet") as f:
        pq.write_table(table.slice(0, 5), f)
    assert len(out.parquet_files()) == len(manifest["files"])
    assert_tables_equal(read_s3_table(out.uri()), table, "stray attempt ignored")
    assert commit_folder(out, "fp-a", _fill_with(table), **commit)[1], "up to date: skipped"
    assert objects(out.uri()) == committed, "the stray attempt is gone, the committed output kept"

    new, _ = commit_folder(out, "fp-b", _fill_with(table.slice(0, 150)), force=True, **commit)
    assert new[ATTEMPT_KEY] != attempt
    assert {n.split("/")[0] for n in objects(out.uri())} == {"manifest.json", new[ATTEMPT_KEY]}, "old attempt gone"
    assert_tables_equal(read_s3_table(out.uri()), table.slice(0, 150), "replaced")


# ---- rollflow recompute on s3://, killed mid-stage and resumed ----------------------------------------------------
@contextmanager
def held_put(key_suffix: str):
    """The S3 server holds the first PUT of a key ending in ``key_suffix`` (the commit point of a stage) and never
    stores it. Yields an event set once that PUT arrived: the writer is then stopped exactly before its commit,
    with every part written, the worst moment for a kill."""
    from moto.s3.models import S3Backend

    reached, release = threading.Event(), threading.Event()
    original = S3Backend.put_object

    def put_object(self, bucket_name, key_name, *args, **kwargs):
        if key_name.endswith(key_suffix) and not reached.is_set():
            reached.set()
            release.wait(600)
            raise RuntimeError(f"the test's S3 server dropped the PUT of {key_name}")
        return original(self, bucket_name, key_name, *args, **kwargs)

    S3Backend.put_object = put_object
    try:
        yield reached
    finally:
        S3Backend.put_object = original
        release.set()


@pytest.mark.slow
def test_recompute_on_s3_killed_at_the_commit_resumes_to_the_local_output(s3, cli_env, base_run, ray_cluster,
                                                                          prefect_server, tmp_path):
    """``rollflow recompute`` from and to s3:// is SIGKILLed when the advantages stage has written all its parts and
    sends its manifest: a reader sees the committed rewards table and nothing of the advantages; the same command
    again (in this process) skips the rewards, redoes the advantages, removes the dead attempt, and both tables
    equal the local run's (``base_run``: the same samples and config) byte for byte. The child reports to the
    session's Prefect server named by PREFECT_API_URL in its environment (``cli_env``), starting no ephemeral server
    in its own Prefect home: its flow run is on that server (tests/spine/test_flow.py's real-server test runs its
    command in-process and relies on this check for a child's)."""
    samples, run = f"s3://{BUCKET}/kill/samples", f"s3://{BUCKET}/kill/run"
    generate(ExampleSpec(samples=400, seed=1, rows_per_file=120, **SMALL), samples)  # step_set's rows
    cmd = [*ROLLFLOW, "recompute", "--input", samples, "--config", GIGPO, "--output", run]
    env = {**cli_env, **s3, "PYTHONPATH": str(REPO), "PREFECT_HOME": str(tmp_path / "client-home")}
    with held_put("kill/run/advantaged/manifest.json") as committing:
        sigkill_when(cmd, committing.is_set, tmp_path / "killed.log", env=env, cwd=str(REPO), timeout_s=400,
                     what="the commit of the advantages stage")
    assert not (tmp_path / "client-home" / "prefect.db").exists(), "no ephemeral server was used"
    assert [r.state.is_running() for r in _flow_runs_of(prefect_server.api_url, run)] == [True], \
        "the killed command's flow run is on the session's server, never finished"

    assert "manifest.json" in objects(f"{run}/rewarded"), "the first stage was committed before the kill"
    left = objects(f"{run}/advantaged")
    assert any(n.endswith(".parquet") for n in left) and "manifest.json" not in left, left
    assert Location.of(f"{run}/advantaged").parquet_files() == []  # a reader trusts nothing of it
    with pytest.raises(SchemaError, match="holds no .parquet files"):
        read_table_schema(Location.of(f"{run}/advantaged"), "advantaged")

    from flows.cli import app  # the same command again, in this process (its Ray cluster, no process start-up)

    rerun = CliRunner().invoke(app, cmd[3:])
    assert rerun.exit_code == 0, rerun.output[-3000:]
    removed = [line for line in rerun.output.splitlines() if line.startswith("WARNING: removing")]
    assert len(removed) == 1 and "advantaged/.attempt-" in removed[0], rerun.output[:2000]  # the dead attempt
    lines = [line for line in rerun.output.splitlines() if line not in removed]
    assert "up to date, skipped" in lines[0] and "computed in" in lines[1], rerun.output[:2000]
    for name in ("rewarded", "advantaged"):
        manifest = read_manifest(Location.of(f"{run}/{name}"))  # one attempt and its manifest: the dead one is gone
        assert {n.split("/")[0] for n in objects(f"{run}/{name}")} == {"manifest.json", manifest[ATTEMPT_KEY]}
        local = Path(base_run) / name
        assert_tables_equal(read_s3_table(f"{run}/{name}"), read_table(local), name)
        assert s3_bytes(f"{run}/{name}") == [p.read_bytes() for p in sorted(local.glob("*.parquet"))], name
        assert manifest["fingerprint"] == read_manifest(Location.of(str(local)))["fingerprint"]


def _flow_runs_of(api_url: str, output_dir: str) -> list:
    """The recompute flow runs on the Prefect server at ``api_url`` that wrote ``output_dir`` (a shared server)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        runs = flow_runs(client)
    return [r for r in runs if r.parameters.get("output_dir") == output_dir]


# ---- a store that cannot be used: one line, exit 2, nothing written -------------------------------------------------
@pytest.mark.parametrize("case", ["unreachable endpoint", "missing bucket", "missing credentials",
                                  "refused credentials", "bad cache budget"])
def test_unusable_store_gives_one_error_line_and_writes_nothing(case, s3, step_set, monkeypatch):
    import moto.settings

    from flows.cli import app

    before = objects(f"s3://{BUCKET}")
    bucket = BUCKET
    if case == "unreachable endpoint":
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # the discard port: nothing listens
    elif case == "missing bucket":
        bucket = "no-such-bucket"
    elif case == "bad cache budget":
        monkeypatch.setenv("ROLLFLOW_OBJSTORE_CACHE_GB", "lots")
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
                "refused credentials": "the credentials (AWS_ACCESS_KEY_ID) were refused",
                "bad cache budget": "ROLLFLOW_OBJSTORE_CACHE_GB='lots' is not a size in GiB"}[case]
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


def test_object_store_paths_compare_by_whole_components_and_dot_components_are_refused(s3, step_set):
    """An output on an object store is checked against the inputs by its path components (there are no links to
    resolve): s3://b/run2 is not inside s3://b/run, and repeated or trailing slashes name the same folder (before: a
    runs_dir with a trailing slash made the run folder s3://b/runs//r, which pyarrow refuses at its first use). A
    '.' or '..' component is refused with the fix (before: s3://b/in/../out was compared as s3://b/out, though keys
    are plain strings and what the store writes there depends on the client; the error blamed 'b/in/.., which is a
    file'), nothing written."""
    from flows.cli import app
    from schemas.config import validate_config
    from schemas.train_flow_config import TrainFlowConfig
    from stages.outputs import check_against_inputs
    from stages.run_folder import run_folder

    base = f"s3://{BUCKET}/paths"
    check_against_inputs(f"{base}/run2", {"in": f"{base}/run"})
    for same in (f"{base}/run/", f"{base}//run"):
        with pytest.raises(ConfigError, match="is the command's input"):
            check_against_inputs(same, {"in": f"{base}/run"})
    with pytest.raises(ConfigError, match="lies inside"):
        check_against_inputs(f"{base}/run//sub/", {"in": f"{base}/run"})
    assert Location.of(f"{base}//runs/r/").uri() == f"{base}/runs/r"
    assert run_folder(validate_config(TrainFlowConfig, {"runs_dir": f"{base}/runs/", "run_name": "r"})).uri() == \
        f"{base}/runs/r"
    before = objects(f"s3://{BUCKET}")
    for dotted in (f"{base}/in/../out", f"{base}/in/./out", f"s3://{BUCKET}/../other/out"):
        result = CliRunner().invoke(app, ["recompute", "--input", step_set, "--config", GIGPO, "--output", dotted])
        assert result.exit_code == 2 and "component names no one folder" in result.output, result.output
        assert "write the path without '.' and '..' components" in result.output
    assert objects(f"s3://{BUCKET}") == before, "nothing was written"


# ---- the metrics table and a record of parts on s3:// -------------------------------------------------------------
def test_metrics_table_on_s3_replaces_parts_and_reads_back(s3):
    import shutil

    from stages.metrics import MetricsLog, read_metrics
    from stages.storage import local_side

    run = f"s3://{BUCKET}/metrics-run"
    side = Path(local_side(Location.of(run))) / "tensorboard"
    shutil.rmtree(side, ignore_errors=True)
    with MetricsLog(run) as log:  # TensorBoard's events go to the run folder's local side
        for it in range(3):
            log.log(it, "train", {"actor/pg_loss": float(it)}, wall_s=1.0)
        log.log(1, "train", {"actor/pg_loss": 10.0})  # a resumed iteration replaces its part
        assert log.has(2, "train") and log.drop_after(1) == 1
    table = read_metrics(run)
    loss = table.filter(pa.compute.equal(table["name"], "actor/pg_loss"))
    assert loss["iteration"].to_pylist() == [0, 1] and loss["value"].to_pylist() == [0.0, 10.0]
    assert sorted(n.split("-")[1] for n in objects(f"{run}/metrics")) == ["iter000000", "iter000001"]
    assert not objects(f"{run}/tensorboard") and list(side.glob("events.out.tfevents.*"))
    shutil.rmtree(side.parent)


def test_a_file_that_fits_one_part_is_one_put_request(s3):
    """A small file (a manifest, a turn's table) reaches S3 in one PUT when it closes, not a multipart upload's three
    requests (stages/storage.py ``S3_OPTIONS``); a file larger than a part (pyarrow's 10 MB) still goes up in parts;
    both read back whole."""
    from tests.objstore import requests_seen

    loc = Location.of(f"s3://{BUCKET}/writes")
    for name, data in (("small.json", b'{"a": 1}'), ("big.bin", bytes(range(256)) * (12 << 12))):
        before = len(requests_seen())
        with loc.fs.open_output_stream(loc.child(name).path) as out:
            out.write(data)
        sent = [(method, query.split("=")[0]) for method, _path, query in requests_seen()[before:]]
        if name == "small.json":
            assert sent == [("PUT", "")], sent
        else:
            assert sent[0] == ("POST", "uploads") and sent.count(("PUT", "partNumber")) == 2, sent
        with loc.fs.open_input_stream(loc.child(name).path) as back:
            assert back.read() == data


def test_a_manifest_is_found_missing_in_one_request_and_read_in_two(s3):
    """stages/storage.py read_manifest on S3 opens the manifest at once: a folder without one costs one HEAD (asking
    for the key's kind first added a listing of ``manifest.json/``), a committed one a HEAD and a GET (a third
    request, a HEAD, before); a manifest that is not JSON is still refused with the fix."""
    from tests.objstore import requests_seen

    loc = Location.of(f"s3://{BUCKET}/manifests")
    before = len(requests_seen())
    assert read_manifest(loc.child("none")) is None
    assert [method for method, _path, _query in requests_seen()[before:]] == ["HEAD"]
    loc.child("done").child(MANIFEST).write_text(json.dumps({"fingerprint": "f", "rows": 1}))
    before = len(requests_seen())
    assert read_manifest(loc.child("done"))["rows"] == 1
    assert [method for method, _path, _query in requests_seen()[before:]] == ["HEAD", "GET"]
    loc.child("bad").child(MANIFEST).write_text("{not json")
    with pytest.raises(SchemaError, match=r"manifests/bad/manifest.json is damaged: it is not valid JSON.*delete the "
                                          r"folder"):
        read_manifest(loc.child("bad"))


def test_a_fetched_checkpoint_is_read_in_one_request_per_object(s3, tmp_path):
    """stages/storage.py fetch_committed reads each object of a committed folder in one GET (up to
    FETCH_CHUNK_BYTES): a 3 MiB weights file was three ranged GETs at pyarrow's 1 MiB default, a checkpoint of the
    default model 258, each with a store's latency."""
    from stages import storage
    from stages.commit import commit_folder
    from tests.objstore import requests_seen

    weights = bytes(range(256)) * (3 * 2**12)  # 3 MiB

    def fill(folder: Location) -> dict:
        with folder.fs.open_output_stream(folder.child("model.safetensors").path) as f:
            f.write(weights)
        return {"stage": "train_step", "files": []}

    uri = f"s3://{BUCKET}/fetch-requests/ckpt"
    commit_folder(Location.of(uri), "0" * 24, fill, who="test", other="x")
    before = len(requests_seen())
    copy = storage.fetch_committed(Location.of(uri), str(tmp_path / "objstore"))
    assert (Path(copy) / "model.safetensors").read_bytes() == weights
    gets = [path for method, path, _query in requests_seen()[before:] if method == "GET"]
    assert sum(path.endswith("/model.safetensors") for path in gets) == 1, gets


def test_a_text_object_is_read_in_one_request(s3):
    """Location.read_text reads the whole object in one GET (a stream's read() asked for 256 KiB at a time)."""
    from tests.objstore import requests_seen

    loc = Location.of(f"s3://{BUCKET}/texts/big.json")
    text = json.dumps({"rows": list(range(200_000))})  # about 1.3 MB
    loc.write_text(text)
    before = len(requests_seen())
    assert loc.read_text() == text
    assert [method for method, _path, _query in requests_seen()[before:]].count("GET") == 1


def test_two_threads_fetching_one_committed_folder_at_once_both_get_it_whole(s3, tmp_path, monkeypatch):
    """stages/storage.py fetch_committed called by two threads of one process at once, as an asynchronous run's
    log-probs and the rollout it plays ahead load the same policy: both get the whole folder, and no temporary
    folder is left. Pinned interleaving: both threads copy their first object, then the second copies its next one
    only after the first thread's fetch returned. With one temporary folder per process, the first renamed it into
    place under the second, whose next copy failed (FileNotFoundError; seen in a resumed asynchronous run on S3)."""
    import os

    import pyarrow.fs as pafs

    from stages import storage
    from stages.commit import commit_folder

    def fill(folder: Location) -> dict:
        for name in ("model.safetensors", "train_state.json"):
            folder.child(name).write_text(name)
        return {"stage": "train_step", "files": []}

    uri, cache = f"s3://{BUCKET}/fetch/checkpoint", tmp_path / "cache"
    commit_folder(Location.of(uri), "fp-fetch", fill, who="test", other="x")
    copy, both, fetched, calls = pafs.copy_files, threading.Barrier(2, timeout=60), threading.Event(), threading.local()

    def pinned_copy(*args, **kwargs):
        calls.n = getattr(calls, "n", 0) + 1
        if calls.n == 2:  # both threads hold their first object in a temporary folder
            both.wait()
            if threading.current_thread().name == "second":
                assert fetched.wait(60), "the first fetch never returned"
        copy(*args, **kwargs)

    monkeypatch.setattr(pafs, "copy_files", pinned_copy)
    got, errors = {}, {}

    def fetch(name: str) -> None:
        try:
            got[name] = storage.fetch_committed(Location.of(uri), str(cache))
        except Exception as err:  # noqa: BLE001  (reported below, by thread)
            errors[name] = err
        finally:
            if name == "first":
                fetched.set()

    threads = [threading.Thread(target=fetch, args=(name,), name=name) for name in ("first", "second")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert got["first"] == got["second"] and os.listdir(cache) == [os.path.basename(got["first"])]
    assert sorted(os.listdir(got["first"])) == ["manifest.json", "model.safetensors", "train_state.json"]
    assert Path(got["first"], "train_state.json").read_text() == "train_state.json"


def _copy(folder: Path, mib: int, used: float) -> Path:
    """A local copy of ``mib`` MiB in the fetch cache, last used at ``used``."""
    import os

    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"\0" * (mib << 20))
    os.utime(folder, (used, used))
    return folder


def test_the_local_copies_of_object_store_folders_keep_to_their_budget(tmp_path):
    """stages/storage.py prune_fetched: the least recently used copies go first while the cache is over its budget;
    a copy used within FETCH_IN_USE_S stays whatever the budget, as does the one just fetched; a killed download's
    temporary folder goes once stale, as does a removal interrupted FETCH_GONE_STALE_S ago (by the time of its move
    aside, its ctime), not one that may be under way."""
    import time

    from stages.storage import FETCH_GONE_STALE_S, FETCH_IN_USE_S, FETCH_TMP_STALE_S, prune_fetched

    gone = _copy(tmp_path / "f-1.gone-z", 1, 0)  # moved aside (its ctime) now
    assert prune_fetched(str(tmp_path), budget=0) == [] and gone.exists()  # a removal may be under way
    now = time.time() + FETCH_GONE_STALE_S + 1
    old = now - 2 * FETCH_IN_USE_S
    a, b = _copy(tmp_path / "a-1", 3, old - 10), _copy(tmp_path / "b-1", 2, old)
    c = _copy(tmp_path / "c-1", 1, now - 10)  # in use
    stale = _copy(tmp_path / "d-1.tmp-9-x", 1, now - FETCH_TMP_STALE_S - 1)
    fresh = _copy(tmp_path / "e.tmp-9-y", 1, now)
    assert prune_fetched(str(tmp_path), budget=4 << 20, now=now) == [str(a)]  # 6 MiB -> 3
    assert not stale.exists() and not gone.exists() and fresh.exists() and b.exists()
    assert prune_fetched(str(tmp_path), budget=0, now=now, keep=str(b)) == []  # b just fetched, c in use
    assert prune_fetched(str(tmp_path), budget=0, now=now) == [str(b)]
    assert c.exists() and fresh.exists()


def test_a_copy_in_a_cache_shared_with_another_user_is_used_as_it_is(tmp_path, monkeypatch):
    """A copy whose use cannot be marked (another user's folder: os.utime refused) is still a copy to use, and a
    missing one is not (stages/storage.py _mark_used; root may change any file's times, so the refusal is made)."""
    import os

    from stages import storage

    copy = _copy(tmp_path / "theirs-1", 1, 1e9)

    def refused(path, *args, **kwargs):
        raise PermissionError(1, "Operation not permitted", path)

    monkeypatch.setattr(os, "utime", refused)
    assert storage._mark_used(str(copy)) and not storage._mark_used(str(tmp_path / "missing-1"))


def test_a_copy_removed_for_the_budget_is_fetched_again_whole(s3, tmp_path, monkeypatch):
    """fetch_committed with a budget of 0: fetching a second checkpoint removes the first one's copy (not used for
    FETCH_IN_USE_S), keeps its own; fetching the first again downloads it anew to the same path. A reuse marks a
    copy used, so it stays."""
    import os

    from stages import storage
    from stages.commit import commit_folder

    def fill(folder: Location) -> dict:
        folder.child("model.safetensors").write_text("weights " + folder.uri())
        return {"stage": "train_step", "files": []}

    monkeypatch.setenv(storage.FETCH_BUDGET_ENV, "0")
    monkeypatch.setenv("ROLLFLOW_CACHE", str(tmp_path))  # the cache the engine pool below fetches into
    cache, uris = tmp_path / "objstore", [f"s3://{BUCKET}/budget/{name}" for name in ("one", "two")]
    for number, uri in enumerate(uris):
        commit_folder(Location.of(uri), f"{number:024x}", fill, who="test", other="x")
    first = storage.fetch_committed(Location.of(uris[0]), str(cache))
    long_ago = os.stat(first).st_mtime - 2 * storage.FETCH_IN_USE_S
    os.utime(first, (long_ago, long_ago))
    assert storage.fetch_committed(Location.of(uris[0]), str(cache)) == first  # reused: marked used
    os.utime(first, (long_ago, long_ago))
    second = storage.fetch_committed(Location.of(uris[1]), str(cache))
    assert not os.path.exists(first) and os.path.isdir(second)
    assert storage.fetch_committed(Location.of(uris[0]), str(cache)) == first
    assert (Path(first) / "model.safetensors").read_text().startswith(f"weights {uris[0]}/")
    assert os.path.isdir(second)  # used a moment ago

    # an engine pool keeps the URI and resolves its copy at each use (stages/rollout/driver.py pool_source)
    from schemas.rollout_config import EngineConfig
    from stages.rollout.engine_pool import EnginePool

    pool = EnginePool(EngineConfig(backend="hf"), uris[1], 512)
    assert pool.source == uris[1] and pool.model_dir == second
    shutil.rmtree(second)
    assert pool.use_checkpoint(uris[1]) == 0.0 and pool.model_dir == second and os.path.isdir(second)


def test_a_record_of_committed_parts_on_s3_is_written_last_and_kept_when_up_to_date(s3):
    """A rollout's folder: each part committed by its own stage, then the folder's own manifest (commit_record)."""
    from stages.commit import commit_folder, commit_record

    folder = Location.of(f"s3://{BUCKET}/record")
    part = folder.child("turn_000")
    commit_folder(part, "fp-part", lambda tmp: {"files": []}, who="test", other="another part")
    with pytest.raises(Exception, match="parts of this output are missing"):
        commit_record(Location.of(f"s3://{BUCKET}/record-missing"), "fp", lambda: {})
    manifest, skipped = commit_record(folder, "fp-whole", lambda: {"stage": "eval", "parts": ["turn_000"]})
    assert not skipped and read_manifest(folder) == manifest and manifest["fingerprint"] == "fp-whole"
    assert sorted(objects(folder.uri())) == ["manifest.json", "turn_000/manifest.json"]
    assert commit_record(folder, "fp-whole", lambda: {"stage": "other"})[1], "an up-to-date record is kept"


def test_dropping_a_checkpoints_training_state_on_s3_rewrites_its_manifest_first(s3):
    """train.max_ckpt_to_keep on a run folder on s3:// (stages/train/checkpoint.py keep_training_state): the older
    checkpoint's DeepSpeed state objects go, its manifest no longer lists them (a download of it is complete), its
    fingerprint and weights stay; the newest keeps its state."""
    from stages.commit import commit_folder
    from stages.train.checkpoint import keep_training_state

    def fill(folder: Location) -> dict:
        for name in ("model.safetensors", "deepspeed/actor/state.pt"):
            folder.child(name).parent.fs.create_dir(folder.child(name).parent.path, recursive=True)
            folder.child(name).write_text(name)
        return {"stage": "train_step", "files": []}

    uris = [f"s3://{BUCKET}/ckpts/iter_{k}/checkpoint" for k in (0, 1)]
    before = [commit_folder(Location.of(u), f"fp-{k}", fill, who="test", other="x")[0] for k, u in enumerate(uris)]
    assert keep_training_state(uris, 1) == [uris[0]]
    old, new = read_manifest(Location.of(uris[0])), read_manifest(Location.of(uris[1]))
    assert old["fingerprint"] == "fp-0" and new == before[1]
    assert [o["name"].split("/", 1)[1] for o in old["objects"]] == ["model.safetensors"]
    assert sorted(n.split("/", 1)[-1] for n in objects(uris[0])) == ["manifest.json", "model.safetensors"]
    assert keep_training_state(uris, 1) == [], "nothing left to drop"
