"""The code sandbox: correct code passes, wrong code fails, and hostile code is scored as failed and contained.

Each hostile program prints what would prove an escape (a secret, a token from a server, ``ok`` after writing
outside its folder), and the test's expected output *is* that proof: a leak would make the run pass. Controls show
the same path works when it is not forbidden (the secret is readable to its owner, the server answers this process).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from stages.rewards.code_sandbox import CodeSandboxWorker
from stages.rewards.sandbox import UID_RANGE, SandboxLimits

FAST = SandboxLimits(cpu_seconds=2, wall_seconds=4, memory_mb=256, max_processes=16)
REPO = Path(__file__).resolve().parents[2]


def fenced(code: str) -> str:
    return "Solution:\n```python\n" + code + "\n```\n"


def io_test(stdin: str, stdout: str) -> str:
    return json.dumps([{"type": "stdin_stdout", "input": stdin, "output": stdout}])


@pytest.fixture(scope="module")
def worker(namespace_sandbox):
    return CodeSandboxWorker(sandbox=namespace_sandbox, cpu_seconds=2, wall_seconds=4, memory_mb=256,
                             max_processes=16)


@pytest.fixture(scope="module")
def short_worker(namespace_sandbox):
    """For programs that never finish: a 1 s CPU / 2 s wall budget keeps the tests short."""
    return CodeSandboxWorker(sandbox=namespace_sandbox, cpu_seconds=1, wall_seconds=2, memory_mb=256,
                             max_processes=16)


def sandbox_processes() -> list[int]:
    """PIDs of live processes owned by a sandbox uid (there must be none after a run)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and UID_RANGE[0] <= os.stat(f"/proc/{entry}").st_uid < UID_RANGE[1]:
                pids.append(int(entry))
        except OSError:
            pass
    return pids


def test_correct_code_passes_and_wrong_code_fails(worker):
    tests = io_test("2 3\n", "5\n")
    out = worker.score_batch({"response": [fenced("a, b = map(int, input().split())\nprint(a + b)"),
                                           fenced("a, b = map(int, input().split())\nprint(a * b)"),
                                           "no code block here"],
                              "ground_truth": [tests] * 3})
    assert out["scores"] == [1.0, 0.0, 0.0] and out["response_level_rewards"] == out["scores"]


def test_assert_and_pytest_tests(worker):
    tests = json.dumps({"tests": [{"type": "assert", "code": "assert sq(3) == 9"},
                                  {"type": "pytest", "code": "def test_neg():\n    assert sq(-2) == 4\n"}]})
    out = worker.score_batch({"response": [fenced("def sq(x):\n    return x * x"), fenced("def sq(x):\n    return 9"),
                                           fenced("import os\nos._exit(0)"), fenced("import sys\nsys.exit(0)")],
                              "ground_truth": [tests] * 4})
    # an early clean exit does not pass: the harness must print its token after the tests
    assert out["scores"] == [1.0, 0.0, 0.0, 0.0]


def test_a_solution_cannot_rewrite_its_tests(worker):
    tests = json.dumps([{"type": "assert", "code": "assert sq(3) == 9"},
                        {"type": "pytest", "code": "def test_sq():\n    assert sq(2) == 4\n"}])
    rewrite = ("import os\nfor name in os.listdir('.'):\n    if name.startswith('test_case_'):\n"
               "        open(name, 'w').write('pass')\ndef sq(x):\n    return 0\ndef test_sq():\n    pass")
    assert worker.score(fenced(rewrite), tests) == 0.0


def test_malformed_tests_cannot_be_scored(worker):
    out = worker.score_batch({"response": [fenced("print(1)")] * 3,
                              "ground_truth": ["not json", "[]", json.dumps([{"type": "fuzz"}])]})
    assert out["scores"] == [None, None, None]


def test_infinite_loop_is_stopped(short_worker):
    start = time.monotonic()
    assert short_worker.score(fenced("while True:\n    pass"), io_test("", "done\n")) == 0.0
    assert time.monotonic() - start < 30  # bounded (not a speed assertion: the limit is 1 s CPU / 2 s wall)
    assert sandbox_processes() == []


def test_sleeping_program_hits_the_wall_time_limit(namespace_sandbox):
    result = namespace_sandbox.run_python("import time\ntime.sleep(60)", limits=SandboxLimits(wall_seconds=1))
    assert result.status == "timeout"
    assert sandbox_processes() == []


def test_fork_bomb_is_contained(short_worker):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    assert short_worker.score(fenced(bomb), io_test("", "survived\n")) == 0.0
    assert sandbox_processes() == []  # every forked process died with the run


def test_background_process_dies_with_the_program(namespace_sandbox):
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n    os._exit(0)\n"
            "print('parent done')")
    result = namespace_sandbox.run_python(code, limits=FAST)
    assert result.ok and result.stdout.strip() == "parent done"
    time.sleep(0.2)
    assert sandbox_processes() == []


def test_memory_hog_is_refused(worker):
    hog = "blocks = []\nwhile True:\n    blocks.append(bytearray(64 * 1024 * 1024))\nprint('allocated')"
    assert worker.score(fenced(hog), io_test("", "allocated\n")) == 0.0
    big = "x = bytearray(1024 * 1024 * 1024)\nprint('allocated')"
    assert worker.score(fenced(big), io_test("", "allocated\n")) == 0.0


def test_output_flood_is_cut(namespace_sandbox):
    result = namespace_sandbox.run_python("while True:\n    print('x' * 1000)",
                                          limits=SandboxLimits(max_output_bytes=10_000, wall_seconds=5))
    assert result.status == "output_limit" and len(result.stdout) <= 10_000


@pytest.fixture
def token_server():
    """A TCP server on 127.0.0.1 that sends a token to whoever connects; records connections."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    token = "token-" + os.urandom(8).hex()
    accepted: list[str] = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                connection, address = server.accept()
            except OSError:
                continue
            accepted.append(address[0])
            connection.sendall(token.encode() + b"\n")
            connection.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], token, accepted
    stop.set()
    thread.join()
    server.close()


def test_network_connection_fails(worker, token_server):
    port, token, accepted = token_server
    with socket.create_connection(("127.0.0.1", port), timeout=2) as control:  # the server works for us
        assert control.recv(100).decode().strip() == token
    code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "print(s.recv(100).decode().strip())")
    assert worker.score(fenced(code), io_test("", token + "\n")) == 0.0
    assert len(accepted) == 1  # only the control connection arrived


def test_writing_outside_the_working_folder_fails(worker):
    outside = Path(tempfile.gettempdir()) / f"rollflow-escape-{os.urandom(4).hex()}"
    in_repo = REPO / f"rollflow-escape-{os.urandom(4).hex()}"
    code = (f"open('inside.txt', 'w').write('fine')\nassert open('inside.txt').read() == 'fine'\n"
            f"open({str(outside)!r}, 'w').write('x')\nopen({str(in_repo)!r}, 'w').write('x')\nprint('ok')")
    try:
        assert worker.score(fenced(code), io_test("", "ok\n")) == 0.0
        assert not outside.exists() and not in_repo.exists()
        inside_only = "open('inside.txt', 'w').write('fine')\nprint(open('inside.txt').read())"
        assert worker.score(fenced(inside_only), io_test("", "fine\n")) == 1.0  # control: its own folder works
    finally:
        outside.unlink(missing_ok=True)
        in_repo.unlink(missing_ok=True)


@pytest.fixture
def secret_files():
    """A secret (0600) and a public (0644) file in a folder anyone may enter: only the mode protects the secret."""
    secret = "s3cret-" + os.urandom(8).hex()
    folder = Path(tempfile.mkdtemp(prefix="rollflow-secret-"))
    folder.chmod(0o755)
    secret_file, public_file = folder / "secret.txt", folder / "public.txt"
    secret_file.write_text(secret)
    secret_file.chmod(0o600)
    public_file.write_text("public")
    public_file.chmod(0o644)
    yield secret, secret_file, public_file
    secret_file.unlink()
    public_file.unlink()
    folder.rmdir()


def test_parent_secrets_are_unreachable(worker, monkeypatch, secret_files):
    secret, secret_file, public_file = secret_files
    monkeypatch.setenv("ROLLFLOW_TEST_SECRET", secret)
    read_env = "import os\nprint(os.environ.get('ROLLFLOW_TEST_SECRET', 'missing'))"
    read_parent_env = f"print(open('/proc/{os.getpid()}/environ', 'rb').read().decode(errors='replace'))"
    read_file = f"print(open({str(secret_file)!r}).read())"
    read_public = f"print(open({str(public_file)!r}).read())"  # host files are not even visible
    read_system = "import os\nprint(len(open(os.__file__).read()) > 0)"  # control: the interpreter's files are
    out = worker.score_batch({"response": [fenced(c) for c in (read_env, read_parent_env, read_file, read_public,
                                                                   read_system)],
                              "ground_truth": [io_test("", secret + "\n")] * 3 + [io_test("", "public\n"),
                                                                                   io_test("", "True\n")]})
    assert out["scores"] == [0.0, 0.0, 0.0, 0.0, 1.0]


def test_an_unprivileged_uid_cannot_read_a_0600_file(secret_files):
    """The uid switch on its own (fallback mode as root shows host files): the 0600 secret stays unreadable while
    the public file next to it is read."""
    from stages.rewards.sandbox import Sandbox

    if os.geteuid() != 0:
        pytest.skip("the uid switch needs root")
    secret, secret_file, public_file = secret_files
    worker = CodeSandboxWorker(sandbox=Sandbox(mode="fallback"), wall_seconds=4)
    out = worker.score_batch({"response": [fenced(f"print(open({str(p)!r}).read())") for p in (secret_file,
                                                                                               public_file)],
                              "ground_truth": [io_test("", secret + "\n"), io_test("", "public\n")]})
    assert out["scores"] == [0.0, 1.0]


def test_killing_the_parent_fails_and_the_parent_lives(worker):
    me = os.getpid()
    code = (f"import os, signal\nfor pid in (os.getppid(), {me}, 1):\n    try:\n        os.kill(pid, signal.SIGKILL)\n"
            "    except OSError:\n        pass\nos.kill(" + str(me) + ", signal.SIGKILL)\nprint('killed')")
    assert worker.score(fenced(code), io_test("", "killed\n")) == 0.0
    assert os.getpid() == me  # still here


def test_a_hostile_batch_scores_every_row_and_the_pipeline_continues(worker):
    add = "a, b = map(int, input().split())\nprint(a + b)"
    hostile = ["while True:\n    pass", "import os\nwhile True:\n    os.fork()", "x = bytearray(2**31)",
               "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)"]
    responses = [fenced(add)] + [fenced(h) for h in hostile] + [fenced(add)]
    out = worker.score_batch({"response": responses, "ground_truth": [io_test("2 3\n", "5\n")] * len(responses)})
    assert out["scores"] == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert sandbox_processes() == []


def test_fallback_mode_runs_code_with_limits_and_refuses_the_network(token_server):
    """The weaker mode used without namespaces (non-root): limits plus an in-interpreter guard."""
    from stages.rewards.sandbox import Sandbox

    sandbox = Sandbox(mode="fallback")
    assert sandbox.info().mode == "fallback"
    worker = CodeSandboxWorker(sandbox=sandbox, cpu_seconds=1, wall_seconds=2)
    port, token, accepted = token_server
    connect = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
               "print(s.recv(100).decode().strip())")
    kill = f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)\nprint('killed')"
    out = worker.score_batch({"response": [fenced("print(int(input()) * 2)"), fenced("print(0)"),
                                           fenced(connect), fenced(kill), fenced("while True:\n    pass")],
                              "ground_truth": [io_test("21\n", "42\n")] * 2 + [io_test("", token + "\n"),
                                                                               io_test("", "killed\n"),
                                                                               io_test("", "x\n")]})
    assert out["scores"] == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert accepted == []


def test_bad_limits_and_file_names_are_config_errors(namespace_sandbox):
    from schemas.errors import ConfigError

    with pytest.raises(ConfigError, match="wall_seconds = 0"):
        SandboxLimits(wall_seconds=0)
    with pytest.raises(ConfigError, match="plain file name"):
        namespace_sandbox.run_python("pass", files={"../escape.py": "x"})


def test_extra_files_are_in_the_working_folder_and_stdin_is_fed(namespace_sandbox):
    code = "import sys\nprint(open('data.txt').read().strip(), sys.stdin.read().strip())"
    result = namespace_sandbox.run_python(code, "from stdin\n", files={"data.txt": "from file"}, limits=FAST)
    assert result.ok and result.stdout.strip() == "from file from stdin" and result.mode == "namespaces"
