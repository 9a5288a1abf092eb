import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `training` is a top-level folder of the repository, not part of the package
    sys.path.insert(0, str(ROOT))

ASSETS = ROOT / "lingls" / "assets" / "ling-nano"


@pytest.fixture(scope="session")
def assets() -> Path:
    return ASSETS


@pytest.fixture(scope="session")
def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(ASSETS / "tokenizer.json"))
