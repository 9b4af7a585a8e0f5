"""Test options: ``--run-matrix`` runs the long tests marked ``matrix`` (skipped by default).

The layer-profile cache (``$GALVATRON_CACHE``) points at a folder of this pytest run's, so the suite
neither writes into the user's ``~/.cache/galvatron_fx`` nor reads a warm cache an earlier run left
(spawned ranks inherit the variable)."""

import os

import pytest


def pytest_addoption(parser):
    parser.addoption("--run-matrix", action="store_true", default=False,
                     help="run the long front-end x plan matrix (tests marked 'matrix')")


def pytest_configure(config):
    import tempfile

    from galvatron_fx.cost.profile import CACHE_ENV

    if CACHE_ENV not in os.environ:
        config._gfx_cache = tempfile.TemporaryDirectory(prefix="galvatron-test-cache-")
        os.environ[CACHE_ENV] = config._gfx_cache.name


def pytest_unconfigure(config):
    cache = getattr(config, "_gfx_cache", None)
    if cache is not None:
        from galvatron_fx.cost.profile import CACHE_ENV

        os.environ.pop(CACHE_ENV, None)
        cache.cleanup()


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-matrix"):
        return
    skip = pytest.mark.skip(reason="long matrix: run with --run-matrix")
    for item in items:
        if "matrix" in item.keywords:
            item.add_marker(skip)
