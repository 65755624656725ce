"""A helper shared by tests: the size of a soak, fuzz or property run, short in ``make test`` and
long in ``make test-long`` (``CONVEYOR_TEST_LONG=1``)."""

from __future__ import annotations

import os

LONG = os.environ.get("CONVEYOR_TEST_LONG", "").lower() in ("1", "true", "yes")


def sized(short: int, long: int) -> int:
    return long if LONG else short
