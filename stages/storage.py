"""Run-folder I/O through pyarrow filesystems: local paths by default, any pyarrow URI (s3://, gs://, ...) where
the cluster has credentials. Every stage reads and writes through these helpers, never through ``open``/``os``.

An object store (any filesystem but the local one) has no atomic rename, so its stage outputs are committed
differently (docs/object-storage.md): the parts go under a unique attempt prefix inside the output folder and the
manifest, written last in one PUT, names the attempt and its files. :meth:`Location.parquet_files` of such a folder
returns what its manifest lists and nothing else. The endpoint, region and credentials of an object store come
from the standard AWS environment variables (``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID``,
...), not from the URI: the URI of a table is recorded in manifests and names the data, not how to reach it."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import time
import urllib.parse
import uuid
from dataclasses import dataclass

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from schemas.errors import ConfigError, SchemaError
from stages.paths import cache_root_path

MANIFEST = "manifest.json"
ATTEMPT_KEY = "attempt"  # the manifest field naming the attempt prefix of an object-store output


def _uri_scheme(where: str | os.PathLike | None) -> str | None:
    """The scheme of a filesystem URI (``s3`` of ``s3://bucket/run``); None for a local path or None."""
    scheme, sep, _ = ("" if where is None else str(where)).partition("://")
    return scheme if sep else None


def store_path(where: str, *, strict: bool = True) -> str:
    """The ``bucket/key`` path of an object-store URI (``s3://b/runs//r/`` -> ``b/runs/r``): repeated slashes
    collapsed and a trailing one dropped (an object store has no empty path component, and pyarrow refuses one, so
    ``runs_dir: s3://b/runs/`` names the same folders as ``s3://b/runs``). A ``.`` or ``..`` component is refused
    (``strict``; else kept as written): keys are plain strings, and whether ``a/../b`` reaches key ``b``, the literal
    key ``a/../b`` under ``a/``, or another bucket depends on the client and its addressing style."""
    parts = [part for part in where.split("://", 1)[1].split("/") if part]
    dots = [part for part in parts if part in (".", "..")]
    if strict and dots:
        raise ConfigError(f"{where}: an object-store path with a '{dots[0]}' component names no one folder (its keys "
                          "are plain strings, and what '.' and '..' reach depends on the client); write the path "
                          "without '.' and '..' components")
    return "/".join(parts)


def is_uri(where: str | os.PathLike | None) -> bool:
    """Whether ``where`` names a folder by a filesystem URI (``s3://bucket/run``, ``gs://...``: on an object store,
    opened by :meth:`Location.of` through pyarrow) rather than a local path; False for None. The one test of this
    in rollflow: a URI is any text holding ``://``."""
    return _uri_scheme(where) is not None


@dataclass(frozen=True)
class Location:
    """A folder on a pyarrow filesystem."""

    fs: pafs.FileSystem
    path: str

    @classmethod
    def of(cls, where: str, fs: pafs.FileSystem | None = None) -> "Location":
        """The folder at a local path or a filesystem URI (``s3://bucket/run``). The first URI of each bucket in a
        process is checked (:func:`check_store`): an unreachable endpoint, a missing bucket or refused credentials
        raise a ConfigError naming the URI and the fix before anything is read or written. ``fs``: a filesystem
        that came with a stage to a Ray worker (holding the driver's endpoint and credentials, which the workers of
        an existing cluster lack), used for a URI of its scheme instead of one built from this process's
        environment."""
        scheme = _uri_scheme(where)
        if scheme is not None and scheme != "file":
            where = f"{scheme}://{store_path(where)}"
        if scheme is not None and fs is not None and fs.type_name == scheme:
            return cls(fs, where.split("://", 1)[1].rstrip("/"))
        if scheme is not None:
            if "?" in where:
                raise ConfigError(f"{where}: options in the URI are not accepted, because table paths are recorded "
                                  "in manifests and must name the data only; set the endpoint, region and "
                                  "credentials with AWS_ENDPOINT_URL, AWS_DEFAULT_REGION and AWS_ACCESS_KEY_ID / "
                                  f"AWS_SECRET_ACCESS_KEY (docs/object-storage.md) and pass {where.split('?')[0]}")
            try:
                query = "&".join(f"{k}={str(v).lower()}" for k, v in S3_OPTIONS.items())
                fs, path = pafs.FileSystem.from_uri(f"{where}?{query}" if scheme == "s3" else where)
            except (ValueError, OSError) as err:
                raise ConfigError(f"{where} is not a filesystem URI pyarrow can open ({err}); pass a local path or "
                                  "an s3://bucket/folder URI") from None
            if isinstance(fs, pafs.S3FileSystem):
                fs = _with_env_credentials(fs)
            loc = cls(fs, path.rstrip("/"))
            if not isinstance(fs, pafs.LocalFileSystem):
                check_store(scheme, loc.path.split("/", 1)[0])
            return loc
        return cls(pafs.LocalFileSystem(), os.path.abspath(where))

    @property
    def atomic_rename(self) -> bool:
        """Whether a folder can be renamed into place atomically here (local disk: yes; object stores: no)."""
        return isinstance(self.fs, pafs.LocalFileSystem)

    def child(self, name: str) -> "Location":
        return Location(self.fs, f"{self.path}/{name}")

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> "Location":
        return Location(self.fs, self.path.rstrip("/").rsplit("/", 1)[0])

    def uri(self) -> str:
        """A path Ray Data and pyarrow accept (local path, or the URI for remote filesystems)."""
        if isinstance(self.fs, pafs.LocalFileSystem):
            return self.path
        return f"{self.fs.type_name}://{self.path}"

    def ray_filesystem(self) -> pafs.FileSystem | None:
        """The filesystem argument for Ray Data (None for local paths, which Ray resolves itself)."""
        return None if isinstance(self.fs, pafs.LocalFileSystem) else self.fs

    def exists(self) -> bool:
        return self.fs.get_file_info(self.path).type != pafs.FileType.NotFound

    def is_dir(self) -> bool:
        return self.fs.get_file_info(self.path).type == pafs.FileType.Directory

    def read_text(self) -> str:
        # a random-access file reads the whole object in one GET; a stream's read() asks for 256 KiB at a time
        with self.fs.open_input_file(self.path) as f:
            return f.read().decode()

    def write_text(self, text: str) -> None:
        with self.fs.open_output_stream(self.path) as f:
            f.write(text.encode())

    def list(self, missing_ok: bool = False) -> list[pafs.FileInfo]:
        """What the folder holds, one level. ``missing_ok``: none for a missing folder, in one listing request on an
        object store (asking first whether it exists costs a HEAD and a listing more there)."""
        return self.fs.get_file_info(pafs.FileSelector(self.path, recursive=False, allow_not_found=missing_ok))

    def parquet_files(self) -> list[str]:
        """Sorted paths of the Parquet files directly in this folder; on an object store, of a folder committed
        there (its manifest names an attempt), the files its manifest lists, in order, and nothing else."""
        if not self.atomic_rename:
            manifest = read_manifest(self)  # one HEAD when there is none: no need to ask for the folder's kind first
            if manifest is not None and ATTEMPT_KEY in manifest:
                return [f"{self.path}/{f['name']}" for f in manifest["files"]]
        return sorted(i.path for i in self.list() if i.type == pafs.FileType.File and i.path.endswith(".parquet"))

    def recorded(self, path: str) -> "Location":
        """The folder at ``path`` as a manifest of this filesystem records an input: a URI (``s3://...``: what
        stages on an object store record), a local path (a model folder read by a run on a store), or a path on
        this filesystem."""
        if is_uri(path):
            return Location.of(path)
        if not self.atomic_rename and path.startswith("/"):
            return Location(pafs.LocalFileSystem(), path)
        return Location(self.fs, path)

    def rmtree(self) -> None:
        """Delete the folder and what it holds; nothing when it is missing (asked by deleting: on S3, asking first
        whether it exists cost a HEAD and a listing more)."""
        try:
            self.fs.delete_dir(self.path)
        except FileNotFoundError:
            pass

    def rename(self, dest: "Location") -> None:
        self.fs.move(self.path, dest.path)


def read_manifest(loc: Location) -> dict | None:
    """The manifest of the folder ``loc`` (None when it has none). Raises :class:`SchemaError` naming the file and
    the fix when it is not a file, not JSON, not an object, or a field readers use has the wrong type.

    On an object store the manifest is opened at once: one request (HEAD) finds it missing and two read it, where
    asking for its kind first took a HEAD and a listing, or two HEADs and a GET (pyarrow's ``get_file_info`` lists
    the prefix of a key it does not find, to tell a folder). There a key that is no object (objects under
    ``manifest.json/``) reads as no manifest; on a local disk a folder of that name is refused as damaged."""
    m = loc.child(MANIFEST)
    if loc.atomic_rename:
        kind = loc.fs.get_file_info(m.path).type
        if kind == pafs.FileType.NotFound:
            return None
        if kind != pafs.FileType.File:
            raise damaged_manifest(loc, "it is not a file")
    try:
        manifest = json.loads(m.read_text())
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise damaged_manifest(loc, f"it is not valid JSON ({err})") from None
    problem = manifest_problem(manifest)
    if problem is not None:
        raise damaged_manifest(loc, problem)
    return manifest


def damaged_manifest(loc: Location, problem: str) -> SchemaError:
    """The error for the manifest of ``loc`` that ``problem`` makes unusable, with the fix."""
    return SchemaError(f"manifest {loc.child(MANIFEST).path} is damaged: {problem}; delete the folder {loc.path} and "
                       "re-run the stage that produced it")


def manifest_field(loc: Location, manifest: dict, key: str):
    """``manifest[key]`` of the manifest of ``loc``; a :func:`damaged_manifest` error when it has no such field."""
    if key not in manifest:
        raise damaged_manifest(loc, f"it has no field '{key}'")
    return manifest[key]


# the JSON type of each manifest field that readers use; a manifest holds those of its kind (an example table has
# no inputs, a checkpoint no files), so a missing field is for its reader to report
_FIELD_TYPES = {"stage": str, "version": str, "table": str, "fingerprint": str, ATTEMPT_KEY: str, "rows": int,
                "created_unix": float, "inputs": dict, "files": list, "objects": list, "metrics": dict,
                "section": dict, "params": dict, "state": dict, "state_in": dict, "context": dict}
# the JSON type of each field inside params / section that readers take from a stored table's manifest (the group
# size rollflow validate checks complete groups of); null or absent: not recorded
_NESTED_TYPES = {("params", "group_size"): int, ("section", "group_size"): int}
JSON_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", dict: "an object", list: "a list",
               bool: "a boolean", type(None): "null"}


def is_json_type(value, kind: type) -> bool:
    """Whether the JSON ``value`` has the JSON type ``kind`` (an integer is a number; a boolean is neither)."""
    if isinstance(value, bool):
        return kind is bool
    return isinstance(value, (int, float) if kind is float else kind)


def json_type_name(value) -> str:
    """How a message names the JSON type of ``value`` ("an integer", "null", ...)."""
    return next((name for kind, name in JSON_TYPE_NAMES.items() if is_json_type(value, kind)), type(value).__name__)


def manifest_problem(manifest) -> str | None:
    """What is wrong with the shape of a parsed manifest (``"field 'rows' is a string, expected an integer"``), or
    None: an object whose fields readers use have their types, inputs that name their folders, files their names."""
    if not isinstance(manifest, dict):
        return f"holds {json_type_name(manifest)}, not a JSON object"
    for key, kind in _FIELD_TYPES.items():
        if key in manifest and not is_json_type(manifest[key], kind):
            return f"field '{key}' is {json_type_name(manifest[key])}, expected {JSON_TYPE_NAMES[kind]}"
    for (outer, key), kind in _NESTED_TYPES.items():
        value = manifest.get(outer, {}).get(key)
        if value is not None and not is_json_type(value, kind):
            return f"field '{outer}.{key}' is {json_type_name(value)}, expected {JSON_TYPE_NAMES[kind]}"
    for name, entry in manifest.get("inputs", {}).items():
        if not isinstance(entry, dict) or not is_json_type(entry.get("path"), str) \
                or not is_json_type(entry.get("fingerprint", ""), str):
            return f"input '{name}' is not an object with a string 'path' (and 'fingerprint')"
    for key in ("files", "objects"):
        if not all(isinstance(f, dict) and is_json_type(f.get("name"), str) for f in manifest.get(key, [])):
            return f"field '{key}' holds an entry that is not an object with a string 'name'"
    bad = next((k for k, v in manifest.get("metrics", {}).items() if not is_json_type(v, float)), None)
    return None if bad is None else f"metric '{bad}' is {json_type_name(manifest['metrics'][bad])}, expected a number"


def folder_fingerprint(loc: Location) -> str:
    """The manifest fingerprint of a stage output, or, for a plain folder of Parquet files, a hash of the file
    names, sizes and modification times."""
    manifest = read_manifest(loc)
    if manifest is not None:
        return manifest_field(loc, manifest, "fingerprint")
    h = hashlib.sha256()
    for info in sorted((i for i in loc.list() if i.path.endswith(".parquet")), key=lambda i: i.path):
        h.update(f"{info.base_name}:{info.size}:{info.mtime_ns}".encode())
    return h.hexdigest()


def read_table_schema(loc: Location, table: str, allow_empty: bool = False):
    """The common Arrow schema of the Parquet files in ``loc``. Raises :class:`SchemaError` naming a file that is
    missing, corrupt, not the one its manifest lists, or whose schema differs from the others. ``allow_empty``: a
    folder without Parquet files (a table of no rows) gives None instead of an error."""
    if not loc.is_dir():
        raise SchemaError(f"{table} input {loc.path} does not exist or is not a folder; pass the folder that holds "
                          "the Parquet files")
    files = loc.parquet_files()
    listed = _listed_rows(loc, table, files)
    if not files and allow_empty:
        return None
    if not files:
        raise SchemaError(f"{table} input {loc.path} holds no .parquet files; pass a stage output folder or a folder "
                          "of Parquet files (rollflow example --output DIR makes one)")
    schema = None
    for path in files:
        try:
            with loc.fs.open_input_file(path) as f:
                meta = pq.read_metadata(f)
        except Exception as err:  # pyarrow raises ArrowInvalid / OSError for corrupt files
            raise SchemaError(f"{table} input file {path} is not a readable Parquet file ({err}); restore it from the "
                              "stage that wrote it or re-run that stage") from None
        if listed.get(path, meta.num_rows) != meta.num_rows:
            raise SchemaError(f"{table} input file {path} holds {meta.num_rows} rows where the manifest of {loc.path} "
                              f"lists {listed[path]}: it was replaced after the stage wrote it; restore it from the "
                              "stage that wrote it or re-run that stage")
        this = meta.schema.to_arrow_schema().remove_metadata()
        if schema is None:
            schema = this
        elif not this.equals(schema):
            raise SchemaError(f"{table} input file {path} has schema {this} which differs from the other files "
                              f"({schema}); all files of a table must share one schema")
    return schema


def _listed_rows(loc: Location, table: str, files: list[str]) -> dict[str, int | None]:
    """The rows of each Parquet file the manifest of ``loc`` lists (None where it records none), by path; {} for a
    folder without a manifest or whose manifest lists no files. Raises :class:`SchemaError` when a listed file is
    missing or ``files`` holds one the manifest does not list (a table's files are those its stage wrote)."""
    manifest = read_manifest(loc)
    if manifest is None or "files" not in manifest:
        return {}
    listed = {f"{loc.path}/{f['name']}": f.get("rows") for f in manifest["files"]}
    missing = sorted(set(listed) - set(files))
    if missing:
        raise SchemaError(f"{table} input {loc.path}: {missing[0]} is listed in its manifest but missing; restore it "
                          "from the stage that wrote it or re-run that stage")
    extra = sorted(set(files) - set(listed))
    if extra:
        raise SchemaError(f"{table} input {loc.path}: {extra[0]} is not one of the files its manifest lists (it was "
                          "not written by the stage); move it out of the folder or re-run that stage")
    return listed


# An AWS error of the SDK as pyarrow reports it: "AWS Error NETWORK_CONNECTION during HeadBucket operation: ..."
_AWS_ERROR = re.compile(r"AWS Error (\w+)")
_CREDENTIAL_ERRORS = {"ACCESS_DENIED", "INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH", "INVALID_CLIENT_TOKEN_ID",
                      "MISSING_AUTHENTICATION_TOKEN", "UNRECOGNIZED_CLIENT", "EXPIRED_TOKEN"}
_CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
                   "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")


def _endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


# A file that fits one part is written to S3 in one PUT request when it closes, not three (start a multipart upload,
# upload the part, complete it): pyarrow's allow_delayed_open, which starts the multipart upload only when a part
# fills. A manifest, a metrics table or a turn's table is one request instead of three. What a delayed open defers —
# a missing bucket, refused credentials — then fails the write when the file closes, inside the same write; the
# bucket and credentials are checked before anything is written (check_store).
S3_OPTIONS = {"allow_delayed_open": True}  # pyarrow S3FileSystem options, also given as a URI's query


def _endpoint_options() -> dict:
    """S3FileSystem options for the endpoint in the environment (pyarrow's URI parsing reads AWS_ENDPOINT_URL, its
    S3FileSystem constructor does not)."""
    endpoint = _endpoint()
    if not endpoint:
        return {}
    url = urllib.parse.urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
    return {"endpoint_override": url.netloc, "scheme": url.scheme}


def _with_env_credentials(fs: pafs.S3FileSystem) -> pafs.S3FileSystem:
    """``fs`` holding the key in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN) when this
    process has one: the filesystem object travels to the Ray workers with the stage (pickled), and workers of a
    cluster started elsewhere (RAY_ADDRESS) or before these variables were set would not have them. Without them,
    ``fs`` as is: every process resolves credentials by the AWS default chain (profile, instance role, ...)."""
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if not (key and secret):
        return fs
    return pafs.S3FileSystem(access_key=key, secret_key=secret, session_token=os.environ.get("AWS_SESSION_TOKEN"),
                             region=fs.region, **S3_OPTIONS, **_endpoint_options())


def _store_problem(scheme: str, bucket: str, err: Exception) -> str:
    """What went wrong reaching ``scheme://bucket`` and the fix, from pyarrow's error text."""
    text = str(err)
    match = _AWS_ERROR.search(text)
    code = match.group(1) if match else ""
    where = f"{scheme}://{bucket} (endpoint {_endpoint() or 'AWS'})"
    if code in ("NETWORK_CONNECTION", "ENDPOINT_RESOLUTION_FAILURE") or "curlCode" in text:
        return (f"cannot reach {where}: {code or 'connection failed'}; check AWS_ENDPOINT_URL (scheme, host and "
                "port of the S3 server) and that the server is up")
    found = [k for k in _CREDENTIAL_ENV if os.environ.get(k)]
    if code in _CREDENTIAL_ERRORS or "HTTP status 403" in text or "HTTP status 401" in text or not found:
        # the request went out unsigned when no credentials are set: S3 answers 403, some servers another error
        why = "no credentials are set" if not found else f"the credentials ({', '.join(found)}) were refused"
        return (f"access to {where} failed ({code or text.splitlines()[0][:80]}): {why}; set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) to credentials that may read and write the bucket")
    return f"cannot use {where}: {text.splitlines()[0]}; check AWS_ENDPOINT_URL, the bucket name and the credentials"


def store_error(err: BaseException) -> ConfigError | None:
    """An object-store failure seen later than :func:`check_store` (the store went away, credentials were
    revoked) as a ConfigError saying what and the fix; None when ``err`` is not one."""
    text = str(err)
    if not isinstance(err, OSError) or "AWS Error" not in text:
        return None
    bucket = re.search(r"bucket '([^']+)'", text)
    return ConfigError(_store_problem("s3", bucket.group(1) if bucket else "?", err))


@functools.lru_cache(maxsize=None)
def _checked_store(scheme: str, bucket: str, env: tuple) -> None:
    if scheme != "s3":  # other stores (gs://, hdfs://) are used as pyarrow opens them, unchecked
        return
    options = _endpoint_options()
    if os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION"):
        options["region"] = os.environ.get("AWS_REGION") or os.environ["AWS_DEFAULT_REGION"]
    probe = pafs.S3FileSystem(retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1), connect_timeout=5,
                              request_timeout=10, **options)
    try:
        kind = probe.get_file_info(bucket).type
    except OSError as err:
        raise ConfigError(_store_problem(scheme, bucket, err)) from None
    if kind == pafs.FileType.NotFound:
        raise ConfigError(f"bucket {bucket} does not exist at {scheme}://{bucket} (endpoint "
                          f"{_endpoint() or 'AWS'})"
                          "; create it (rollflow does not create buckets) or fix the bucket name in the URI")


def check_store(scheme: str, bucket: str) -> None:
    """Raise a ConfigError saying what and the fix when the bucket of an object-store URI cannot be used: the
    endpoint is unreachable, the bucket is missing, or the credentials are missing or refused. One request per
    bucket, endpoint and credentials in a process; no retries, so a wrong endpoint fails in seconds. Also checks
    ``$ROLLFLOW_OBJSTORE_CACHE_GB`` (:func:`fetch_budget_bytes`), which the local copies of its checkpoints obey."""
    fetch_budget_bytes()
    env = tuple(os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION",
                                            *_CREDENTIAL_ENV, "AWS_SECRET_ACCESS_KEY"))
    _checked_store(scheme, bucket, env)


MIRROR_DIR = "mirror"  # <cache>/mirror/<scheme>/<bucket>/<path>: the local side of a run folder on an object store


def local_side(loc: Location) -> str:
    """The local folder for what a run folder needs as local files (its log, TensorBoard's event files, the report's
    HTML and plots): the folder itself when it is local; for a folder on an object store,
    ``<cache>/mirror/<scheme>/<bucket>/<path>`` (uploaded into the store by :func:`publish_local_side`)."""
    if loc.atomic_rename:
        return loc.path
    return str(cache_root_path() / MIRROR_DIR / loc.fs.type_name / loc.path)


def publish_local_side(loc: Location, names: tuple[str, ...]) -> list[str]:
    """Copy the folders ``names`` (e.g. ``logs``, ``report``) of the local side of ``loc`` (:func:`local_side`) into
    ``loc`` on its object store, each replacing the store's copy (deleted first: these are derived files, the local
    side holds all of them); nothing for a local folder. Returns the folders copied."""
    if loc.atomic_rename:
        return []
    side, copied = local_side(loc), []
    for name in names:
        if os.path.isdir(os.path.join(side, name)):
            loc.child(name).rmtree()
            upload_folder(os.path.join(side, name), loc.child(name))
            copied.append(loc.child(name).uri())
    return copied


def upload_folder(local_dir: str, dest: Location) -> None:
    """Copy every file under the local folder ``local_dir`` to ``dest`` (same relative paths)."""
    pafs.copy_files(local_dir, dest.path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=dest.fs,
                    use_threads=True)


# what one read of a fetch asks for: on S3 a ranged GET each (pyarrow's default, 1 MiB, made a 270 MB checkpoint
# 258 requests and their latencies; the tiny test model's 26 MB, 26)
FETCH_CHUNK_BYTES = 64 * 2**20


def fetch_committed(loc: Location, cache_dir: str) -> str:
    """A local copy of the object-store folder ``loc`` committed by the runner (its manifest names an attempt):
    the files its manifest lists, at their paths inside the attempt, plus the manifest; for code that needs local
    files (DeepSpeed, Hugging Face). Kept in ``cache_dir/<fingerprint>-<attempt>`` and reused: the objects of a
    committed attempt never change (the fingerprint alone names the inputs, and a re-run of the same inputs is a new
    attempt whose bytes may differ). Written into a temporary sibling renamed into place; each fetch or reuse marks
    the copy used, and a new fetch removes the least recently used copies over the cache's budget
    (:func:`prune_fetched`, ``$ROLLFLOW_OBJSTORE_CACHE_GB``). Returns the local path."""
    manifest = read_manifest(loc)
    if manifest is None or ATTEMPT_KEY not in manifest:
        raise SchemaError(f"{loc.uri()} holds no committed rollflow output (no manifest naming an attempt); pass a "
                          "folder a rollflow command wrote to this store, or a local folder")
    target = os.path.join(cache_dir, f"{manifest['fingerprint'][:24]}-{manifest[ATTEMPT_KEY].lstrip('.')}")
    if _mark_used(target):
        return target
    # one temporary folder per call: two threads of one process may fetch the same folder at once (an asynchronous
    # run's log-probs and the rollout it plays ahead both load the policy); with a name of the process alone, one
    # renamed the shared folder into place while the other still wrote into it (FileNotFoundError in the log-probs
    # stage of a resumed run on S3, tests/trainflow/test_async_rollout.py)
    tmp = f"{target}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    local = pafs.LocalFileSystem()
    prefix = f"{manifest[ATTEMPT_KEY]}/"
    for obj in manifest["objects"]:
        dest = os.path.join(tmp, obj["name"][len(prefix):])
        local.create_dir(os.path.dirname(dest), recursive=True)
        pafs.copy_files(f"{loc.path}/{obj['name']}", dest, source_filesystem=loc.fs, destination_filesystem=local,
                        chunk_size=FETCH_CHUNK_BYTES)
        if local.get_file_info(dest).size != obj["bytes"]:
            raise SchemaError(f"{loc.uri()}/{obj['name']} has another size than its manifest records; the folder "
                              "was changed after it was committed: run the command that wrote it again")
    local.create_dir(tmp, recursive=True)
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        f.write(json.dumps(manifest, indent=1, sort_keys=True))
    try:
        os.rename(tmp, target)
    except OSError:  # another process fetched it first
        local.delete_dir(tmp)
        _mark_used(target)
    prune_fetched(cache_dir, keep=target)
    return target


FETCH_BUDGET_ENV = "ROLLFLOW_OBJSTORE_CACHE_GB"
FETCH_BUDGET_GB = 20.0  # the local copies of object-store folders kept beyond those in use (fetch_committed)
FETCH_IN_USE_S = 1800.0  # a copy fetched or reused within this long is in use: never removed
FETCH_TMP_STALE_S = 86400.0  # a download's temporary folder untouched this long was left by a killed process
FETCH_GONE_STALE_S = 60.0  # a copy moved aside this long ago (its ctime: the rename) was left by a killed removal
_TMP, _GONE = ".tmp-", ".gone-"  # a download under way; a copy being removed


def _mark_used(folder: str) -> bool:
    """Record a use of the local copy ``folder`` (its modification time; :func:`prune_fetched` removes the least
    recently used first). False when there is no such copy (never fetched, or removed)."""
    try:
        os.utime(folder)
    except FileNotFoundError:
        return False
    except PermissionError:  # a cache shared with another user: the copy is used as it is, pruned by its owner
        return os.path.isdir(folder)
    return True


def fetch_budget_bytes() -> int:
    """How many bytes of local copies of object-store folders the cache keeps beyond those in use: ``$ROLLFLOW_
    OBJSTORE_CACHE_GB`` (GiB, default 20; 0 keeps only the copies in use). A ConfigError for another value."""
    text = os.environ.get(FETCH_BUDGET_ENV, "").strip()
    try:
        gib = float(text) if text else FETCH_BUDGET_GB
    except ValueError:
        gib = -1.0
    if not gib >= 0:  # NaN too
        raise ConfigError(f"{FETCH_BUDGET_ENV}={text!r} is not a size in GiB; set it to a number >= 0 (0 keeps only "
                          "the local copies of object-store checkpoints in use) or unset it (default "
                          f"{FETCH_BUDGET_GB:g})")
    return int(gib * 2**30)


def _folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(folder) for name in names)


def prune_fetched(cache_dir: str, budget: int | None = None, now: float | None = None,
                  keep: str | None = None) -> list[str]:
    """Remove the least recently used local copies in ``cache_dir`` (:func:`fetch_committed`) while their total size
    is over ``budget`` bytes (default :func:`fetch_budget_bytes`), never one used in the last FETCH_IN_USE_S seconds
    (a process may still be loading it), plus what killed processes left (their downloads' temporary folders after
    FETCH_TMP_STALE_S, interrupted removals after FETCH_GONE_STALE_S: a removal under way may still put its copy
    back). A copy is moved aside before it is removed and restored if it
    was used meanwhile; a process that finds its copy gone downloads it again. ``keep`` (the copy just fetched) is
    never removed. Returns the copies removed."""
    budget = fetch_budget_bytes() if budget is None else budget
    now = time.time() if now is None else now
    copies = []
    for entry in os.scandir(cache_dir):
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
            if (_GONE in entry.name and now - entry.stat().st_ctime > FETCH_GONE_STALE_S) or \
                    (_TMP in entry.name and now - entry.stat().st_mtime > FETCH_TMP_STALE_S):
                shutil.rmtree(entry.path, ignore_errors=True)
            elif _TMP not in entry.name and _GONE not in entry.name:
                copies.append((entry.stat().st_mtime, entry.path, _folder_bytes(entry.path)))
        except FileNotFoundError:  # renamed or removed by another process while this one looked
            continue
    total, removed = sum(size for *_, size in copies), []
    for used, path, size in sorted(copies):  # the least recently used first
        if total <= budget or now - used < FETCH_IN_USE_S:
            break
        if keep is not None and os.path.abspath(path) == os.path.abspath(keep):
            continue
        gone = f"{path}{_GONE}{uuid.uuid4().hex[:8]}"
        try:
            os.rename(path, gone)
        except OSError:  # removed by another process
            continue
        if now - os.stat(gone).st_mtime < FETCH_IN_USE_S:  # used since it was listed: put back
            try:
                os.rename(gone, path)
                continue
            except OSError:  # downloaded anew meanwhile: this one goes
                pass
        shutil.rmtree(gone, ignore_errors=True)
        total -= size
        removed.append(path)
    return removed
