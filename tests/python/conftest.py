"""Every test runs in checked mode (duplicate slots and GPU-skipped slots raise)."""

import pytest

import ropekv


@pytest.fixture(autouse=True)
def checked_mode():
    ropekv.set_checked(True)
    yield
    ropekv.set_checked(True)
