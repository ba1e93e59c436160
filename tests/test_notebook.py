"""Notebooks: live output with `createos_exec.echo`, and an interrupted cell.

A real Jupyter kernel (ipykernel, driven through jupyter_client) runs a cell
that executes a long command against the local server. Its first line of
output must reach the notebook while the command runs; interrupting the
kernel must end the cell with KeyboardInterrupt, terminate the remote process
tree, and leave the kernel usable.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import time

import pytest
from support import ROOT, SANDBOX, require

require("ipykernel")
require("jupyter_client")

from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402
from jupyter_client.manager import KernelManager  # noqa: E402

KERNEL_NAME = "createos-exec-test"
STARTUP_TIMEOUT = 30.0
STEP_TIMEOUT = 15.0
COMMAND = "echo started; echo warming up >&2; sleep 60"


def _write_kernelspec(directory):
    """A kernelspec running ipykernel on this very interpreter (works inside a venv)."""
    spec_dir = directory / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "createos_exec tests",
        "language": "python",
        "interrupt_mode": "signal",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec), encoding="utf-8")


def _kernel_env(server, tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env["CREATEOS_API_URL"] = server.url
    env["CREATEOS_API_KEY"] = server.api_key
    env.pop("CREATEOS_SANDBOX_API_KEY", None)
    env["IPYTHONDIR"] = str(tmp_path / "ipython")  # no history written to the real profile
    env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"  # quiet debugpy on frozen modules
    return env


def _next_message(receive, msg_id, deadline, what):
    """The next message of one execution from `receive` (a channel), or a failure."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            pytest.fail(f"no message in time while waiting for {what}")
        try:
            msg = receive(timeout=remaining)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") == msg_id:
            return msg


def _drain_until_idle(kc, msg_id, deadline, what, outputs):
    """Collect the execution's iopub messages until the kernel reports idle."""
    while True:
        msg = _next_message(kc.get_iopub_msg, msg_id, deadline, what)
        kind = msg["msg_type"]
        if kind == "status" and msg["content"]["execution_state"] == "idle":
            return
        outputs.append(msg)


def _streamed(outputs, name):
    return "".join(
        m["content"]["text"]
        for m in outputs
        if m["msg_type"] == "stream" and m["content"]["name"] == name
    )


@pytest.mark.timeout(60)
def test_interrupting_a_notebook_cell_terminates_the_remote_tree(server, tmp_path):
    kernels = tmp_path / "kernels"
    _write_kernelspec(kernels)
    km = KernelManager(
        kernel_name=KERNEL_NAME,
        kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)]),
        connection_file=str(tmp_path / "connection.json"),
    )
    # The kernel's own stdout/stderr (not the notebook's) go to a log for diagnosis.
    with open(tmp_path / "kernel.log", "wb") as log:
        km.start_kernel(env=_kernel_env(server, tmp_path), stdout=log, stderr=log)
    kc = km.client()
    try:
        kc.start_channels()
        kc.wait_for_ready(timeout=STARTUP_TIMEOUT)
        assert km.kernel_spec.argv[0] == sys.executable

        # Cell 1: a long command whose first line is echoed live into the notebook.
        cell = (
            "import createos_exec as cx\n"
            f"cx.execute({SANDBOX!r}, {COMMAND!r}, shell=True, on_output=cx.echo)\n"
        )
        started_at = time.monotonic()
        msg_id = kc.execute(cell)
        deadline = started_at + STEP_TIMEOUT
        outputs = []
        while "started" not in _streamed(outputs, "stdout") or not _streamed(outputs, "stderr"):
            msg = _next_message(kc.get_iopub_msg, msg_id, deadline, "the live output of cell 1")
            assert msg["msg_type"] != "error", msg["content"]
            outputs.append(msg)

        # The command is running remotely: exactly one process, tree alive.
        processes = server.processes(SANDBOX)
        assert len(processes) == 1, processes
        process_id = processes[0]["process_id"]
        assert server.tree_alive(process_id)
        assert server.requests_to("delete") == []

        km.interrupt_kernel()
        reply = _next_message(
            kc.get_shell_msg, msg_id, time.monotonic() + STEP_TIMEOUT, "the interrupted cell"
        )
        _drain_until_idle(kc, msg_id, time.monotonic() + STEP_TIMEOUT, "idle after cell 1", outputs)
        # Far from the 60 s of the command: the interrupt, not its end, stopped the cell.
        assert time.monotonic() - started_at < 30

        assert reply["content"]["status"] == "error", reply["content"]
        assert reply["content"]["ename"] == "KeyboardInterrupt", reply["content"]
        # echo writes the text as is, to the right stream: no newline added, nothing after.
        assert _streamed(outputs, "stdout") == "started\n"
        assert _streamed(outputs, "stderr") == "warming up\n"

        assert server.wait_tree_gone(process_id, timeout=10.0)
        deletes = server.requests_to("delete")
        assert [(r.path.rsplit("/", 1)[-1], r.status) for r in deletes] == [(process_id, 200)]
        record = server.process(process_id)
        assert record["tree_exited"] is True
        assert record["signal"] in ("SIGTERM", "SIGKILL"), record

        # Cell 2: the kernel, and the module in it, still work.
        cell = f"cx.execute({SANDBOX!r}, ['echo', 'again'], on_output=cx.echo).exit_code"
        msg_id = kc.execute(cell)
        reply = _next_message(kc.get_shell_msg, msg_id, time.monotonic() + STEP_TIMEOUT, "cell 2")
        outputs = []
        _drain_until_idle(kc, msg_id, time.monotonic() + STEP_TIMEOUT, "idle after cell 2", outputs)
        assert reply["content"]["status"] == "ok", reply["content"]
        assert _streamed(outputs, "stdout") == "again\n"
        results = [m["content"]["data"] for m in outputs if m["msg_type"] == "execute_result"]
        assert results == [{"text/plain": "0"}]
        assert len(server.processes(SANDBOX)) == 2
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
