"""Backend state folders hold safetensors and JSON only: optimizer and RNG round trips, old pickled folders refused."""

from __future__ import annotations

import json
import pickle
import random
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("safetensors")

from tinkergym.backends.torch import state_files
from tinkergym.backends.torch.state_files import (
    optimizer_state_from_files,
    optimizer_state_to_files,
    read_optimizer_state,
    read_rng_state,
    restore_rng_state,
    rng_state_to_files,
    write_optimizer_state,
    write_rng_state,
)
from tinkergym.errors import ConfigError

CPU = torch.device("cpu")


def trained_adamw(**options) -> torch.optim.AdamW:
    """AdamW after two real steps on a float32 nn.Linear and a bfloat16 parameter."""
    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(4, 3)
    half = torch.nn.Parameter(torch.randn(5, generator=generator).to(torch.bfloat16))
    optimizer = torch.optim.AdamW([{"params": linear.parameters()}, {"params": [half], "lr": 0.5}], lr=1e-2, betas=(0.8, 0.95), **options)
    for _ in range(2):
        loss = linear(torch.randn(2, 4, generator=generator)).square().sum() + half.float().square().sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


def assert_same_state_dict(a: dict, b: dict) -> None:
    """Equal tensors bit for bit with equal dtypes, and identical non-tensor entries (tuples stay tuples)."""
    assert a.keys() == b.keys()
    assert a["param_groups"] == b["param_groups"]
    assert [type(g["betas"]) for g in b["param_groups"]] == [tuple] * len(a["param_groups"])
    assert a["state"].keys() == b["state"].keys() and all(isinstance(k, int) for k in b["state"])
    for index, entries in a["state"].items():
        assert entries.keys() == b["state"][index].keys()
        for key, value in entries.items():
            other = b["state"][index][key]
            if isinstance(value, torch.Tensor):
                assert isinstance(other, torch.Tensor) and other.dtype == value.dtype and other.shape == value.shape, (index, key)
                assert torch.equal(other.reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), (index, key)
            else:
                assert type(other) is type(value) and other == value, (index, key)


@pytest.mark.parametrize("options", [{}, {"fused": True}, {"foreach": False}])
def test_adamw_state_round_trips_exactly(tmp_path: Path, options: dict) -> None:
    optimizer = trained_adamw(**options)
    original = optimizer.state_dict()
    assert {v.dtype for s in original["state"].values() for k, v in s.items() if k != "step"} == {torch.float32, torch.bfloat16}
    tensors, document = optimizer_state_to_files(original)
    assert set(tensors) == {f"state.{i}.{k}" for i, s in original["state"].items() for k in s}
    assert json.loads(json.dumps(document)) == document  # plain JSON
    assert_same_state_dict(original, optimizer_state_from_files(tensors, document))

    write_optimizer_state(tmp_path, original)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["optimizer.json", "optimizer.safetensors"]
    rebuilt = read_optimizer_state(tmp_path)
    assert_same_state_dict(original, rebuilt)
    fresh = trained_adamw(**options)
    fresh.load_state_dict(rebuilt)
    assert_same_state_dict(original, fresh.state_dict())


def test_non_tensor_entries_and_tuples_survive() -> None:
    state = {
        "state": {0: {"step": 3, "flag": True, "scale": 0.1, "pair": (1, (2.5, None)), "buf": torch.arange(3)}},
        "param_groups": [{"params": [0], "lr": torch.tensor(0.01), "betas": (0.9, 0.999), "eps": 1e-8, "foreach": None}],
    }
    tensors, document = optimizer_state_to_files(state)
    assert set(tensors) == {"state.0.buf", "param_groups.0.lr"}
    rebuilt = optimizer_state_from_files(tensors, json.loads(json.dumps(document)))
    assert rebuilt["state"][0]["pair"] == (1, (2.5, None)) and type(rebuilt["state"][0]["step"]) is int
    assert rebuilt["state"][0]["flag"] is True and rebuilt["param_groups"][0]["betas"] == (0.9, 0.999)
    assert torch.equal(rebuilt["state"][0]["buf"], torch.arange(3)) and torch.equal(rebuilt["param_groups"][0]["lr"], torch.tensor(0.01))
    with pytest.raises(TypeError, match="object"):
        optimizer_state_to_files({"state": {0: {"odd": object()}}, "param_groups": []})


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def draws() -> tuple[list[float], float, list[float], float]:
    return torch.rand(4).tolist(), random.random(), np.random.rand(3).tolist(), float(np.random.randn())


def test_rng_round_trip_continues_identically(tmp_path: Path) -> None:
    seed_everything(7)
    np.random.randn()  # leave cached gaussians behind, which the state must carry
    random.gauss(0, 1)
    write_rng_state(tmp_path, CPU)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rng.json", "rng.safetensors"]
    expected = draws()
    seed_everything(1)  # move every generator elsewhere
    restore_rng_state(*read_rng_state(tmp_path), CPU)
    assert draws() == expected
    _, document = read_rng_state(tmp_path)
    assert len(document["python"]["internal"]) == 625 and "cuda" not in read_rng_state(tmp_path)[0]


def test_rng_state_keeps_only_the_backend_devices_cuda_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    """A state saved with 8 GPUs visible restores with 1: only the backend's own device is saved and set."""
    generators = {i: torch.full((16,), i, dtype=torch.uint8) for i in range(8)}
    calls = []

    def get_state(device):
        calls.append(("get", device))
        return generators[device.index].clone()

    def set_state(state, device):
        calls.append(("set", device))
        generators[device.index] = state.clone()

    monkeypatch.setattr(torch.cuda, "get_rng_state", get_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_state)
    for name in ("get_rng_state_all", "set_rng_state_all"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, name=name: pytest.fail(f"{name} reads or sets every visible GPU"))
    tensors, document = rng_state_to_files(torch.device("cuda", 3))
    assert torch.equal(tensors["cuda"], generators[3]) and document["device"] == "cuda:3"
    generators[0] = torch.zeros(16, dtype=torch.uint8)
    restore_rng_state(tensors, document, torch.device("cuda", 0))  # the one GPU of a smaller machine
    assert torch.equal(generators[0], generators[3])
    restore_rng_state(tensors, document, CPU)  # a CPU backend leaves CUDA alone
    assert calls == [("get", torch.device("cuda", 3)), ("set", torch.device("cuda", 0))]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_rng_round_trip_on_the_current_device() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    tensors, document = rng_state_to_files(device)
    expected = torch.rand(4, device=device)
    restore_rng_state(tensors, document, device)
    assert torch.equal(torch.rand(4, device=device), expected)


# ----- a real TorchBackend's state folder ----------------------------------------------------------------
@pytest.fixture(scope="module")
def backend(tiny: str):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
    from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec, OptimParams

    backend = TorchBackend(TorchBackendConfig(model=tiny, lora_rank=4, dtype="float32", device="cpu"))
    datum = Datum(tokens=[5, 6, 7, 8, 9], loss_mask=[0, 0, 1, 1, 1])
    backend.forward_backward(ForwardBackwardRequest(data=[datum], loss=LossSpec(name="cross_entropy")))
    backend.optim_step(OptimParams(learning_rate=1e-2))
    return backend


def safetensors_header(path: Path) -> dict:
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + size])


def test_saved_folder_holds_only_safetensors_and_json(backend, tmp_path: Path) -> None:
    from tinkergym.backends.torch.backend import STATE_FORMAT

    backend.save_state(str(tmp_path / "state"))
    files = sorted(p.name for p in (tmp_path / "state").iterdir())
    assert files == ["optimizer.json", "optimizer.safetensors", "rng.json", "rng.safetensors", "state.json", "trainable.safetensors"]
    for name in files:
        path = tmp_path / "state" / name
        if name.endswith(".json"):
            json.loads(path.read_text())
        else:
            assert name.endswith(".safetensors") and safetensors_header(path)
    assert json.loads((tmp_path / "state" / "state.json").read_text())["format"] == STATE_FORMAT >= 2
    header = safetensors_header(tmp_path / "state" / "optimizer.safetensors")
    assert {"state.0.exp_avg", "state.0.exp_avg_sq", "state.0.step"} <= set(header)


class _Planted:
    """Writes a marker file when unpickled: proof that loading a state folder ran pickle."""

    marker = ""

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "unpickled"))


def test_old_pickled_layout_is_refused_without_unpickling(backend, tmp_path: Path) -> None:
    folder, marker = tmp_path / "old", tmp_path / "unpickled.marker"
    backend.save_state(str(folder))
    meta = json.loads((folder / "state.json").read_text())
    (folder / "state.json").write_text(json.dumps({**meta, "format": 1}))
    for name in ("optimizer.safetensors", "optimizer.json", "rng.safetensors", "rng.json"):
        (folder / name).unlink()
    _Planted.marker = str(marker)
    payload = pickle.dumps(_Planted())
    (folder / "optimizer.pt").write_bytes(payload)
    (folder / "rng.pt").write_bytes(payload)
    step = backend.step
    with pytest.raises(ConfigError, match="older tinkergym state format .*optimizer.pt.*export.*retrain"):
        backend.load_state(str(folder))
    assert not marker.exists() and backend.step == step
    pickle.loads(payload)  # the plant is live: unpickling it would have left the marker
    assert marker.exists()


def test_planted_pickle_beside_a_new_layout_is_refused_too(backend, tmp_path: Path) -> None:
    folder = tmp_path / "state"
    backend.save_state(str(folder))
    (folder / "rng.pt").write_bytes(b"\x80\x04N.")
    with pytest.raises(ConfigError, match="rng.pt"):
        backend.load_state(str(folder))


def test_newer_format_and_missing_files_are_refused(backend, tmp_path: Path) -> None:
    folder = tmp_path / "state"
    backend.save_state(str(folder))
    meta = json.loads((folder / "state.json").read_text())
    (folder / "state.json").write_text(json.dumps({**meta, "format": meta["format"] + 1}))
    with pytest.raises(ConfigError, match="upgrade tinkergym"):
        backend.load_state(str(folder))
    (folder / "state.json").write_text(json.dumps(meta))
    (folder / "rng.json").unlink()
    with pytest.raises(ConfigError, match="lacks rng.json"):
        backend.load_state(str(folder))
    assert state_files.RNG_FILES == ("rng.safetensors", "rng.json")
