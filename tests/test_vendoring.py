"""The module works when copied alone beside a script, with only `requests` installed.

Legacy codebases vendor `createos_exec.py`: no package metadata, no test
helpers, no other dependency. This test builds exactly that situation — an
empty directory, a fresh virtual environment holding `requests` only — and
runs a command against the local server from a script there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

from conftest import ROOT

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


def _run(args, *, timeout, **kwargs):
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-2000:])
    return done


def test_a_copy_of_the_module_alone_runs_a_command_in_a_fresh_venv(server, tmp_path):
    venv = tmp_path / "venv"
    app = tmp_path / "app"
    app.mkdir()
    env = _clean_env()

    _run([sys.executable, "-m", "venv", str(venv)], timeout=60, env=env)
    python = _venv_python(venv)
    _run([python, "-m", "pip", "install", "--quiet", "requests"], timeout=120, env=env)

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

    listing = _run([python, "-m", "pip", "list", "--format=json"], timeout=60, env=env)
    installed = {
        re.sub(r"[-_.]+", "-", package["name"]).lower() for package in json.loads(listing.stdout)
    }
    assert installed - INSTALLER_PACKAGES == EXPECTED_PACKAGES
