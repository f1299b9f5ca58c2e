"""What a worker checks before it offers anything, and how it reads a job server's exit. Standard library only.

At start (:func:`check_worker`), with the Python its servers run under (``--python``), in one quick subprocess that
imports nothing heavy: the servers' packages are installed (``importlib.util.find_spec``), each model it offers is
available without the network (:func:`tinkergym.backends.models.unavailable_reason`: files, not a load); and each
GPU it lists exists (``nvidia-smi -L``, else ``torch.cuda.device_count()``). A worker that cannot run what it offers
refuses to start, with one line (exit 2), instead of taking jobs and failing them.

A server that exits while starting or running is read by :func:`server_fault`: the exit code 69
(:data:`ENVIRONMENT_EXIT_CODE`, ``tinkergym.serve.lifetime``: a package, the model's files or a device missing) or a
log ending in an import error is this machine's fault, and the worker gives the job back; anything else is the job's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from typing import Any
from pathlib import Path

from tinkergym.plumbing.install import pip_install

#: Exit code of ``serve backend``/``serve model`` when this machine cannot run them (``tinkergym.serve.lifetime``).
ENVIRONMENT_EXIT_CODE = 69
#: Packages the job servers import (the ``train`` and ``serve`` extras).
SERVER_MODULES = ("tinkergym", "click", "uvicorn", "fastapi", "pydantic", "torch", "transformers", "peft", "safetensors")
PROBE_TIMEOUT_S = 120.0
_IMPORT_ERROR = re.compile(r"^(ModuleNotFoundError|ImportError): .*$", re.MULTILINE)

_PROBE = r"""
import importlib.util, json, sys
modules, models = json.loads(sys.argv[1])
missing = []
for name in modules:
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        missing.append(name)
problems = {}
if "tinkergym" not in missing:
    from tinkergym.backends.models import unavailable_reason
    for model in models:
        try:
            problem = unavailable_reason(model)
        except Exception as exc:
            problem = f"{type(exc).__name__}: {exc}"
        if problem:
            problems[model] = problem
print(json.dumps({"missing": missing, "models": problems}))
"""

_GPU_PROBE = "import torch; print(torch.cuda.device_count())"


class WorkerCheckFailed(Exception):
    """This machine cannot run what the worker offers; the message says what is missing and what to do."""


def _probe(python: str, code: str, *args: str, module: bool = False, timeout: float = PROBE_TIMEOUT_S) -> tuple[int, str, str]:
    """Run ``code`` (with ``module``: the module of that name) under ``python``; its exit code, stdout and stderr."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}  # the worker's indexes are the machine's
    try:
        done = subprocess.run([python, "-m" if module else "-c", code, *args], capture_output=True, text=True, timeout=timeout, env=env,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return -1, "", f"{type(exc).__name__}: {exc}"
    return done.returncode, done.stdout, done.stderr


def gpu_count(python: str) -> tuple[int, str]:
    """GPUs on this machine and how they were counted: ``nvidia-smi -L``, else ``torch.cuda.device_count()`` under ``python``."""
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        try:
            done = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60, check=False)
            if done.returncode == 0:
                return sum(1 for line in done.stdout.splitlines() if line.startswith("GPU ")), "nvidia-smi -L"
        except (OSError, subprocess.TimeoutExpired):
            pass
    code, out, _ = _probe(python, _GPU_PROBE)
    try:
        return (int(out.strip().splitlines()[-1]) if code == 0 else 0), "torch.cuda.device_count()"
    except (ValueError, IndexError):
        return 0, "torch.cuda.device_count()"


def gpu_memory_gb(indexes: list[int]) -> dict[int, float]:
    """Each GPU's memory in GiB, by index, as ``nvidia-smi --query-gpu=index,memory.total`` says (MiB); empty without it."""
    smi = shutil.which("nvidia-smi")
    if smi is None or not indexes:
        return {}
    try:
        done = subprocess.run([smi, "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"], capture_output=True, text=True,
                              timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found: dict[int, float] = {}
    for line in done.stdout.splitlines() if done.returncode == 0 else ():
        try:
            index, mib = (part.strip() for part in line.split(","))
            found[int(index)] = round(float(mib) / 1024, 3)
        except ValueError:
            continue
    return {i: found[i] for i in indexes if i in found}


def model_shapes(python: str, models: list[str]) -> tuple[dict[str, Any], str]:
    """The shape of each of ``models`` (:func:`tinkergym.backends.torch.sizing.shape_dict`, counted on the meta device
    under ``python``, so this process imports no torch), and what went wrong for those it could not count ("" if none)."""
    if not models:
        return {}, ""
    _, out, err = _probe(python, "tinkergym.backends.torch.sizing", *models, module=True, timeout=PROBE_TIMEOUT_S * 2)
    try:
        shapes = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        shapes = {}
    problems = " ".join(err.strip().splitlines()[-len(models):]) if len(shapes) < len(models) else ""
    return (shapes if isinstance(shapes, dict) else {}), problems


def check_worker(python: str, devices: list[dict[str, Any]], models: list[str], check_models: bool = True) -> None:
    """:class:`WorkerCheckFailed` (one line) unless ``python`` has the servers' packages, each of ``models`` is available
    (unless ``check_models`` is False) and each GPU of ``devices`` exists."""
    code, out, err = _probe(python, _PROBE, json.dumps([list(SERVER_MODULES), models if check_models else []]))
    try:
        found = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        last = (err.strip().splitlines() or [f"exit code {code}"])[-1]
        raise WorkerCheckFailed(f"{python} cannot run the job servers here: {last}") from None
    problems = []
    if found["missing"]:
        problems.append(f"the job servers need {', '.join(found['missing'])}, which {python} cannot import; "
                        f"install them with: {pip_install('train,serve')}")
    for model, problem in found["models"].items():
        problems.append(f"--models {model}: {problem} (or leave it out of --models; --skip-model-check starts anyway)")
    gpus = sorted(d["index"] for d in devices if d["kind"] == "gpu")
    if gpus:
        count, how = gpu_count(python)
        absent = [i for i in gpus if i >= count]
        listed = ",".join(map(str, absent))
        if absent and count:
            problems.append(f"--gpus {listed}: {how} sees {count} GPU(s) on this machine, indexes 0 to {count - 1}")
        elif absent:
            problems.append(f"--gpus {listed}: {how} sees no GPU on this machine; on a machine without GPUs use --slots N")
    if problems:
        raise WorkerCheckFailed("; ".join(p.replace("\n", " ") for p in problems))


def server_fault(code: int, log_tail: str) -> str | None:
    """Why a job server that exited with ``code`` could not run on this machine (the worker's fault), or None when the
    exit is the job's own: exit code 69, or a log ending in an import error."""
    lines = [line.strip() for line in log_tail.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else f"exit code {code}"
    if code == ENVIRONMENT_EXIT_CODE:
        return last.removeprefix("error: ").removeprefix("Error: ")
    if code != 0 and lines and _IMPORT_ERROR.match(lines[-1]):
        return last
    return None


def log_tail(path: Path, size: int = 3000) -> str:
    """The last ``size`` bytes of a server's log file as text ("(no log)" when it cannot be read)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(handle.tell() - size, 0))
            return handle.read().decode("utf-8", "replace")
    except OSError:
        return "(no log)"


def last_line(log_tail: str, default: str) -> str:
    """The last non-empty line of a server's log (what a one-line error quotes)."""
    lines = [line.strip() for line in log_tail.strip().splitlines() if line.strip()]
    return lines[-1][:500] if lines else default
