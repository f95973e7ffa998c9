"""Run-folder I/O through pyarrow filesystems: local paths by default, any pyarrow URI (s3://, gs://, ...) where
the cluster has credentials. Every stage reads and writes through these helpers, never through ``open``/``os``."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from schemas.errors import SchemaError

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Location:
    """A folder on a pyarrow filesystem."""

    fs: pafs.FileSystem
    path: str

    @classmethod
    def of(cls, where: str) -> "Location":
        if "://" in where:
            fs, path = pafs.FileSystem.from_uri(where)
            return cls(fs, path.rstrip("/"))
        import os

        return cls(pafs.LocalFileSystem(), os.path.abspath(where))

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
        with self.fs.open_input_stream(self.path) as f:
            return f.read().decode()

    def write_text(self, text: str) -> None:
        with self.fs.open_output_stream(self.path) as f:
            f.write(text.encode())

    def list(self) -> list[pafs.FileInfo]:
        return self.fs.get_file_info(pafs.FileSelector(self.path, recursive=False))

    def parquet_files(self) -> list[str]:
        """Sorted paths of the Parquet files directly in this folder."""
        return sorted(i.path for i in self.list() if i.type == pafs.FileType.File and i.path.endswith(".parquet"))

    def rmtree(self) -> None:
        if self.exists():
            self.fs.delete_dir(self.path)

    def rename(self, dest: "Location") -> None:
        self.fs.move(self.path, dest.path)


def read_manifest(loc: Location) -> dict | None:
    m = loc.child(MANIFEST)
    if not m.exists():
        return None
    try:
        return json.loads(m.read_text())
    except json.JSONDecodeError as err:
        raise SchemaError(f"manifest {m.path} is not valid JSON ({err}); delete the folder {loc.path} and re-run "
                          "the stage that produced it") from None


def folder_fingerprint(loc: Location) -> str:
    """The manifest fingerprint of a stage output, or, for a plain folder of Parquet files, a hash of the file
    names, sizes and modification times."""
    manifest = read_manifest(loc)
    if manifest is not None:
        return manifest["fingerprint"]
    h = hashlib.sha256()
    for info in sorted((i for i in loc.list() if i.path.endswith(".parquet")), key=lambda i: i.path):
        h.update(f"{info.base_name}:{info.size}:{info.mtime_ns}".encode())
    return h.hexdigest()


def read_table_schema(loc: Location, table: str):
    """The common Arrow schema of the Parquet files in ``loc``. Raises :class:`SchemaError` naming a file that is
    missing, corrupt or whose schema differs from the others."""
    if not loc.is_dir():
        raise SchemaError(f"{table} input {loc.path} does not exist or is not a folder; pass the folder that holds "
                          "the Parquet files")
    files = loc.parquet_files()
    if not files:
        raise SchemaError(f"{table} input {loc.path} holds no .parquet files; pass a stage output folder or a folder "
                          "of Parquet files (rollflow example --output DIR makes one)")
    schema = None
    for path in files:
        try:
            with loc.fs.open_input_file(path) as f:
                this = pq.read_schema(f)
        except Exception as err:  # pyarrow raises ArrowInvalid / OSError for corrupt files
            raise SchemaError(f"{table} input file {path} is not a readable Parquet file ({err}); restore it from the "
                              "stage that wrote it or re-run that stage") from None
        this = this.remove_metadata()
        if schema is None:
            schema = this
        elif not this.equals(schema):
            raise SchemaError(f"{table} input file {path} has schema {this} which differs from the other files "
                              f"({schema}); all files of a table must share one schema")
    return schema
