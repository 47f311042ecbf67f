import shutil
import tempfile
from pathlib import Path

import pytest


@pytest.fixture()
def short_tmp():
    """A short directory under /tmp for the drivers' TMPDIR: Ray's socket paths must fit 107 bytes."""
    d = Path(tempfile.mkdtemp(prefix="m2f", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture()
def drivers():
    """Drivers a test starts; whatever a failed test left of them is killed at teardown."""
    started = []
    yield started
    for d in started:
        d.cleanup()
