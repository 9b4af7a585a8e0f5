"""Test options: ``--run-matrix`` runs the long tests marked ``matrix`` (skipped by default)."""

import pytest


def pytest_addoption(parser):
    parser.addoption("--run-matrix", action="store_true", default=False,
                     help="run the long front-end x plan matrix (tests marked 'matrix')")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-matrix"):
        return
    skip = pytest.mark.skip(reason="long matrix: run with --run-matrix")
    for item in items:
        if "matrix" in item.keywords:
            item.add_marker(skip)
