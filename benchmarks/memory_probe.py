"""Child process of the memory benchmark: peak RSS while execute() streams one shape.

    python memory_probe.py '{"url": ..., "shape": ..., "warmup": ..., "chars": ..., "tail": ...,
                             "route": "on_output" or "iter_output"}'

The route is how the output is taken live: execute()'s on_output callback,
or start() and a loop over iter_output() that keeps nothing, then wait().

After the imports, the Client and one trivial warm-up execute(), it reads its
idle RSS, resets the RSS high-water mark (Linux: "5" written to
/proc/self/clear_refs, checked to work), streams the shape through execute()
with the default max_output_chars and reads the high-water mark. Where the
mark cannot be reset, the peak is the process's lifetime maximum
(resource.getrusage), and the answer says so. Prints one JSON object.
"""

from __future__ import annotations

import gc
import json
import os
import re
import sys
from typing import Dict, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from stream_server import API_KEY, SANDBOX, TAIL_CHARS  # noqa: E402

import createos_exec  # noqa: E402

STATUS = "/proc/self/status"


def status_kib() -> Optional[Dict[str, int]]:
    """VmRSS and VmHWM in KiB, or None without /proc."""
    try:
        with open(STATUS, encoding="ascii") as status:
            text = status.read()
    except OSError:
        return None
    return {name: int(kib) for name, kib in re.findall(r"(VmRSS|VmHWM):\s+(\d+) kB", text)}


def reset_high_water_mark() -> bool:
    """Reset VmHWM to the current RSS; True when it demonstrably worked."""
    ballast = bytearray(32 * 1024 * 1024)  # raise the mark above the current RSS
    ballast[::4096] = b"x" * len(range(0, len(ballast), 4096))
    del ballast
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    figures = status_kib()
    return figures is not None and figures["VmHWM"] <= figures["VmRSS"] + 1024


def lifetime_peak_kib() -> int:
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # KiB on Linux


def main(argv: list) -> int:
    spec = json.loads(argv[1])
    client = createos_exec.Client(spec["url"], API_KEY)
    client.execute(SANDBOX, spec["warmup"])
    gc.collect()
    reset = reset_high_water_mark()
    figures = status_kib()
    idle = figures["VmRSS"] if figures else lifetime_peak_kib()

    chars = 0

    def count(stream: str, text: str) -> None:
        nonlocal chars
        chars += len(text)

    if spec.get("route") == "iter_output":
        process = client.start(SANDBOX, spec["shape"])
        for stream, text in process.iter_output():
            count(stream, text)
        result = process.wait()
    else:
        result = client.execute(SANDBOX, spec["shape"], on_output=count)
    after = status_kib()
    peak = after["VmHWM"] if reset and after else lifetime_peak_kib()
    verified = (
        result.exit_code == 0
        and chars == spec["chars"]
        and result.stdout[-TAIL_CHARS:] == spec["tail"][-TAIL_CHARS:]
    )
    answer = {
        "idle_kib": idle,
        "peak_kib": peak,
        "method": "clear_refs" if reset else "getrusage",
        "seconds": result.duration,
        "verified": verified,
    }
    sys.stdout.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
