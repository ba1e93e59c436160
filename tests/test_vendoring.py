"""The module works when copied alone beside a script, and when installed by pip.

Legacy codebases vendor `createos_exec.py`: no package metadata, no test
helpers, no other dependency. One test builds exactly that situation — an
empty directory, a fresh virtual environment holding `requests` only — and
runs a command against the local server from a script there. Another
installs the package into a fresh virtual environment, as a user would, and
checks what the installed distribution gives: the types for the user's mypy
and the createos-exec command.

Where uv is installed (CI installs it), it makes the environments and
installs into them, in seconds rather than pip's most of a minute each; the
package is built by the same setuptools backend either way.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

from support import ROOT, require

import createos_exec as cx

MODULE = os.path.join(ROOT, "createos_exec.py")

# `requests` and what it depends on; nothing else may be installed.
EXPECTED_PACKAGES = {"requests", "certifi", "charset-normalizer", "idna", "urllib3"}
INSTALLER_PACKAGES = {"pip", "setuptools", "wheel"}

SCRIPT = """\
import os
import sys

import createos_exec

print("version", createos_exec.__version__)
print("module", os.path.dirname(os.path.realpath(createos_exec.__file__)))
print("prefix", os.path.realpath(sys.prefix))
result = createos_exec.execute("sb_local", ["echo", "vendored"], timeout=30)
print("exit_code", result.exit_code)
print("stdout", repr(result.stdout))
"""


def test_version_is_a_string_literal_in_the_source():
    # Vendored copies have no package metadata: the version must be in the file.
    with open(MODULE, encoding="utf-8") as handle:
        source = handle.read()
    match = re.search(r'^__version__ = "([0-9][^"]*)"$', source, re.M)
    assert match is not None
    assert match.group(1) == cx.__version__


def _venv_python(venv):
    if os.name == "nt":  # pragma: no cover - the local server is Linux only
        return str(venv / "Scripts" / "python.exe")
    return str(venv / "bin" / "python")


def _clean_env(**extra):
    """The caller's environment minus anything that would leak the repository in."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("PYTHON", "CREATEOS_", "PIP_REQUIRE_VIRTUALENV"))
        and name not in ("VIRTUAL_ENV", "CONDA_PREFIX", "__PYVENV_LAUNCHER__")
    }
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PYTHONNOUSERSITE"] = "1"
    env.update(extra)
    return env


UV = shutil.which("uv")


def _fresh_venv(venv, env):
    """A fresh virtual environment at `venv`, of this Python; its interpreter's path."""
    if UV:
        _run([UV, "venv", "--quiet", "--python", sys.executable, str(venv)], timeout=60, env=env)
    else:
        _run([sys.executable, "-m", "venv", str(venv)], timeout=60, env=env)
    return _venv_python(venv)


def _pip(python, *args, env, timeout=300):
    """`pip <args>` in the environment of `python`."""
    command = [UV, "pip", *args, "--python", python] if UV else [python, "-m", "pip", *args]
    return _run(command, timeout=timeout, env=env)


def _run(args, *, timeout, **kwargs):
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-2000:])
    return done


def test_a_copy_of_the_module_alone_runs_a_command_in_a_fresh_venv(server, tmp_path):
    venv = tmp_path / "venv"
    app = tmp_path / "app"
    app.mkdir()
    env = _clean_env(TMPDIR=str(tmp_path))  # what the installers leave is the test's

    python = _fresh_venv(venv, env)
    _pip(python, "install", "--quiet", "requests", env=env)

    shutil.copy(MODULE, app / "createos_exec.py")
    (app / "run.py").write_text(SCRIPT, encoding="utf-8")
    assert sorted(os.listdir(app)) == ["createos_exec.py", "run.py"]

    run_env = _clean_env(CREATEOS_API_URL=server.url, CREATEOS_API_KEY=server.api_key)
    done = _run([python, "run.py"], timeout=60, cwd=str(app), env=run_env)
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert lines == {
        "version": cx.__version__,
        "module": os.path.realpath(app),  # the copy, not the repository's module
        "prefix": os.path.realpath(venv),
        "exit_code": "0",
        "stdout": repr("vendored\n"),
    }
    assert done.stderr == ""
    (record,) = server.processes()
    assert record["exit_code"] == 0

    listing = _pip(python, "list", "--format=json", env=env, timeout=60)
    installed = {
        re.sub(r"[-_.]+", "-", package["name"]).lower() for package in json.loads(listing.stdout)
    }
    assert installed - INSTALLER_PACKAGES == EXPECTED_PACKAGES


# What a user's own code looks like: correct, and returning a str as an int.
USER_CODE_CORRECT = """\
from __future__ import annotations

from typing import List, Optional

import createos_exec as cx


def greeting(sandbox_id: str) -> str:
    return cx.execute(sandbox_id, ["echo", "hi"], timeout=60).stdout


def served(client: cx.Client) -> Optional[int]:
    with client.start("sb_123", ["python3", "-m", "http.server", "8000"]) as server:
        client.execute("sb_123", ["curl", "-s", "localhost:8000"], check=True)
        return server.poll()


def waited(process: cx.RemoteProcess) -> cx.ExecResult:
    try:
        return process.wait(timeout=1.5)
    except cx.WaitTimeout as stopped:
        print(stopped.timeout, stopped.process_id)
        raise


def report(client: cx.Client) -> bytes:
    info: cx.FileInfo = cx.put("sb_123", b"print(1)", "/app/main.py", mode=0o644, client=client)
    assert client.get("sb_123", "/app/out.tar", "out.tar").sha256 != info.sha256
    return client.get("sb_123", "/app/report.html")


def archived(client: cx.Client, sandbox_id: str) -> bytes:
    def keep(stream: str, data: bytes) -> None:
        print(stream, len(data))

    tar: bytes = client.execute(sandbox_id, ["tar", "c", "."], text=False, on_output=keep).stdout
    listed: str = client.execute(sandbox_id, ["ls"], text=True).stdout
    loop = cx.start(sandbox_id, ["cat", "f"], text=False).iter_output(lines=True)
    pieces: List[bytes] = [data for _, data in loop]
    lines: List[str] = [line for _, line in client.process(sandbox_id, "proc_1").iter_output()]
    again: cx.ExecResult[bytes] = client.attach(sandbox_id, "proc_1", text=False)
    return tar + b"".join(pieces) + again.stdout + (listed + "".join(lines)).encode()
"""
USER_CODE_WRONG = """\
from typing import List

import createos_exec as cx


def greeting(sandbox_id: str) -> int:
    return cx.execute(sandbox_id, ["echo", "hi"]).stdout


def started(sandbox_id: str) -> cx.RemoteProcess:
    return cx.start(sandbox_id, "make", detach=True)


def archived(sandbox_id: str) -> str:
    return cx.execute(sandbox_id, ["tar", "c", "."], text=False).stdout


def lines(process: cx.RemoteProcess[bytes]) -> List[str]:
    return [line for _, line in process.iter_output(lines=True)]
"""
DISTRIBUTION = (
    "createos_exec.py",
    "setup.py",
    "setup.cfg",
    "pyproject.toml",
    "README.md",
    "LICENSE",
)


def _site_packages(python):
    done = _run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], timeout=60
    )
    return done.stdout.strip()


def test_the_installed_package_types_users_code_and_has_its_command(tmp_path):
    mypy = require("mypy")
    source = tmp_path / "source"
    source.mkdir()
    for name in DISTRIBUTION:
        shutil.copy(os.path.join(ROOT, name), source / name)
    venv = tmp_path / "venv"
    env = _clean_env(TMPDIR=str(tmp_path))  # what the installers leave is the test's
    python = _fresh_venv(venv, env)
    _pip(python, "install", "--quiet", str(source), env=env)

    site = _site_packages(python)
    with open(MODULE, encoding="utf-8") as handle:
        module = handle.read()
    for installed in ("createos_exec.py", os.path.join("createos_exec-stubs", "__init__.pyi")):
        with open(os.path.join(site, installed), encoding="utf-8") as handle:
            assert handle.read() == module, installed  # the one file, as it is vendored

    (tmp_path / "correct.py").write_text(USER_CODE_CORRECT, encoding="utf-8")
    (tmp_path / "wrong.py").write_text(USER_CODE_WRONG, encoding="utf-8")
    check = [
        sys.executable, "-m", "mypy", "--strict", "--python-executable", python,
        "--cache-dir", str(tmp_path / "mypy-cache"), "--config-file", os.devnull,
    ]  # fmt: skip
    # One run for both files: only the wrong one has errors, each keyword typed.
    checked = subprocess.run(
        check + ["correct.py", "wrong.py"],
        cwd=str(tmp_path), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert checked.returncode == 1, (mypy.__file__, checked.stdout)
    errors = [line for line in checked.stdout.splitlines() if ": error:" in line]
    assert errors[:1] + errors[-2:] == [
        'wrong.py:7: error: Incompatible return value type (got "str", expected "int")  '
        "[return-value]",  # text by default
        'wrong.py:15: error: Incompatible return value type (got "bytes", expected "str")  '
        "[return-value]",  # bytes with text=False
        "wrong.py:19: error: List comprehension has incompatible type List[bytes]; expected "
        "List[str]  [misc]",
    ]
    # The unknown keyword matches none of start()'s overloads (one for each kind of output).
    assert errors[1:-2] and all(
        line.startswith("wrong.py:11: ") and '"start"' in line or "[no-any-return]" in line
        for line in errors[1:-2]
    )
    assert "import-untyped" not in checked.stdout  # and nothing said of the package's own
    # lines, but where the keyword's function is (an older mypy's note on the unknown keyword):
    assert all(
        line.startswith(("wrong.py:", "Found ")) or line.endswith(': note: "start" defined here')
        for line in checked.stdout.splitlines()
    )

    script = os.path.join(os.path.dirname(python), "createos-exec")
    version = _run([script, "--version"], timeout=60, env=env)
    assert version.stdout == f"createos-exec {cx.__version__}\n"
    assert _run([python, "-m", "createos_exec", "--version"], timeout=60, env=env).stdout == (
        f"python -m createos_exec {cx.__version__}\n"
    )
