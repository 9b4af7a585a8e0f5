"""The README's main job (scripts/main_job.py) runs end to end: profile the 2-rank CPU cluster, plan
gpt-tiny under a budget pure DP does not fit, train under torchrun, compare with one device."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _failure(stderr: str) -> str:
    """The ranks' own error lines (fault handler stacks, exceptions) and the tail of ``stderr``."""
    keys = ("[rank", "Fatal Python error", "File \"", "Error", "terminate", "what()", "Thread 0x", "Current thread")
    own = [line for line in stderr.splitlines() if any(k in line for k in keys) and "elastic" not in line]
    return "\n".join(own[-80:]) + "\n--- tail ---\n" + stderr[-2000:]


@pytest.mark.dist
@pytest.mark.slow
def test_main_job_trains_the_searched_plan_like_one_device(tmp_path):
    # NOTE: PYTHONFAULTHANDLER: a rank that dies of a signal (a rare SIGABRT under CI load) prints
    # every thread's Python stack; the failure message keeps those lines, not only torchrun's summary
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "main_job.py"), str(tmp_path), "--once"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"})
    assert out.returncode == 0, _failure(out.stderr)
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.e+-]+)$", out.stdout, flags=re.M)
    assert len(rows) == 20, out.stdout[-3000:]
    assert all(float(rel) <= 1e-5 for *_, rel in rows)
    first, last = float(rows[0][2]), float(rows[-1][2])
    assert last <= 0.8 * first, (first, last)     # a learnable task: the loss falls by >= 20 %
    assert "estimated" in out.stdout
    assert "baseline" in out.stdout and "searched" in out.stdout
    assert (tmp_path / "plan.json").exists() and (tmp_path / "cluster.json").exists()
