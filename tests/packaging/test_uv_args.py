"""``make install`` passes this machine's pip settings on to uv (tools/uv_args.py): the wheels, indexes and constraints
pip would use, the environment's variables over the files, as in pip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import uv_args  # from tools/, on sys.path from the line above


def test_pips_own_settings_become_uv_options() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_FIND_LINKS="/env/wheels", PIP_EXTRA_INDEX_URL="file:///a/simple file:///b/simple",
               PIP_CONSTRAINT="/etc/caps.txt", PIP_DEFAULT_TIMEOUT="5")
    out = subprocess.run([sys.executable, str(Path(uv_args.__file__)), sys.executable], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["--extra-index-url", "file:///a/simple", "--extra-index-url", "file:///b/simple", "--find-links", "/env/wheels",
                           "--constraint", "/etc/caps.txt", "--index-strategy", "unsafe-best-match"]


def test_the_environment_wins_over_the_files_and_other_sections_are_ignored() -> None:
    listed = ("global.find-links='/file/wheels'\nglobal.index-url='https://mirror/simple'\nfreeze.find-links='/not/this'\n"
              ":env:.find-links='/env/wheels'\n:env:.default-timeout='180'\n")
    assert uv_args.uv_args(uv_args.parse(listed)) == ["--index-url", "https://mirror/simple", "--find-links", "/env/wheels",
                                                       "--index-strategy", "unsafe-best-match"]
    assert uv_args.uv_args(uv_args.parse("")) == []
