import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# helpers.py, and the user-style modules under workers/ that configs reference as 'module:function'.
sys.path[:0] = [str(HERE), str(HERE / "workers")]

import os  # noqa: E402
import shutil  # noqa: E402
import sysconfig  # noqa: E402

import pytest  # noqa: E402

# Where the environment forbids writing bytecode (PYTHONDONTWRITEBYTECODE), each of the hundreds of
# processes the tests start would compile dtrain's modules and the test scripts again (~0.2 s of CPU
# each): here they are compiled once, by whichever process imports them first, as Python's default does.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# Counts the processes each test starts; the whole suite fails past pyproject's process_budget.
pytest_plugins = ["process_budget"]

# DTRAIN_REQUIRE_FULL=1 (CI sets it where the machine allows root and network namespaces): a test
# that skips fails instead, so a suite that quietly stopped testing something cannot pass. A skip that
# only says "this machine is of the other kind" (a GPU machine skipping a no-GPU check) is marked
# `machine_kind` and stays a skip.
REQUIRE_FULL = os.environ.get("DTRAIN_REQUIRE_FULL") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_FULL and report.skipped and not item.get_closest_marker("machine_kind"):
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped, and DTRAIN_REQUIRE_FULL=1 forbids skips: {reason}"


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A real S3 protocol server on loopback for the whole session (tests/s3server.py): its endpoint,
    bucket and credentials, and `s3.env` for the processes a test starts. Each test uses its own prefix."""
    from s3server import S3Server

    server = S3Server.start(tmp_path_factory.mktemp("s3"))
    yield server
    server.stop()


@pytest.fixture
def s3_here(s3, monkeypatch):
    """The S3 server for code in this test's own process: boto's environment set, and fsspec's cached
    filesystems forgotten before and after (one made with other credentials is never reused)."""
    import s3fs

    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()
    yield s3
    s3fs.S3FileSystem.clear_instance_cache()


def _prepared_json_package(tmp_path_factory, name: str, *tokenizer_args: str) -> Path:
    """The standard library's json package (real text nobody here wrote) prepared as token data by
    `dtrain prepare`, once a session for every test module that trains the built-in GPT on it."""
    from helpers import dtrain, ok

    corpus = tmp_path_factory.mktemp(f"json-corpus-{name}")
    stdlib_json = Path(sysconfig.get_paths()["stdlib"]) / "json"
    shutil.copytree(stdlib_json, corpus / "json", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp(f"json-tokens-{name}") / name
    ok(dtrain("prepare", "text", str(corpus), "--out", str(out), *tokenizer_args, "--workers", "1"))
    return out


@pytest.fixture(scope="session")
def json_byte_tokens(tmp_path_factory):
    """The json package as byte tokens (a vocabulary of 257)."""
    return _prepared_json_package(tmp_path_factory, "bytes", "--tokenizer", "bytes")


@pytest.fixture(scope="session")
def json_bpe_tokens(tmp_path_factory):
    """The json package as BPE tokens with a tokenizer of 300 entries trained on it."""
    return _prepared_json_package(tmp_path_factory, "bpe", "--vocab-size", "300")


@pytest.fixture
def cli(capfd, monkeypatch):
    """`cli("run", ...)`: `dtrain ARGS` answered in this process, for the refusals that come before any
    worker starts (a subprocess costs a Python start and often `import torch`; this costs milliseconds).
    Returns what `helpers.dtrain` does (returncode, stdout, stderr); `cwd` and `extra_env` as there. What the command
    changes in the process (signal handlers, os.environ, sys.stdout and sys.stderr, the working folder)
    is put back. The real command line, its exit status and "printed once, not once per rank" stay
    proven by the subprocess tests."""
    import signal
    import subprocess

    from helpers import NOT_INHERITED, ROOT

    def call(
        *args: str, cwd: Path | None = None, extra_env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        from dtrain.cli import main

        handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        environ, streams = dict(os.environ), (sys.stdout, sys.stderr)
        with monkeypatch.context() as patch:
            patch.chdir(cwd or ROOT)
            for name in [n for n in os.environ if n.startswith(NOT_INHERITED)]:  # as helpers.env() leaves them out
                patch.delenv(name)
            for name, value in (extra_env or {}).items():
                patch.setenv(name, value)
            capfd.readouterr()  # what came before is not this command's
            if "s3fs" in sys.modules:  # a new process connects anew, with the credentials this one gives
                sys.modules["s3fs"].S3FileSystem.clear_instance_cache()
            try:
                status = main(list(args))
            except SystemExit as exc:  # argparse's own exits
                status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            finally:
                sys.stdout, sys.stderr = streams
                os.environ.clear()
                os.environ.update(environ)
                for signum, handler in handlers.items():
                    signal.signal(signum, handler)
            out, err = capfd.readouterr()
        import torch.distributed as dist

        # A command that trained here would leave state behind: those belong in a subprocess (helpers.dtrain).
        assert not (dist.is_available() and dist.is_initialized()), f"dtrain {' '.join(args)} left a process group"
        return subprocess.CompletedProcess(["dtrain", *args], status, out, err)

    return call


def _warm_workers(nproc: int):
    from pool import Pool

    workers = Pool(nproc)
    yield workers
    workers.stop()


@pytest.fixture(scope="session")
def pool():
    """A warm pair of workers for `dtrain run ... --nproc 2` jobs whose outputs a test reads (tests/pool.py)."""
    yield from _warm_workers(2)


@pytest.fixture(autouse=True)
def _dataloader_workers_end_with_their_test():
    """A DataLoader iterator a test leaves behind keeps its worker processes; collected during some later
    test, it shuts them down one by one, each join timing out (5 s), and that test sits idle. They end
    with the test that started them, as multiprocessing ends a process's daemonic children at its exit."""
    import multiprocessing

    before = set(multiprocessing.active_children())
    yield
    for child in multiprocessing.active_children():
        if child.daemon and child not in before:
            child.kill()
            child.join()


@pytest.fixture(scope="session")
def wide_pools():
    """Warm workers of other sizes (4, 8 processes), started by a module's first job of that size."""
    pools: dict = {}
    yield pools
    for workers in pools.values():
        workers.stop()


@pytest.fixture(scope="module", autouse=True)
def _wide_pools_end_with_their_module(wide_pools):
    """A few modules run jobs of 4 or 8 processes: their workers leave with the module rather than sit
    idle, holding memory, through the rest of the suite."""
    yield
    for workers in wide_pools.values():
        workers.stop()
    wide_pools.clear()


@pytest.fixture(scope="session")
def workers_of(pool, solo, wide_pools):
    """The warm workers for jobs of `nproc` processes (2: pool, 1: solo, others: a pool for the module)."""
    from pool import Pool

    return lambda nproc: {1: solo, 2: pool}.get(nproc) or wide_pools.setdefault(nproc, Pool(nproc))


@pytest.fixture(scope="session")
def warm(workers_of):
    """`warm("run", ...)`, `warm("launch", "--nproc", "2", SCRIPT, ...)`: the job on the warm workers of its
    --nproc, as `helpers.dtrain` would run it."""
    from pool import without_nproc

    return lambda *args, **kwargs: workers_of(without_nproc(args)[1]).run(*args, **kwargs)


@pytest.fixture(scope="session")
def warm_torchrun(workers_of):
    """`warm_torchrun(script, *args, nproc=2)`: what `helpers.torchrun` returns, the script run on warm
    workers (one process: under torchrun itself, whose group is the script's own)."""
    from helpers import torchrun

    def run(script, *args, nproc: int = 2, **kwargs):
        if nproc == 1:
            return torchrun(script, *args, nproc=1, **kwargs)
        return workers_of(nproc).torchrun(script, *args, **kwargs)

    return run


@pytest.fixture(scope="session")
def solo():
    """A warm process for `dtrain run ...` jobs of one process whose outputs a test reads (tests/pool.py)."""
    yield from _warm_workers(1)


@pytest.fixture(scope="session")
def quick_start(tmp_path_factory) -> Path:
    """A fresh folder holding a clean clone's examples/ where the README's quick-start job has run to
    its end, as written (a real `dtrain run`): what the README test goes on from and the front door's
    reruns read. A test that changes it works on a copy."""
    from helpers import QUICK_START, ROOT, ok, run

    folder = tmp_path_factory.mktemp("quick")
    shutil.copytree(ROOT / "examples", folder / "examples")
    said = ok(run(QUICK_START, cwd=folder))
    assert "error" not in said.stderr.lower(), said.stderr
    return folder
