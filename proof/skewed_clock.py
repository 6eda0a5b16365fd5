"""Run a module with this process's wall clock off by a fixed offset: a host whose clock is
wrong (NTP not running, a VM resumed from a snapshot), for the chaos harness's ``clock-skew``.

``python -m proof.skewed_clock OFFSET_SECONDS MODULE ARGS...`` shifts ``time.time`` before the
module (and everything it imports) reads it, so injected-clock defaults (``clock=time.time``)
and direct reads alike see the skewed time. Monotonic clocks stay true, as they do on a host
whose wall clock is wrong; servers (Redis ``TIME``, Postgres ``now()``) keep their own clocks.
"""

from __future__ import annotations

import runpy
import sys
import time


def main() -> None:
    offset = float(sys.argv[1])
    module = sys.argv[2]
    real = time.time

    def skewed() -> float:
        return real() + offset

    time.time = skewed
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
