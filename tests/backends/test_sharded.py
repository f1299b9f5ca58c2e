"""FSDP2 on CPU ranks (gloo), started by torchrun: the sharded backend trains as one process does, and its sharded states
load at any number of ranks (tinkergym.backends.torch.sharded)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import shutil
from pathlib import Path
from typing import Any

import pytest
import testkit

torch = pytest.importorskip("torch")

PROGRAM = Path(__file__).with_name("sharded_program.py")
sys.path.insert(0, str(PROGRAM.parent))
import sharded_program as program  # noqa: E402 - the rank program's batch and settings, one definition

from tinkergym.backends.torch.backend import TorchBackend  # noqa: E402
from tinkergym.backends.torch.sharded import split_rows  # noqa: E402
from tinkergym.backends.torch.sharded_states import trainable_weights  # noqa: E402
from tinkergym.backends.torch.sizing import estimate_training_memory  # noqa: E402
from tinkergym.protocol.types import Datum  # noqa: E402
from tinkergym.scheduler.artifact_paths import check_relpath  # noqa: E402
from tinkergym.scheduler.worker.folders import state_files  # noqa: E402


def torchrun(ranks: int, specs: list[dict[str, Any]], tmp_path: Path) -> list[dict[str, Any]]:
    """Run the program's runs on ``ranks`` processes started once by torchrun; what rank 0 wrote of each run."""
    launch = len(list(tmp_path.iterdir()))
    specs = [{**spec, "out": str(tmp_path / f"out-{ranks}-{launch}-{i}.pt")} for i, spec in enumerate(specs)]
    spec_file = tmp_path / f"spec-{ranks}-{launch}.json"
    spec_file.write_text(json.dumps(specs))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
               "--master-port", str(testkit.free_port()), str(PROGRAM), str(spec_file)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return [torch.load(spec["out"]) for spec in specs]


#: The two kinds of training each sharded test runs: full fine-tuning and LoRA (rank 8), in one launch of the ranks.
LORA_RANKS = {"full": 0, "lora": 8}
each_kind = pytest.mark.parametrize("lora", list(LORA_RANKS.values()), ids=list(LORA_RANKS))


def single(model: str, lora: int, steps: int, load: str | None = None, start: int = 0, export: str | None = None,
           dtype: str = "float32", vlm: bool = False) -> dict[str, Any]:
    """The same calls on one process, without a process group; with ``load``, a sharded state loaded first."""
    spec = {"model": model, "lora": lora, "dtype": dtype, "vlm": vlm}
    backend = TorchBackend(program.config(spec))
    if load:
        backend.load_state(load)  # a plain backend loads a sharded state too
    found: dict[str, Any] = {"steps": [], "first_sample": backend.sample(program.SAMPLES[0]).to_dict()}
    for step in range(steps):
        result = backend.forward_backward(program.batches(spec)(start + step))
        if step == 0:
            found["loss"] = result.metrics["loss"]
            found["grads"] = {n: p.grad.detach().clone() for n, p in backend._trainable}
        metrics = backend.optim_step(program.OPTIM)
        found["steps"].append({"grad_norm": metrics["grad_norm"], "weights": {n: p.detach().clone() for n, p in backend._trainable}})
    found["samples"] = [backend.sample(request).to_dict() for request in program.samples(spec)]
    found["rollout"] = backend.sample(program.ROLLOUT).to_dict()
    found["logprobs"] = backend.logprobs([[5, 6, 7, 8, 9], [1, 2, 3]], 1.0)
    if export:
        backend.export(export)
    return found


def assert_close(a: dict[str, Any], b: dict[str, Any], what: str, atol: float = 1e-5) -> None:
    assert sorted(a) == sorted(b), what
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=atol, msg=lambda m, name=name: f"{what} {name}: {m}")


def tokens_of(response: dict[str, Any]) -> list[list[list[int]]]:
    return [[s["tokens"] for s in row] for row in response["sequences"]]


def assert_same_samples(mine: dict[str, Any], theirs: dict[str, Any]) -> None:
    """The same tokens, and logprobs within float32's noise (a stale copy of the weights would differ by far more)."""
    assert tokens_of(mine) == tokens_of(theirs)
    for row, other in zip(mine["sequences"], theirs["sequences"]):
        for a, b in zip(row, other):
            assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-5)


def assert_split(shares: list[list[int]], request: Any) -> None:
    """Every rank decoded some of the prompts, each prompt on one rank, the copies of a prompt together."""
    assert all(shares) and sorted(i for share in shares for i in share) == list(range(len(request.prompts))), shares
    owner = {i: r for r, share in enumerate(shares) for i in share}
    assert all(owner[i] == owner[j] for i in owner for j in owner if request.prompts[i] == request.prompts[j]), shares


@pytest.fixture(scope="module")
def two_rank_runs(tiny: str, tiny_vlm: str, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], tuple[Path, dict[str, Any]]]:
    """Every run at 2 ranks the tests below read, by (kind, LoRA rank; 0: full), as (folder, what rank 0 wrote): "float32",
    two steps of the tiny model, its state saved after the first (``folder / "state"``) and its model exported at the end
    (``folder / "export"``); "vlm", the same of the tiny Qwen2-VL; "bfloat16", one step of the tiny model in bfloat16.
    torchrun starts once for all of them (the tests run in one test process: ``xdist_group`` "two-ranks"), each rank
    process importing torch and joining the group once, not once per kind."""
    kinds = {"float32": {"model": tiny, "steps": 2}, "vlm": {"model": tiny_vlm, "steps": 2, "vlm": True}}
    folders = {(kind, lora): tmp_path_factory.mktemp(f"{kind}-{lora}") for kind in (*kinds, "bfloat16") for lora in LORA_RANKS.values()}
    specs = [{**kinds[kind], "lora": lora, "export": str(folder / "export"), "save": str(folder / "state")} if kind in kinds
             else {"model": tiny, "lora": lora, "steps": 1, "dtype": "bfloat16"} for (kind, lora), folder in folders.items()]
    runs = torchrun(2, specs, tmp_path_factory.mktemp("two-ranks-launch"))
    return {key: (folder, run) for (key, folder), run in zip(folders.items(), runs)}


@pytest.fixture(scope="module")
def two_ranks(two_rank_runs: dict[tuple[str, int], tuple[Path, dict[str, Any]]]) -> dict[int, tuple[Path, dict[str, Any]]]:
    """For each LoRA rank (0: full): the float32 run of :func:`two_rank_runs`."""
    return {lora: two_rank_runs["float32", lora] for lora in LORA_RANKS.values()}


@pytest.mark.slow
@pytest.mark.xdist_group("two-ranks")
@each_kind
def test_two_ranks_train_as_one_process(two_ranks: dict[int, tuple[Path, dict[str, Any]]], lora: int, tiny: str, tmp_path: Path) -> None:
    """Loss and gradients of one batch split over 2 ranks equal the single process's (float32, 1e-5), and so do the
    weights after two steps (a state saved between them changes nothing)."""
    folder, sharded = two_ranks[lora]
    exported = folder / "export"
    alone = single(tiny, lora, 2, export=str(tmp_path / "alone"))
    assert sharded["loss"] == pytest.approx(alone["loss"], abs=1e-6)
    assert_close(sharded["grads"], alone["grads"], "gradient")
    assert any(g.abs().max() > 1e-6 for g in alone["grads"].values())  # the comparison compares something
    for step in range(2):
        assert sharded["steps"][step]["grad_norm"] == pytest.approx(alone["steps"][step]["grad_norm"], rel=1e-4)
        assert_close(sharded["steps"][step]["weights"], alone["steps"][step]["weights"], f"weights after step {step}")
    # Seeded sampling, before training and after (each rank its share of the prompts on its whole copy of the weights):
    # the single process's tokens and logprobs; in lockstep on the sharded model too. Scoring: the single process's.
    assert_same_samples(sharded["first_sample"], alone["first_sample"])
    assert_same_samples(sharded["samples"][0], alone["samples"][0])  # SAMPLES[1] is unseeded: see the three-rank test
    assert_same_samples(sharded["rollout"], alone["rollout"])
    assert_same_samples(sharded["lockstep_samples"][0], alone["samples"][0])
    assert tokens_of(sharded["samples"][0]) != tokens_of(sharded["first_sample"]), "two steps changed what the seeds draw"
    assert_split(sharded["shares"], program.ROLLOUT)
    assert sharded["failed"] == "sampling failed on rank 1: RuntimeError: decode broke"  # heard on rank 0, no hang
    assert_same_samples(sharded["after_failure"], sharded["rollout"])
    for mine, theirs in zip(sharded["logprobs"], alone["logprobs"]):
        assert mine == pytest.approx(theirs, abs=1e-5)
    # The export is one ordinary folder (peft's adapter, or a transformers model) with the single process's weights.
    weights = "adapter_model.safetensors" if lora else "model.safetensors"
    from safetensors.torch import load_file

    assert_close(load_file(str(exported / weights)), load_file(str(tmp_path / "alone" / weights)), "exported")
    assert (exported / "tokenizer_config.json").is_file() and not list(exported.glob("*distcp*"))


@pytest.fixture(scope="module")
def vlm_two_ranks(two_rank_runs: dict[tuple[str, int], tuple[Path, dict[str, Any]]]) -> dict[int, tuple[Path, dict[str, Any]]]:
    """For each LoRA rank: the VLM's run of :func:`two_rank_runs` (two steps, exported and saved as the float32 run)."""
    return {lora: two_rank_runs["vlm", lora] for lora in LORA_RANKS.values()}


@pytest.mark.slow
@pytest.mark.xdist_group("two-ranks")
@each_kind
def test_a_vlm_on_two_ranks_trains_on_images_as_one_process(vlm_two_ranks: dict[int, tuple[Path, dict[str, Any]]], tiny_vlm: str,
                                                            tmp_path: Path, lora: int) -> None:
    """A Qwen2-VL whose batch puts the image rows on rank 0 and the text rows on rank 1 (only rank 0 runs the vision
    tower): loss, gradients (the vision tower's too, in full fine-tuning) and the weights after two steps equal the single
    process's, and so do sampling with an image, the export and a state saved after the first step, loaded at one rank."""
    folder, sharded = vlm_two_ranks[lora]
    exported, state = folder / "export", folder / "state"
    alone = single(tiny_vlm, lora, 2, export=str(tmp_path / "alone"), vlm=True)
    rows = program.vlm_batch(tiny_vlm, 0).data
    assert [[bool(rows[i].images) for i in part] for part in split_rows(rows, 2)] == [[True] * 3, [False] * 3]  # images on rank 0 only
    assert sharded["loss"] == pytest.approx(alone["loss"], abs=1e-6)
    assert_close(sharded["grads"], alone["grads"], "gradient")
    from transformers import AutoConfig

    estimate = estimate_training_memory(AutoConfig.from_pretrained(tiny_vlm), lora_rank=lora, ranks=2, dtype="float32", micro_batch_size=2, max_seq_len=32)
    assert sharded["held_bytes"] == estimate.weights  # what the memory check counts: the vision side whole, the rest halved
    if not lora:
        assert any(".visual." in n and g.abs().max() > 0 for n, g in alone["grads"].items())  # the vision tower trains
    for step in range(2):
        assert sharded["steps"][step]["grad_norm"] == pytest.approx(alone["steps"][step]["grad_norm"], rel=1e-4)
        assert_close(sharded["steps"][step]["weights"], alone["steps"][step]["weights"], f"weights after step {step}")
    for seeded in (0, 2):  # SAMPLES[0], and the prompt with its image, each rank's share on its whole copy (with the vision tower)
        assert_same_samples(sharded["samples"][seeded], alone["samples"][seeded])
    weights = "adapter_model.safetensors" if lora else "model.safetensors"
    from safetensors.torch import load_file

    assert_close(load_file(str(exported / weights)), load_file(str(tmp_path / "alone" / weights)), "exported")
    resumed = single(tiny_vlm, lora, 1, load=str(state), start=1, vlm=True)  # the vision side whole in the state, with its moments
    assert_close(resumed["steps"][0]["weights"], sharded["steps"][1]["weights"], "the second step after loading the first's state")


@pytest.fixture(scope="module")
def moved_states(two_ranks: dict[int, tuple[Path, dict[str, Any]]], tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Each kind's state saved at 2 ranks, moved as the files a worker uploads (folders.state_files: no hidden names, so
    no DCP .metadata) and the scheduler's store accepts (artifact_paths.check_relpath)."""
    moved = {}
    for lora, (folder, _) in two_ranks.items():
        state, moved[lora] = folder / "state", tmp_path_factory.mktemp(f"moved-{lora}")
        for name in state_files(state):
            check_relpath(name)
            (moved[lora] / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(state / name, moved[lora] / name)
    return moved


@pytest.fixture(scope="module")
def three_ranks(moved_states: dict[int, Path], tiny: str, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """For each kind: one step at 3 ranks from its moved state (the batch of the run's second step); one launch for both."""
    specs = [{"model": tiny, "lora": lora, "steps": 1, "load": str(moved), "start": 1} for lora, moved in moved_states.items()]
    return dict(zip(moved_states, torchrun(3, specs, tmp_path_factory.mktemp("three-ranks"))))


@pytest.mark.slow
@pytest.mark.xdist_group("two-ranks")
@each_kind
def test_a_state_saved_at_two_ranks_loads_at_one_and_at_three(two_ranks: dict[int, tuple[Path, dict[str, Any]]], moved_states: dict[int, Path],
                                                              three_ranks: dict[int, dict[str, Any]], lora: int, tiny: str) -> None:
    """Saved after one step at 2 ranks; loaded at 1 (a plain backend) and at 3 ranks, the next step gives the weights that
    the 2 ranks going on give."""
    folder, on = two_ranks[lora]
    state, moved = folder / "state", moved_states[lora]
    assert (state / "state.json").is_file() and json.loads((state / "state.json").read_text())["ranks"] == 2
    # What serving the checkpoint reads: its trainable weights whole, without a process group.
    assert_close(trainable_weights(str(state)), on["steps"][0]["weights"], "the saved weights read back")
    # A state moves between workers as the files a worker uploads (moved_states): it loads from those alone.
    files = state_files(state)
    assert "dcp/metadata.dcp" in files and not any(name.split("/")[-1].startswith(".") for name in files)
    at_one = single(tiny, lora, 1, load=str(moved), start=1)
    at_three = three_ranks[lora]
    expected = on["steps"][1]["weights"]  # the second step of the run that went on (its batch 1)
    assert_close(at_one["steps"][0]["weights"], expected, "loaded at 1 rank")
    assert_close(at_three["steps"][0]["weights"], expected, "loaded at 3 ranks")
    # The same weights sample the same at 1, 2 and 3 ranks: seeded requests, and the unseeded one too between sharded
    # runs (its seed is rank 0's draw from the run's generator, the same at any number of ranks).
    assert_same_samples(at_three["rollout"], on["rollout"])
    assert_same_samples(at_one["rollout"], on["rollout"])
    assert_same_samples(at_three["samples"][0], at_one["samples"][0])
    assert tokens_of(at_three["samples"][1]) == tokens_of(on["samples"][1])
    assert_split(at_three["shares"], program.ROLLOUT)
    assert at_three["failed"] == "sampling failed on rank 2: RuntimeError: decode broke"
    assert not all(torch.equal(expected[n], on["steps"][0]["weights"][n]) for n in expected)  # the step changed the weights
    # A fresh backend that loads nothing gives other weights: the load carried the adapter and Adam's moments.
    fresh = single(tiny, lora, 1, start=1)
    assert any((fresh["steps"][0]["weights"][n] - expected[n]).abs().max() > 1e-4 for n in expected)


@pytest.fixture(scope="module")
def bfloat16_two_ranks(two_rank_runs: dict[tuple[str, int], tuple[Path, dict[str, Any]]]) -> dict[int, dict[str, Any]]:
    """For each LoRA rank: what rank 0 wrote of the bfloat16 step of :func:`two_rank_runs`."""
    return {lora: two_rank_runs["bfloat16", lora][1] for lora in LORA_RANKS.values()}


@pytest.mark.slow
@pytest.mark.xdist_group("two-ranks")
@each_kind
def test_bfloat16_on_two_ranks_follows_the_single_process(bfloat16_two_ranks: dict[int, dict[str, Any]], tiny: str, lora: int) -> None:
    """The GPU's precision path on CPU ranks: float32 masters gathered in bfloat16 and gradients reduced in float32
    (FSDP2's MixedPrecisionPolicy) for full fine-tuning, a bfloat16 base with a float32 adapter for LoRA. The single
    process computes under autocast instead, so the two agree to bfloat16's precision, not bit for bit."""
    sharded = bfloat16_two_ranks[lora]
    alone = single(tiny, lora, 1, dtype="bfloat16")
    assert sharded["loss"] == pytest.approx(alone["loss"], rel=5e-2, abs=1e-3)
    mine = torch.cat([g.float().flatten() for _, g in sorted(sharded["grads"].items())])
    theirs = torch.cat([g.float().flatten() for _, g in sorted(alone["grads"].items())])
    assert float(torch.nn.functional.cosine_similarity(mine, theirs, dim=0)) > 0.99
    assert float(mine.norm()) == pytest.approx(float(theirs.norm()), rel=5e-2)


def test_rows_are_split_by_tokens_and_groups_stay_on_one_rank() -> None:
    def rows(prompt: list[int], n: int, length: int) -> list[Datum]:
        return [Datum(tokens=prompt + [9] * length, loss_mask=[0.0] * len(prompt) + [1.0] * length) for _ in range(n)]

    data = rows([1, 2], 3, 4) + rows([3, 4], 3, 4) + rows([5], 2, 10)
    parts = split_rows(data, 2)
    assert [list(p) for p in parts] == [[0, 1, 2, 3, 4, 5], [6, 7]]
    assert [list(p) for p in split_rows(data, 3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [list(p) for p in split_rows(data[:3], 2)] == [[0, 1, 2], []]  # one group: one rank; the other runs empty passes
    assert sum(len(p) for p in split_rows(data, 5)) == len(data)


def test_rollouts_are_refused_for_a_server_of_one_process(tiny: str, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t" * 43)
    token.chmod(0o600)
    done = subprocess.run([sys.executable, "-m", "tinkergym", "serve", "backend", "--model", tiny, "--token-file", str(token), "--run-dir",
                           str(tmp_path / "server"), "--rollouts", "split"], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")})
    assert done.returncode == 2 and "--rollouts split is for a server sharded over several ranks" in done.stderr


def test_sample_prompts_are_split_by_groups_costliest_first() -> None:
    from tinkergym.backends.torch.sharded_rollouts import split_prompts

    prompts = [[1, 2], [3], [1, 2], [4, 5, 6], [3], [1, 2]]  # groups: 0,2,5 (3 copies), 1,4 (2 copies), 3 (1 copy)
    assert split_prompts(prompts, [], 1, 4, 2) == [[0, 2, 5], [1, 3, 4]]  # 3 copies to rank 0, then the two others to rank 1
    assert split_prompts(prompts, [], 1, 4, 3) == [[0, 2, 5], [1, 4], [3]]
    assert split_prompts(prompts, [], 1, 4, 5)[3:] == [[], []]  # more ranks than groups: some decode nothing
    assert split_prompts(prompts, [], 1, 4, 1) == [list(range(6))]
    # a prompt with images is a group of its own, even when its tokens repeat another's
    assert split_prompts([[1], [1]], [["image"], []], 1, 4, 2) == [[0], [1]]


def test_a_replica_that_cannot_fit_is_not_built() -> None:
    from tinkergym.backends.torch.sharded_rollouts import replica_bytes, replica_fits

    small, huge = torch.nn.Linear(4, 4), torch.nn.Linear(2**20, 2**20, bias=False, device="meta")  # 4 TiB in float32
    assert replica_bytes(huge, torch.bfloat16) == 2 * 2**40
    assert replica_fits(small, torch.float32, torch.device("cpu"))
    assert not replica_fits(huge, torch.bfloat16, torch.device("cpu"))


def serve_sharded(tiny: str, tmp_path: Path, ranks: int = 2, rollouts: str = "auto") -> tuple[subprocess.Popen, str, str]:
    """``tinkergym serve backend`` started by torchrun on ``ranks`` gloo ranks; (process, url, token)."""
    import secrets

    token = tmp_path / "token"
    token.write_text(secrets.token_urlsafe(32))
    token.chmod(0o600)
    port = testkit.free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
               "--master-port", str(testkit.free_port()), "-m", "tinkergym", "serve", "backend", "--model", tiny, "--dtype", "float32",
               "--device", "cpu", "--seed", "3", "--micro-batch-size", "2", "--lora-rank", "8", "--token-file", str(token),
               "--run-dir", str(tmp_path / "server"), "--port", str(port), "--rollouts", rollouts]
    process = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                               stderr=open(tmp_path / "server.err", "w"), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    testkit.wait_until_answers(url + "/health", timeout=120, process=process)
    return process, url, token.read_text().strip()


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc: no procps needed)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return sorted(found)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        return "(zombie)" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.mark.slow
def test_serve_backend_sharded_over_two_ranks_by_torchrun(tiny: str, tmp_path: Path) -> None:
    """Rank 0 serves and sends each call to rank 1: a remote run equals a local one, its state is sharded; a killed rank
    brings the whole server down (torchrun ends the others), no rank left waiting in a collective."""
    from tinkergym.backends.remote import RemoteBackend

    process, url, token = serve_sharded(tiny, tmp_path, rollouts="lockstep")
    try:
        remote = RemoteBackend(url, token)
        local = TorchBackend(program.config({"model": tiny, "lora": 8}))
        assert remote.info()["ranks"] == 2 and remote.info()["rollouts"] == "lockstep"  # every rank decodes the whole request
        for step in range(2):
            served, alone = remote.forward_backward(program.batch(step)), local.forward_backward(program.batch(step))
            assert served.metrics["loss"] == pytest.approx(alone.metrics["loss"], abs=1e-6)
            assert remote.optim_step(program.OPTIM)["grad_norm"] == pytest.approx(local.optim_step(program.OPTIM)["grad_norm"], rel=1e-4)
        tokens = [[[s["tokens"] for s in row] for row in b.sample(program.SAMPLES[0]).to_dict()["sequences"]] for b in (remote, local)]
        assert tokens[0] == tokens[1]
        remote.save_state(str(tmp_path / "client" / "step_000002"))  # the server keeps it as states/step_000002
        assert sorted(p.name for p in (tmp_path / "server" / "states" / "step_000002").iterdir()) == ["dcp", "state.json"]

        ranks = children(process.pid)
        assert len(ranks) == 2, ranks
        os.kill(ranks[-1], signal.SIGKILL)
        process.wait(timeout=90)  # torchrun sees a rank die and ends the other: the server is down, nothing hangs
        assert process.returncode != 0
        assert not any(alive(pid) for pid in ranks)
    finally:
        stop(process)
