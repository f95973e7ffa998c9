"""schemas/names.py: the one way a user-given name becomes a folder name (issue 48)."""

from __future__ import annotations

import pytest

from schemas.config import load_config_data, validate_config
from schemas.errors import ConfigError
from schemas.names import folder_name, name_max, name_problem
from schemas.rlvr_train_config import RLVRTrainConfig
from schemas.train_flow_config import TrainFlowConfig
from tests.spine.helpers import REPO


@pytest.mark.parametrize("name, problem", [
    ("", "it is empty"), (".", "names the folder itself"), ("..", "names the parent folder"),
    ("a/b", "the path separator '/'"), ("..\\up", "the path separator '\\'"), ("run\n1", "control character '\\n'"),
    ("x" * 256, "256 bytes long and the filesystem allows names of at most 255 bytes"),
    ("é" * 128, "256 bytes long"),  # bytes, not characters
])
def test_names_that_cannot_be_one_folder(name, problem):
    assert problem in name_problem(name)
    with pytest.raises(ValueError, match="becomes a folder name, but .*; use a short name of letters"):
        folder_name(name, "run_name")


def test_names_that_can():
    for name in ("quickstart", "run.2", "..a", "x" * 255, "a" * 20):
        assert folder_name(name, "run_name") == name
    assert name_problem("x" * 20, limit=10) is not None
    assert name_max("s3://bucket/runs") == 255


def test_name_max_reads_the_filesystem(tmp_path):
    assert name_max(str(tmp_path / "not" / "yet")) == name_max(str(tmp_path)) > 0


@pytest.mark.parametrize("model, path", [(TrainFlowConfig, "configs/train_frozenlake_quickstart.yaml"),
                                         (RLVRTrainConfig, "configs/rlvr_train_math.yaml")])
@pytest.mark.parametrize("name, phrase", [("..", "'..' names the parent folder"), (".", "names the folder itself"),
                                          ("x" * 300, "300 bytes long"), ("a b", "may hold only letters")])
def test_run_name_is_refused_at_load_time(model, path, name, phrase):
    data = load_config_data(str(REPO / path), {"run_name": name})
    with pytest.raises(ConfigError, match="field 'run_name'") as err:
        validate_config(model, data, path)
    assert phrase in str(err.value)
