"""``.pack()`` states saved before pack buffers were saved as positions still load and resume exactly.

The states under ``tests/fixtures/pack_states/states/`` were saved once by
``tests/fixtures/make_pack_states.py`` on the commit each names under
``saved_by``: version 2 states whose pack nodes hold their unpacked tokens as
data (``pieces``). Each test rebuilds the recipe's loader with today's code
over a copy of the committed token files and checks the rest of the epoch,
block for block, against what the uninterrupted run yielded. Fix the code,
never the fixtures.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.fixtures.make_pack_states import FIXTURES, blocks, documents, loader

pytestmark = pytest.mark.filterwarnings(
    "ignore:This DataLoader will create:UserWarning", "ignore:'set_vital' is deprecated:UserWarning"
)

FOLDER = Path(__file__).resolve().parents[1] / "fixtures" / "pack_states"


def saved(name: str) -> dict[str, Any]:
    return json.loads((FOLDER / "states" / f"{name}.json").read_text())


@pytest.fixture
def in_data_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    for folder in ("tokens", "text"):
        shutil.copytree(FOLDER / folder, tmp_path / folder)
    monkeypatch.chdir(tmp_path)
    yield tmp_path


def _marked(name: str) -> Any:
    """DataLoader workers are processes: such fixtures run with the slow tests."""
    return pytest.param(name, marks=pytest.mark.slow) if FIXTURES[name]["workers"] else name


@pytest.mark.parametrize("name", [_marked(name) for name in sorted(FIXTURES)])
def test_a_pack_state_saved_with_its_tokens_as_data_resumes_block_for_block(name: str, in_data_copy: Path) -> None:
    record = saved(name)
    assert record["recipe"] == FIXTURES[name]
    assert '"pieces": [[' in json.dumps(record["state"]), "the fixture holds tokens as data"
    resumed = loader(record["recipe"])
    resumed.load_state_dict(record["state"])
    got = [block for batch in resumed for block in blocks(batch)]
    assert got == record["expected"]


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_every_pack_fixture_is_a_whole_epoch_of_every_token_once(name: str) -> None:
    record = saved(name)
    tokens = np.array([t for block in record["delivered"] + record["expected"] for t in block])
    assert np.array_equal(np.sort(tokens[tokens >= 0]), np.concatenate(documents()))
