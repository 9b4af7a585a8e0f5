"""Memory budget parsing: bytes, binary and decimal units, clear errors."""

import pytest

from galvatron_fx import ConfigError, format_bytes, parse_bytes


@pytest.mark.parametrize("value,expected", [
    (17179869184, 16 * 2**30), ("16GiB", 16 * 2**30), ("8GB", 8 * 10**9), ("512MiB", 512 * 2**20),
    ("1.5e9", 1_500_000_000), (" 2 G ", 2 * 2**30), ("64k", 64 * 2**10), (1e6, 1_000_000),
])
def test_accepted_forms(value, expected):
    assert parse_bytes(value) == expected


@pytest.mark.parametrize("value,needle", [
    ("0GB", "positive"), (-1, "positive"), ("-4GB", "positive"), ("lots", "cannot parse"),
    ("16 parsecs", "cannot parse"), (True, "size"), (None, "size"), (float("nan"), "positive"),
])
def test_rejected_forms_name_the_problem(value, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_bytes(value, "memory_budget")


def test_format_bytes():
    assert format_bytes(3 * 2**30) == "3.00 GiB" and format_bytes(12) == "12 B"
