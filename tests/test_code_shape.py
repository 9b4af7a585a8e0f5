"""Files a newcomer can hold in their head: no source file over 500 lines unless its docstring says
why (a ``Size:`` paragraph), and no function over 80 lines without a ``NOTE: one function`` line
saying why it stays one."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted([*ROOT.joinpath("galvatron_fx").rglob("*.py"), *ROOT.joinpath("passes").glob("*.py")])


def test_no_source_file_over_500_lines_without_a_reason():
    long = []
    for path in SOURCES:
        text = path.read_text()
        doc = "\n" + (ast.get_docstring(ast.parse(text)) or "")
        if text.count("\n") > 500 and "\nSize: " not in doc:
            long.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
    assert not long, "\n".join(long)


def test_no_function_over_80_lines_without_a_reason():
    long = []
    for path in SOURCES:
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80:
                body = "\n".join(lines[node.lineno - 1:node.end_lineno])
                if "NOTE: one function" not in body and "One function because" not in (ast.get_docstring(node) or ""):
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not long, "\n".join(long)
