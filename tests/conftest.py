import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tokenizer():
    from rift_ada.models import load_tokenizer

    return load_tokenizer("testbed")


@pytest.fixture(scope="session")
def testbed_target():
    from rift_ada.models import load_model

    return load_model("testbed")


@pytest.fixture(scope="session")
def testbed_draft():
    from rift_ada.models import load_model

    return load_model("testbed-draft")
