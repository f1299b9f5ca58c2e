"""The engines' tests (tinkergym.backends): every module here needs the ``train`` extra (torch, transformers, peft);
without it each is reported skipped, with the reason, and none is imported."""

from __future__ import annotations

import testkit  # registered by tests/conftest.py

pytest_pycollect_makemodule = testkit.folder_requires("torch", "transformers", "peft")
