"""``tinkergym push`` against a fake Hub on 127.0.0.1, driven by the real huggingface_hub client.

The push runs in a subprocess with ``HF_ENDPOINT`` pointing at :class:`FakeHub`, which implements the part
of the Hub's HTTP API that ``create_repo``, ``create_branch`` and ``create_commit`` use: repo creation,
branches, README metadata validation, the preupload call (regular versus LFS files), the commit call (an
NDJSON body with base64 regular files and LFS pointers) and the git-lfs batch API with a basic PUT upload
and a verify call. ``HF_HUB_DISABLE_XET=1`` keeps the client on the LFS protocol: Xet storage talks to a
separate content-addressed storage service that this fake does not imitate.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
from click.testing import CliRunner

pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("huggingface_hub")

import huggingface_hub

import tinkergym
from tinkergym.cli import main

TOKEN = "hf_fake_write_token"
ENV_ID = "tinker/Bandit-v0"
#: Extensions the Hub's default .gitattributes stores in LFS (the ones a model repo meets).
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".onnx", ".msgpack", ".model", ".pkl", ".npy", ".zip")
LFS_MIN_SIZE = 10 * 1024 * 1024
REPO = r"(?P<repo>[\w.-]+/[\w.-]+)"


class HubError(Exception):
    """An HTTP error answer, shaped like the Hub's (X-Error-Message header and a JSON ``error``)."""

    def __init__(self, status: int, message: str, code: str | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.extra = status, message, code, extra


class FakeHub:
    """Just enough of the Hugging Face Hub for create_repo + create_branch + create_commit; records every commit."""

    def __init__(self, token: str = TOKEN) -> None:
        self.token = token
        self.repos: dict[str, dict[str, Any]] = {}  # repo id -> {"visibility", "branches": {name: {path: bytes}}, "heads": {name: sha}}
        self.created: list[dict[str, Any]] = []  # bodies of /api/repos/create
        self.commits: list[dict[str, Any]] = []  # {"repo", "revision", "summary", "files", "lfs"}
        self.lfs: dict[str, bytes] = {}  # oid -> content uploaded through the LFS batch API
        self.requests: list[str] = []
        self.fail: dict[str, tuple[int, str]] = {}  # route name -> (status, message) to answer instead
        self.lock = threading.Lock()
        self.routes = [
            ("POST", re.compile(r"^/api/repos/create$"), "create", self._create),
            ("POST", re.compile(r"^/api/validate-yaml$"), "validate", self._validate_yaml),
            ("POST", re.compile(rf"^/api/models/{REPO}/branch/(?P<rev>[^/]+)$"), "branch", self._branch),
            ("POST", re.compile(rf"^/api/models/{REPO}/preupload/(?P<rev>[^/]+)$"), "preupload", self._preupload),
            ("POST", re.compile(rf"^/api/models/{REPO}/commit/(?P<rev>[^/]+)$"), "commit", self._commit),
            ("GET", re.compile(rf"^/api/models/{REPO}/revision/(?P<rev>[^/]+)$"), "info", self._info),
            ("POST", re.compile(rf"^/{REPO}\.git/info/lfs/objects/batch$"), "batch", self._lfs_batch),
            ("PUT", re.compile(r"^/lfs-storage/(?P<oid>[0-9a-f]{64})$"), "lfs-put", self._lfs_put),
            ("POST", re.compile(r"^/lfs-storage/(?P<oid>[0-9a-f]{64})/verify$"), "lfs-verify", self._lfs_verify),
        ]
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def files(self, repo: str, revision: str = "main") -> dict[str, bytes]:
        """The tree of ``repo`` at ``revision`` after the commits so far."""
        return self.repos[repo]["branches"][revision]

    # ----- dispatch -----------------------------------------------------------------------------------
    def handle(self, method: str, path: str, headers: Any, body: bytes) -> tuple[int, Any, dict[str, str]]:
        """Answer one request: (status, JSON body, extra headers)."""
        self.requests.append(f"{method} {path}")
        for route_method, pattern, name, answer in self.routes:
            match = pattern.match(path)
            if route_method == method and match:
                try:
                    if not name.startswith("lfs-") and headers.get("Authorization") != f"Bearer {self.token}":
                        raise HubError(401, "Invalid credentials in Authorization header")
                    if name in self.fail:
                        raise HubError(*self.fail[name])
                    with self.lock:
                        return 200, answer(body=body, **{k: unquote(v) for k, v in match.groupdict().items()}), {}
                except HubError as exc:
                    extra = {"X-Error-Message": exc.message, **({"X-Error-Code": exc.code} if exc.code else {})}
                    return exc.status, {"error": exc.message, **exc.extra}, extra
        return 404, {"error": f"the fake Hub has no route {method} {path}"}, {}

    def _repo(self, repo: str) -> dict[str, Any]:
        if repo not in self.repos:
            raise HubError(404, "Repository not found", "RepoNotFound")
        return self.repos[repo]

    def _tree(self, repo: str, rev: str) -> dict[str, bytes]:
        branches = self._repo(repo)["branches"]
        if rev not in branches:
            raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return branches[rev]

    # ----- routes -------------------------------------------------------------------------------------
    def _create(self, body: bytes) -> dict[str, Any]:
        payload = json.loads(body)
        self.created.append(payload)
        repo = f"{payload['organization']}/{payload['name']}"
        if repo in self.repos:
            raise HubError(409, "You already created this model repo", url=f"{self.url}/{repo}")
        gitattributes = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
        self.repos[repo] = {"visibility": payload.get("visibility", "public"), "branches": {"main": {".gitattributes": gitattributes}}, "heads": {"main": "1" * 40}}
        return {"url": f"{self.url}/{repo}", "name": repo, "id": hashlib.sha1(repo.encode()).hexdigest()[:24]}

    def _validate_yaml(self, body: bytes) -> dict[str, Any]:
        import yaml

        content = json.loads(body)["content"]
        match = re.match(r"^---\n(.*?)\n---\n", content, re.S)
        metadata = yaml.safe_load(match.group(1)) if match else None
        if not isinstance(metadata, dict):
            raise HubError(400, "Invalid metadata: the YAML block is not a mapping")
        return {"errors": [], "warnings": []}

    def _branch(self, repo: str, rev: str, body: bytes) -> dict[str, Any]:
        branches = self._repo(repo)["branches"]
        if rev in branches:
            raise HubError(409, f"Reference already exists: refs/heads/{rev}")
        start = json.loads(body or b"{}").get("startingPoint", "main")
        branches[rev] = dict(self._tree(repo, start))
        self.repos[repo]["heads"][rev] = self.repos[repo]["heads"][start]
        return {}

    def _preupload(self, repo: str, rev: str, body: bytes) -> dict[str, Any]:
        tree = self._tree(repo, rev)
        answer = []
        for file in json.loads(body)["files"]:
            sample = base64.b64decode(file["sample"])
            lfs = file["path"].endswith(LFS_SUFFIXES) or file["size"] >= LFS_MIN_SIZE or b"\x00" in sample
            oid = None
            if file["path"] in tree:  # what the client compares to skip unchanged files: sha256 for LFS, git's sha1 else
                old = tree[file["path"]]
                oid = hashlib.sha256(old).hexdigest() if lfs else hashlib.sha1(b"blob %d\x00" % len(old) + old).hexdigest()
            answer.append({"path": file["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid})
        return {"files": answer, "commitOid": "0" * 40}

    def _lfs_batch(self, repo: str, body: bytes) -> dict[str, Any]:
        self._repo(repo)
        payload = json.loads(body)
        assert payload["operation"] == "upload" and payload["hash_algo"] == "sha256"
        objects = []
        for obj in payload["objects"]:
            answer = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if obj["oid"] not in self.lfs:  # already stored: no actions, the client skips the upload
                href = f"{self.url}/lfs-storage/{obj['oid']}"
                answer["actions"] = {"upload": {"href": href, "header": {}}, "verify": {"href": f"{href}/verify", "header": {}}}
            objects.append(answer)
        return {"transfer": "basic", "objects": objects}

    def _info(self, repo: str, rev: str, body: bytes) -> dict[str, Any]:
        tree = self._tree(repo, rev)
        sha = self.repos[repo]["heads"][rev]
        return {"id": repo, "sha": sha, "private": self.repos[repo]["visibility"] == "private", "siblings": [{"rfilename": p} for p in tree]}

    def _lfs_put(self, oid: str, body: bytes) -> dict[str, Any]:
        if hashlib.sha256(body).hexdigest() != oid:
            raise HubError(400, "the uploaded bytes do not match the sha256 oid")
        self.lfs[oid] = body
        return {}

    def _lfs_verify(self, oid: str, body: bytes) -> dict[str, Any]:
        payload = json.loads(body)
        if oid not in self.lfs or len(self.lfs[oid]) != payload["size"]:
            raise HubError(404, f"LFS object {oid} was not uploaded")
        return {}

    def _commit(self, repo: str, rev: str, body: bytes) -> dict[str, Any]:
        tree = self._tree(repo, rev)
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        if not lines or lines[0]["key"] != "header":
            raise HubError(400, "the first line of a commit must be its header")
        files: dict[str, bytes] = {}
        lfs_paths = []
        for line in lines[1:]:
            value = line["value"]
            if line["key"] == "file":
                assert value["encoding"] == "base64"
                files[value["path"]] = base64.b64decode(value["content"])
            elif line["key"] == "lfsFile":
                if value["oid"] not in self.lfs or len(self.lfs[value["oid"]]) != value["size"]:
                    raise HubError(422, f"LFS file {value['path']} was not uploaded")
                files[value["path"]] = self.lfs[value["oid"]]
                lfs_paths.append(value["path"])
            else:
                raise HubError(400, f"the fake Hub does not implement commit operation {line['key']!r}")
        tree.update(files)
        oid = hashlib.sha1(repr((repo, rev, len(self.commits))).encode()).hexdigest()
        self.repos[repo]["heads"][rev] = oid
        header = lines[0]["value"]
        self.commits.append({"repo": repo, "revision": rev, "summary": header["summary"], "files": files, "lfs": lfs_paths})
        return {"success": True, "commitOid": oid, "commitUrl": f"{self.url}/{repo}/commit/{oid}", "hookOutput": ""}


def _read_body(handler: BaseHTTPRequestHandler) -> bytes:
    """The request body, whether sent with Content-Length or chunked."""
    if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
        chunks = []
        while True:
            size = int(handler.rfile.readline().split(b";")[0].strip(), 16)
            if size == 0:
                while handler.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return b"".join(chunks)
            chunks.append(handler.rfile.read(size))
            handler.rfile.readline()
    return handler.rfile.read(int(handler.headers.get("Content-Length") or 0))


def _handler_for(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self) -> None:
            status, payload, extra = hub.handle(self.command, urlsplit(self.path).path, self.headers, _read_body(self))
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for key, value in extra.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_HEAD = _answer

        def log_message(self, *args: Any) -> None:  # keep pytest output clean
            pass

    return Handler


# ----- fixtures ---------------------------------------------------------------------------------------
def _train(tiny: str, out: Path, *extra: str) -> Path:
    args = [
        "train", "--env", ENV_ID, "--model", tiny, "--dtype", "float32", "--steps", "1", "--batch-size", "2",
        "--group-size", "2", "--max-new-tokens", "4", "--quiet", "--out", str(out), *extra,
    ]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def lora_run(tiny, tmp_path_factory) -> Path:
    return _train(tiny, tmp_path_factory.mktemp("runs") / "lora", "--eval-every", "1", "--eval-episodes", "2")


@pytest.fixture(scope="module")
def full_run(tiny, tmp_path_factory) -> Path:
    return _train(tiny, tmp_path_factory.mktemp("runs") / "full", "--full")


@pytest.fixture
def hub():
    with FakeHub() as fake:
        yield fake


def push(endpoint: str, home: Path, *args: str, token: str | None = TOKEN) -> subprocess.CompletedProcess:
    """Run ``tinkergym push`` in a fresh interpreter, as a user would, against ``endpoint``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(home), HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    if token is not None:
        env["HF_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "tinkergym", "push", *args], env=env, capture_output=True, text=True, timeout=300)


def _materialize(files: dict[str, bytes], folder: Path) -> Path:
    for path, data in files.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_bytes(data)
    return folder


# ----- tests ------------------------------------------------------------------------------------------
def test_lora_run_uploads_every_file_with_its_bytes_and_a_model_card(lora_run, hub, tmp_path) -> None:
    result = push(hub.url, tmp_path, "--run", str(lora_run), "--repo-id", "me/bandit-grpo")
    assert result.returncode == 0, result.stderr
    assert hub.created == [{"name": "bandit-grpo", "organization": "me"}]  # public unless --private
    [commit] = hub.commits
    assert commit["revision"] == "main" and "grpo" in commit["summary"]
    files = commit["files"]
    final = lora_run / "final"
    expected = {p.name: p.read_bytes() for p in final.iterdir() if p.name != "README.md"}
    expected |= {name: (lora_run / name).read_bytes() for name in ("metrics.jsonl", "learning_curve.png")}
    expected["tinkergym_config.json"] = (lora_run / "config.json").read_bytes()
    expected["eval_transcripts.jsonl"] = sorted((lora_run / "transcripts").glob("eval_step_*.jsonl"))[-1].read_bytes()
    assert {p: files[p] for p in expected} == expected
    assert set(files) == set(expected) | {"README.md", "eval_results.json"}
    assert "config.json" not in files  # the run config never takes the model config's name
    assert {"adapter_model.safetensors", "learning_curve.png"} <= set(commit["lfs"])
    assert json.loads(result.stdout)["files"] == sorted(files)

    last_eval = [r for r in map(json.loads, (lora_run / "metrics.jsonl").read_text().splitlines()) if "eval/reward_mean" in r][-1]
    assert json.loads(files["eval_results.json"])["metrics"]["reward_mean"] == last_eval["eval/reward_mean"]

    card = huggingface_hub.ModelCard(files["README.md"].decode())
    config = json.loads((lora_run / "config.json").read_text())
    assert card.data.base_model == config["model"]
    assert card.data.library_name == "peft"
    assert {"tinkergym", "reinforcement-learning", "grpo", "lora", ENV_ID} <= set(card.data.tags)
    spec = tinkergym.spec(ENV_ID)
    assert f"`{spec.distribution}`" in card.text and spec.version in card.text
    assert "![Reward against training step](learning_curve.png)" in card.text
    assert "training reward" in card.text and "eval reward_mean" in card.text
    assert "lora_rank: 8" in card.text  # the resolved config


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
def test_the_cards_usage_snippet_runs_the_pushed_adapter_on_the_env(lora_run, hub, tmp_path) -> None:
    assert push(hub.url, tmp_path, "--run", str(lora_run), "--repo-id", "me/bandit-usage").returncode == 0
    folder = _materialize(hub.files("me/bandit-usage"), tmp_path / "download")
    card = (folder / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", card, re.S).group(1).replace('"me/bandit-usage"', repr(str(folder)))
    namespace: dict[str, Any] = {}
    exec(compile(snippet, "README.md", "exec"), namespace)  # noqa: S102 - the card's own example
    assert isinstance(namespace["action"], str) and isinstance(namespace["reward"], float)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
def test_merged_pushes_a_full_model_that_transformers_loads(lora_run, tiny, hub, tmp_path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    args = ("--run", str(lora_run), "--repo-id", "my-org/bandit-merged", "--merged", "--private", "--branch", "exp", "--commit-message", "merged weights")
    result = push(hub.url, tmp_path, *args)
    assert result.returncode == 0, result.stderr
    assert hub.created[-1]["visibility"] == "private"
    [commit] = hub.commits
    assert (commit["revision"], commit["summary"]) == ("exp", "merged weights")
    files = commit["files"]
    assert {"model.safetensors", "config.json", "tokenizer.json", "README.md", "tinkergym_config.json"} <= set(files)
    assert not any(name.startswith("adapter_") for name in files)
    assert files["tokenizer.json"] == (lora_run / "final" / "tokenizer.json").read_bytes()
    card = huggingface_hub.ModelCard(files["README.md"].decode())
    assert card.data.library_name == "transformers" and "lora" not in card.data.tags

    merged = AutoModelForCausalLM.from_pretrained(_materialize(files, tmp_path / "merged"))
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny), str(lora_run / "final"))
    ids = torch.tensor([[5, 17, 42, 99, 3]])
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, reference(ids).logits, atol=1e-5)


@pytest.mark.slow
def test_full_run_pushes_its_model_and_a_second_push_reuses_the_repo(full_run, hub, tmp_path) -> None:
    results = [push(hub.url, tmp_path, "--run", str(full_run), "--repo-id", "me/bandit-full", "--merged") for _ in range(2)]
    assert [r.returncode for r in results] == [0, 0], results[-1].stderr
    assert "already a full model" in results[0].stderr
    # The second create answered 409 and the push went on; nothing had changed, so no empty commit was made.
    assert len(hub.created) == 2 and len(hub.commits) == 1
    assert json.loads(results[1].stdout)["commit"] == json.loads(results[0].stdout)["commit"]
    files = hub.commits[0]["files"]
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert files[name] == (full_run / "final" / name).read_bytes()
    assert files["tinkergym_config.json"] == (full_run / "config.json").read_bytes()
    assert "eval_results.json" not in files  # the run never evaluated
    card = huggingface_hub.ModelCard(files["README.md"].decode())
    assert card.data.library_name == "transformers" and "lora" not in card.data.tags
    assert "tinkergym eval --env tinker/Bandit-v0 --model me/bandit-full" in card.text


def test_a_short_model_name_becomes_its_hub_id_in_the_card_and_the_adapter_config(lora_run, hub, tmp_path) -> None:
    run = shutil.copytree(lora_run, tmp_path / "run")
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "model": "smollm2-135m"}))
    result = push(hub.url, tmp_path, "--run", str(run), "--repo-id", "me/bandit-smol")
    assert result.returncode == 0, result.stderr
    files = hub.files("me/bandit-smol")
    assert huggingface_hub.ModelCard(files["README.md"].decode()).data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    adapter = json.loads(files["adapter_config.json"])
    original = json.loads((run / "final" / "adapter_config.json").read_text())
    assert adapter == {**original, "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def test_help_explains_the_command() -> None:
    result = CliRunner().invoke(main, ["push", "--help"])
    assert result.exit_code == 0
    for text in ("--repo-id", "--merged", "--private", "--token", "--branch", "--commit-message", "tinkergym_config.json", "Exit codes"):
        assert text in result.output


def test_bad_input_is_a_usage_error(lora_run, tmp_path) -> None:
    not_a_run = tmp_path / "empty"
    not_a_run.mkdir()
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    shutil.copy(lora_run / "config.json", unfinished / "config.json")
    cases = [
        (["--run", str(not_a_run), "--repo-id", "me/x"], "not a run folder"),
        (["--run", str(unfinished), "--repo-id", "me/x"], "tinkergym train --resume"),
        (["--run", str(tmp_path / "missing"), "--repo-id", "me/x"], "does not exist"),
        (["--run", str(lora_run), "--repo-id", "no-namespace"], "not a Hub repo id"),
        (["--run", str(lora_run), "--repo-id", "a/b/c"], "not a Hub repo id"),
        (["--run", str(lora_run), "--repo-id", "me/bad--name"], "not a Hub repo id"),
        (["--run", str(lora_run)], "Missing option '--repo-id'"),
    ]
    for args, message in cases:
        result = CliRunner().invoke(main, ["push", *args, "--token", TOKEN])
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output, (args, result.output)


def test_no_token_and_no_login_is_a_usage_error(lora_run, hub, tmp_path) -> None:
    result = push(hub.url, tmp_path, "--run", str(lora_run), "--repo-id", "me/x", token=None)
    assert result.returncode == 2, result.stderr
    assert "no Hugging Face token" in result.stderr and "hf auth login" in result.stderr
    assert hub.requests == []


@pytest.mark.slow
def test_upload_failures_exit_1_with_the_servers_message(lora_run, hub, tmp_path) -> None:
    result = push(hub.url, tmp_path, "--run", str(lora_run), "--repo-id", "me/x", token="hf_wrong")
    assert result.returncode == 1
    assert "Invalid credentials in Authorization header" in result.stderr

    hub.fail["commit"] = (403, "You have exceeded your storage quota")
    result = push(hub.url, tmp_path, "--run", str(lora_run), "--repo-id", "me/x")
    assert result.returncode == 1
    assert "You have exceeded your storage quota" in result.stderr and hub.commits == []

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    result = push(closed, tmp_path, "--run", str(lora_run), "--repo-id", "me/x")
    assert result.returncode == 1 and f"the upload to {closed} failed" in result.stderr
