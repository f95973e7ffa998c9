"""A real local S3 server for tests (moto's server mode, in the test process, on a free port): the ``s3`` fixture,
one server per module that imports it (``from tests.objstore import s3``), and helpers to look at what it holds."""

from __future__ import annotations

import logging
import os
import threading

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from stages.storage import Location

BUCKET = "rollflow-test"
_LIVE: list = [None]  # the module's running _S3Server


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server in this process with one bucket; this process's AWS_* variables point at it (restored
    after the module). Yields the environment to give child processes."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    server = _LIVE[0] = _S3Server()
    host, port = server.address
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
        _LIVE[0] = None


def requests_seen() -> list[tuple[str, str, str]]:
    """``(method, path, query)`` of every request the module's S3 server answered so far, in order."""
    assert _LIVE[0] is not None, "no S3 server: the test needs the s3 fixture"
    return list(_LIVE[0].requests)


class _S3Server:
    """moto's S3 service alone behind werkzeug's threaded server, on a free port of 127.0.0.1. moto's own
    ``ThreadedMotoServer`` serves every AWS service and finds each request's anew (it lists moto's package folder
    and matches the host against every service's URL patterns: 17 CPU-s of a suite's S3 requests)."""

    def __init__(self) -> None:
        from moto.moto_server.werkzeug_app import MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        app, self.requests = create_backend_app("s3"), []

        def recorded(environ, start_response):
            self.requests.append((environ["REQUEST_METHOD"], environ["PATH_INFO"], environ.get("QUERY_STRING", "")))
            return app(environ, start_response)

        self._server = make_server("127.0.0.1", 0, recorded, threaded=True, request_handler=MotoRequestHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="moto-s3", daemon=True)
        self._thread.start()
        self.address = self._server.server_address[:2]

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join()


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
