"""The README's commands are the ones CI runs."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_ci_runs_the_readme_test_command():
    main_cmd, test_cmd = _readme_commands()[:2]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmd in ci, "the last command of .ci/run must equal the README's test command"
    assert "pytest" in test_cmd and "pytest" not in main_cmd


def test_install_pins_the_cpu_torch_build():
    for cmd in _readme_commands()[:2]:
        assert "torch==2.13.0" in cmd.split("&&")[1]


def test_the_python_quick_start_runs_as_written(tmp_path, monkeypatch):
    """The README's Python block up to its torchrun part (which needs a distributed world: the
    transform tests run it) runs as written on this machine."""
    text = (ROOT / "README.md").read_text()
    block = re.findall(r"```python\n(.*?)```", text, flags=re.S)[0]
    local = block.split("# under torchrun")[0]
    monkeypatch.chdir(tmp_path)   # it saves plan.json
    scope: dict = {}
    exec(compile(local, "README.md", "exec"), scope)
    plan, gm, cluster = scope["plan"], scope["gm"], scope["cluster"]
    assert plan.estimate["throughput_samples_s"] > 0 and len(plan.layers) == len(scope["gfx"].layers(gm))
    assert scope["gfx"].estimate(gm, plan, cluster)["step_time_s"] == plan.estimate["step_time_s"]


def _quick_start() -> str:
    text = (ROOT / "README.md").read_text()
    return text.split("## Quick start", 1)[1].split("\n## ", 1)[0]


def test_the_quick_start_cli_blocks_run_as_written_and_print_what_the_readme_shows(tmp_path):
    """Every bash block of the quick start that needs no torchrun runs as written (``.venv/bin/``
    is this interpreter's directory), and each line of the printed plan the README shows (rows cut
    where it says ``...``) is a line of the real output."""
    section = _quick_start()
    fences = re.findall(r"^```(\w*)\n(.*?)^```", section, flags=re.S | re.M)
    runnable = [b for lang, b in fences if lang == "bash" and "torchrun" not in b]
    assert runnable, "the quick start has a CLI block to run"
    bindir = os.path.dirname(sys.executable)
    out = ""
    for block in runnable:
        for cmd in block.replace("\\\n", " ").strip().splitlines():
            cmd = cmd.replace(".venv/bin/", bindir + "/")
            res = subprocess.run(cmd, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=600)
            assert res.returncode == 0, (cmd, res.stderr[-2000:])
            out += res.stdout
    shown = next(b for lang, b in fences if lang == "")
    got = {line.rstrip() for line in out.splitlines()}
    for line in shown.splitlines():
        if line.strip() and line.strip() != "...":
            assert line.rstrip() in got, f"the README shows a line the command does not print:\n{line}"
