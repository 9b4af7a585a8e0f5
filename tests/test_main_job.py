"""The README's main job (scripts/main_job.py) runs end to end: profile the 2-rank CPU cluster, plan
gpt-tiny under a budget pure DP does not fit, train under torchrun, compare with one device."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.dist
@pytest.mark.slow
def test_main_job_trains_the_searched_plan_like_one_device(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "main_job.py"), str(tmp_path), "--once"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.e+-]+)$", out.stdout, flags=re.M)
    assert len(rows) == 20, out.stdout[-3000:]
    assert all(float(rel) <= 1e-5 for *_, rel in rows)
    first, last = float(rows[0][2]), float(rows[-1][2])
    assert last <= 0.8 * first, (first, last)     # a learnable task: the loss falls by >= 20 %
    assert "estimated" in out.stdout
    assert "baseline" in out.stdout and "searched" in out.stdout
    assert (tmp_path / "plan.json").exists() and (tmp_path / "cluster.json").exists()
