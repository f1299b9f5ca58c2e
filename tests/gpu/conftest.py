"""The GPU lane (``make test-gpu``; ``tests/gpu/test_gpu_memory.py`` also runs in ``make test-vllm``): every test
here is marked ``gpu`` (``-m "not gpu"`` leaves them out). Each module needs the ``train`` extra (torch,
transformers, peft); without it each is reported skipped, with the reason, and none is imported. Each module skips
its tests itself where torch sees no CUDA device."""

from __future__ import annotations

from pathlib import Path

import pytest
import testkit  # registered by tests/conftest.py

pytest_pycollect_makemodule = testkit.folder_requires("torch", "transformers", "peft")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    testkit.mark_folder(items, Path(__file__).parent, pytest.mark.gpu)
