"""The tagging model of ``parent_tagger``, trained once for the checks of this folder."""

import pytest
from parent_tagger import Trained, train_lisa_tagger


@pytest.fixture(scope="session")
def lisa_tagger() -> Trained:
    return train_lisa_tagger()
