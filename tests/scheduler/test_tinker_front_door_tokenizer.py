"""The Tinker front door started with ``--offer tiny`` alone (no ``=TOKENIZER``), the hub offline: ``get_info`` names tiny's
folder on this machine, and the official SDK's ``get_tokenizer()`` loads it, with the tokens the worker's server reads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("tinker")

from tinkergym.scheduler.app import SchedulerSettings, create_app  # noqa: E402
from tinkergym.serve.asgi import ThreadServer  # noqa: E402
from workerkit import shared_worker  # noqa: E402  # registered by tests/scheduler/conftest.py

pytestmark = pytest.mark.slow

#: The client, as a process of its own so that the hub is offline from its first import: a run's tokenizer, as get_info names it.
CLIENT = """
import json, sys
import tinker

service = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
training = service.create_lora_training_client(base_model="tiny", rank=4).result()
print(json.dumps({"tokenizer_id": training.get_info().model_data.tokenizer_id, "tokens": training.get_tokenizer().encode("hello")}))
service.close("success").result()
"""


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # real processes end to end: one database (see tests/scheduler/conftest.py)
def test_an_offer_of_tiny_gives_the_sdk_a_tokenizer_it_loads_offline(db_url: str, keys: Any, tiny: str, tmp_path: Path) -> None:
    import testkit
    from transformers import AutoTokenizer

    cache = tmp_path / "cache"
    shutil.copytree(tiny, cache / "models" / "tiny")  # as `resolve_model("tiny")` leaves it, for the worker and the front door
    offline = {**os.environ, "TINKERGYM_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    alice, worker_key = keys.new("acme", "read,write"), keys.new("ops", "worker")
    scheduler = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", lease_ttl_s=6.0, sweep_interval_s=0.2)))
    worker = shared_worker(scheduler.url, worker_key, tmp_path / "w1", cache, seats=1, env={"HF_HUB_OFFLINE": "1"})
    port = testkit.free_port()
    door = subprocess.Popen([sys.executable, "-m", "tinkergym", "serve", "tinker", "--scheduler", scheduler.url, "--offer", "tiny", "--dtype", "float32",
                             "--db", db_url, "--run-dir", str(tmp_path / "door"), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "door.log", "w"), env=offline)
    try:
        testkit.wait_until_answers(f"http://127.0.0.1:{port}/api/v1/healthz", timeout=120, process=door)
        done = subprocess.run([sys.executable, "-c", CLIENT, f"http://127.0.0.1:{port}", "tml-" + alice], capture_output=True, text=True,
                              env=offline, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:] + (tmp_path / "door.log").read_text()[-2000:]
        answer = json.loads(done.stdout.splitlines()[-1])
    finally:
        for process in (door, worker):
            if process.poll() is None:
                process.kill()
                process.wait()
        scheduler.stop()
    assert answer["tokenizer_id"] == str(cache / "models" / "tiny")
    assert answer["tokens"] == AutoTokenizer.from_pretrained(tiny).encode("hello")
    assert "warning" not in (tmp_path / "door.log").read_text()
