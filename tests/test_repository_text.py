"""The repository speaks of the project alone: no path outside the checkout, no ticket number of
this project's tracker, no count of past work periods (in code, docs, tests, benchmarks, configs)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATTERNS = {
    "a path outside the repository": re.compile(r"\.\./(\.\./)*shared\b"),
    "a ticket number": re.compile(r"\b(issue|ticket)s? ?#?\d+\b", re.I),
    "a past work period": re.compile(r"\b(\d+(st|nd|rd|th)|first|second|third|fourth|fifth|previous|last|this) "
                                     r"(session|work period|sprint)\b", re.I),
}
SUFFIXES = {".py", ".md", ".cfg", ".toml", ".txt", ".json", ".yaml", ".yml", ""}


def _files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    names = out.stdout.splitlines() if out.returncode == 0 else [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                                                                  if ".venv" not in p.parts and ".git" not in p.parts]
    return [ROOT / n for n in names if (ROOT / n).is_file() and (ROOT / n).suffix in SUFFIXES]


def test_no_outside_paths_ticket_numbers_or_work_periods():
    hits = []
    for path in _files():
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for what, pattern in PATTERNS.items():
            for m in pattern.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                hits.append(f"{path.relative_to(ROOT)}:{line}: {what}: {m.group(0)!r}")
    assert not hits, "\n".join(hits)
