"""torchrun entry of the elastic tests: the real ``galvatron-fx train`` command, with one fault
injected into the first attempt (a restarted attempt runs clean).

Environment:

* ``FAULT``: ``kill`` (SIGKILL) or ``stop`` (SIGSTOP) rank ``FAULT_RANK`` once it has finished step
  ``FAULT_STEP``; ``kill-in-save``: SIGKILL it after it wrote its data files of the checkpoint of
  step ``FAULT_STEP``, before the save completes.
* ``FAULT_DIR``: where the victim writes ``fault_at`` (the time of the fault) first.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def _fault(sig: int) -> None:
    with open(os.path.join(os.environ["FAULT_DIR"], "fault_at"), "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), sig)


def _arm() -> None:
    kind = os.environ.get("FAULT")
    if not kind or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    if int(os.environ["RANK"]) != int(os.environ.get("FAULT_RANK", "1")):
        return
    at = int(os.environ["FAULT_STEP"])
    if kind in ("kill", "stop"):
        from galvatron_fx import watch

        peaks, seen = watch.peaks, [0]

        def counting(device):   # called once per step, after the optimizer step
            out = peaks(device)
            seen[0] += 1
            if seen[0] == at:
                _fault(signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
            return out

        watch.peaks = counting
    elif kind == "kill-in-save":
        import torch.distributed.checkpoint as dcp

        write = dcp.FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            fut = write(self, plan, planner)
            if str(self.path).endswith(f".tmp-{at}"):
                fut.wait()
                _fault(signal.SIGKILL)
            return fut

        dcp.FileSystemWriter.write_data = write_then_die
    else:
        raise SystemExit(f"unknown FAULT={kind!r}")


if __name__ == "__main__":
    _arm()
    from galvatron_fx.cli import main

    sys.exit(main())
