"""Every file the project reads back goes through a loader that runs no pickled code: a pickle planted where a
controller, a compressibility checkpoint or target-output file, a LoRA adapter or a replay table is read is refused in
one line naming the file, and the code in it does not run.

The planted object's unpickling would create a marker file (a harmless stand-in for what a planted file could do);
each test checks that the marker is absent after the refusal. The first test shows that the plant is live: an unsafe
load of the same file does create the marker.
"""

import json
import pickle
from pathlib import Path

import pytest
import torch

from rift_ada import lora
from rift_ada.refresh import load_controller
from rift_ada.replay import ReplayTable
from rift_ada.trainers import compressibility as C
from tests.conftest import random_model


class Planted:
    """Unpickling this calls ``open(marker, "w")``: it creates the marker file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def plant(path: Path, payload, writer: str = "torch") -> Path:
    """``payload`` (holding a Planted) written to ``path`` as torch.save writes it, or as a bare pickle."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if writer == "torch":
        torch.save(payload, path)
    else:
        path.write_bytes(pickle.dumps(payload))
    return path


def refused(load, path: Path, marker: Path, *phrases) -> str:
    """``load()`` raises ValueError in one line that names ``path``, and the planted code did not run."""
    with pytest.raises(ValueError) as e:
        load()
    msg = str(e.value)
    assert "\n" not in msg and "weights_only=False" not in msg, msg
    assert str(path) in msg, msg
    for p in phrases:
        assert p in msg, (p, msg)
    assert not marker.exists(), "the planted code ran"
    return msg


WRITERS = ["torch", "pickle"]


def test_the_planted_pickle_runs_code_when_unpickled(tmp_path):
    marker = tmp_path / "ran"
    path = plant(tmp_path / "x.pt", {"state": Planted(marker)})
    torch.load(path, weights_only=False)  # what a loader must never do
    assert marker.exists()
    marker.unlink()
    pickle.loads(pickle.dumps(Planted(marker)))
    assert marker.exists()


@pytest.mark.parametrize("writer", WRITERS)
def test_controller_file(tmp_path, writer):
    marker = tmp_path / "ran"
    path = plant(tmp_path / "controller.pt", {"kind": "ppo", "state_dict": Planted(marker)}, writer)
    refused(lambda: load_controller(path), path, marker)


@pytest.mark.parametrize("writer", WRITERS)
def test_compressibility_checkpoint(tmp_path, writer):
    marker = tmp_path / "ran"
    out = tmp_path / "run"
    path = plant(out / "checkpoints" / "step-1" / "state.pt",
                 {"adapter": Planted(marker), "optimizer": {}, "step": 1, "history": []}, writer)
    model = lora.attach(random_model("llama", seed=0), rank=2)
    # Resuming reads the latest checkpoint before any training step.
    msg = refused(lambda: C.train(model, [], C.TrainConfig(steps=2), out, progress=False), path, marker, "refused")
    assert "compressibility training checkpoint" in msg


def test_target_output_files(tmp_path):
    marker = tmp_path / "ran"
    folder = tmp_path / "targets"
    meta = {"format": C.FORMAT, "target": "", "top_k": 8, "temperature": 0.0, "samples": 1, "vocab_size": 128,
            "continuation_tokens": 4}
    path = plant(folder / "samples.pt", [{"prompt_ids": Planted(marker)}])
    (folder / "meta.json").write_text(json.dumps(meta))
    refused(lambda: C.load_target_outputs(folder), path, marker, "refused")
    # An interrupted build's partial file, read when the build resumes.
    partial = plant(tmp_path / "building" / "samples.partial.pt", {"settings": Planted(marker), "samples": []})
    refused(lambda: C.build_target_outputs(random_model("llama", seed=0), [[1, 2, 3]], 4, partial.parent,
                                           progress=False), partial, marker, "refused")


@pytest.fixture
def adapter(tmp_path):
    """A real adapter folder of a small random model, and that model."""
    base = random_model("llama", seed=0)
    lora.save(lora.attach(random_model("llama", seed=0), rank=2), lora.fingerprint(base), tmp_path / "adapter")
    return base, tmp_path / "adapter"


def test_lora_adapter_as_a_pickle_is_refused(tmp_path, adapter):
    base, folder = adapter
    marker = tmp_path / "ran"
    (folder / "adapter_model.safetensors").unlink()
    path = plant(folder / "adapter_model.bin", {"base_model.model.lm_head.lora_A.weight": Planted(marker)})
    refused(lambda: lora.load_drafter(base, folder), path, marker, "safetensors")
    refused(lambda: lora.check_adapter(folder), path, marker)


def test_lora_adapter_loads_its_safetensors_and_not_a_pickle_beside_them(tmp_path, adapter):
    base, folder = adapter
    marker = tmp_path / "ran"
    plant(folder / "adapter_model.bin", {"base_model.model.lm_head.lora_A.weight": Planted(marker)})
    lora.load_drafter(base, folder)
    assert not marker.exists(), "the planted code ran"


@pytest.mark.parametrize("writer", WRITERS)
def test_replay_table(tmp_path, writer):
    marker = tmp_path / "ran"
    path = plant(tmp_path / "table-000-s0.safetensors", {"header": Planted(marker)}, writer)
    refused(lambda: ReplayTable.load(path), path, marker, "not a replay table")
