"""The front door reads an offered model's files without its weights: a vision-language model offered by a hub id (found in
the local Hugging Face cache, hub offline) takes image chunks as one offered by its folder does; a text model's does not."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

CODE = """
import json, sys
from pathlib import Path
from tinkergym.tinker_api.cluster import ClusterEngine
from tinkergym.backends.tokenizer_files import files_folder

engine = ClusterEngine("http://127.0.0.1:9", {"vlm": "local/tiny-vlm", "text": "local/tiny", "gone": "local/absent"}, Path(sys.argv[1]))
answers = {}
for name in ("vlm", "text", "gone"):
    vision = engine.vision(name)
    answers[name] = None if vision is None else vision.image_token_id
answers["folder"] = files_folder("local/tiny-vlm")
print(json.dumps(answers))
"""


def _cached(folder: str, hub: Path, repo_id: str) -> Path:
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    snapshot = repo / "snapshots" / ("0" * 40)
    shutil.copytree(folder, snapshot)
    return snapshot


@pytest.mark.slow
def test_a_vlm_offered_by_hub_id_takes_images_from_the_local_cache(tiny_vlm: str, tiny: str, tmp_path: Path) -> None:
    from tinkergym.tinker_api.cluster import ClusterEngine

    hub = tmp_path / "hub"
    snapshot = _cached(tiny_vlm, hub, "local/tiny-vlm")
    _cached(tiny, hub, "local/tiny")
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", CODE, str(tmp_path / "door")], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    answers = json.loads(out.stdout.strip().splitlines()[-1])
    # the same image token as the offer by folder reads
    by_folder = ClusterEngine("http://127.0.0.1:9", {"vlm": tiny_vlm}, tmp_path / "door2").vision("vlm")
    assert by_folder is not None and answers["vlm"] == by_folder.image_token_id
    assert answers["text"] is None and answers["gone"] is None
    assert answers["folder"] == str(snapshot)
