import pathlib
import sys
import uuid

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))


@pytest.fixture
def cluster_key() -> uuid.UUID:
    return uuid.uuid4()


@pytest.fixture
def data_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """A directory on the real disk: fsync has to mean something in these tests."""
    d = tmp_path / "storage"
    return d
