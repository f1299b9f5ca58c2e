"""The servers' tests (tinkergym.serve: the training server, the inference server): every module here needs the
``serve`` extra's fastapi and uvicorn; without them each is reported skipped, with the reason, and none is imported."""

from __future__ import annotations

import testkit  # registered by tests/conftest.py

pytest_pycollect_makemodule = testkit.folder_requires("fastapi", "uvicorn")
