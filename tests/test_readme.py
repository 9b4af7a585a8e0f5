"""The README's commands are the ones CI runs."""

import re
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
