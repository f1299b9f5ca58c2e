"""Env share of a rollout: how long a ``tinker/MathTool-v0`` rollout waits on env steps, serial vs concurrent.

    python benchmarks/rollout_env_share.py                        # 64 episodes, 3 python calls each, remote-model pacing
    python benchmarks/rollout_env_share.py --model tiny           # the tiny model generates on this CPU instead
    python benchmarks/rollout_env_share.py --workers 1 4 8 32     # more pool sizes
    python benchmarks/rollout_env_share.py --quick                # 4 episodes of 1 call (a smoke test)

Every episode calls the ``python`` tool ``--calls`` times (each call starts a sandboxed subprocess), then
answers. The answers are scripted: the code of each call evaluates the expression the math package's
baseline agent finds in the problem (or adds up the problem's numbers). The sampler costs what a model
would, in one of two ways: ``--sample-seconds`` waits that long per ``sample`` call, as a client does on a
remote GPU backend (the default, 2 s: about 64 x 100 new tokens of a 1B model on one GPU); ``--model`` (a
:class:`~tinkergym.backends.torch.backend.TorchBackend`: ``tiny``, ``smollm2-135m``, a folder) generates as
many tokens as the longest scripted answer on the same prompts, on this machine, and throws them away.

The same rollout runs once per ``--workers`` value (``1``: envs stepped one after another).
Columns: ``wall`` the rollout; ``sample`` inside ``sample``; ``render`` chat-template rendering and decoding;
``env wait`` the rest, the time the loop waits on ``env.reset`` / ``env.step``; ``share`` env wait over wall;
``not sampling`` render plus env wait (rendering overlaps the env calls of a round, so on a small machine it
slows down while their subprocesses hold the cores: compare this column across runs, not ``render`` alone);
``env busy`` the summed duration of all env calls (over threads); ``other`` cores used by other processes
meanwhile (near 0: the machine was ours). The two runs must give identical trajectories; the script checks.
The training pass of a step (forward, backward, optimizer) comes on top of the rollout and is the same in
both runs, so the env's share of a whole step is smaller than its share of the rollout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import threading
import time
from typing import Any

import tinkergym
from tinkergym.protocol.types import SampledSequence, SampleRequest, SampleResponse, SamplingParams
from tinkergym.chat import ChatTemplateRenderer
from tinkergym.rollouts import RolloutConfig, rollout
from tinkergym_math.agents import find_expression

_NUMBER = re.compile(r"\d+(?:\.\d+)?")


class TimedEnv:
    """An env whose ``reset`` / ``step`` durations (from any thread) and python tool calls are counted."""

    def __init__(self, env: Any, stats: dict[str, float], questions: list[str], lock: threading.Lock) -> None:
        self.env, self.stats, self.questions, self.lock = env, stats, questions, lock

    def _timed(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            with self.lock:
                self.stats["env_busy"] += time.perf_counter() - start

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        """Reset and remember the problem, so the scripted sampler can find it in a prompt."""
        observation, info = self._timed(self.env.reset, seed=seed, options=options)
        with self.lock:
            self.questions.append(self.env.unwrapped.problem.question)
        return observation, info

    def step(self, action: str) -> tuple:
        """Step and count the python calls it ran."""
        result = self._timed(self.env.step, action)
        calls = [c for c in result[4].get("tool_calls", []) if c["name"] == "python"]
        with self.lock:
            self.stats["python_calls"] += len(calls)
        return result


class TimedRenderer:
    """A chat renderer whose calls (all on the rollout's calling thread) are timed."""

    def __init__(self, inner: ChatTemplateRenderer, stats: dict[str, float]) -> None:
        self.inner, self.stats, self.stop_token_ids = inner, stats, inner.stop_token_ids

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.inner, name)
        if name not in ("render", "prompt_tokens", "bridge_tokens", "decode"):
            return attribute

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return attribute(*args, **kwargs)
            finally:
                self.stats["render"] += time.perf_counter() - start

        return timed


class ScriptedToolSampler:
    """Answers like a model that calls the python tool ``calls`` times, then gives a boxed answer.

    Each call first waits ``pace`` seconds and, with a backend, lets it generate as many tokens on the same
    prompts (the model's cost).
    """

    def __init__(self, renderer: ChatTemplateRenderer, questions: list[str], calls: int, backend: Any, pace: float, stats: dict[str, float]) -> None:
        self.renderer, self.questions, self.calls, self.backend, self.pace, self.stats = renderer, questions, calls, backend, pace, stats
        self.rounds = 0

    def _answer(self, prompt: list[int]) -> str:
        text = self.renderer.tokenizer.decode(prompt)
        done = text.count("</tool_response>")
        if done >= self.calls:
            return "The tool says so.\n\\boxed{42}"
        question = next((q for q in self.questions if q in text), "")
        expression = find_expression(question) or " + ".join(_NUMBER.findall(question)[:6]) or "0"
        call = {"name": "python", "arguments": {"code": f"x = {expression}\nprint(x, {done})"}}
        return f"Let me compute this.\n<tool_call>{json.dumps(call)}</tool_call>"

    def sample(self, request: SampleRequest) -> SampleResponse:
        """Scripted ids for every prompt, after paying the model's cost for as many tokens."""
        start = time.perf_counter()
        tokenizer = self.renderer.tokenizer
        answers = []
        for prompt in request.prompts:
            ids = tokenizer.encode(self._answer(prompt), add_special_tokens=False)[: request.params.max_new_tokens - 1]
            answers.append(ids + [self.renderer.stop_token_ids[0] if tokenizer.eos_token_id is None else tokenizer.eos_token_id])
        time.sleep(self.pace)
        if self.backend is not None:
            params = SamplingParams(max_new_tokens=max(map(len, answers)), stop_token_ids=[-1], seed=self.rounds)
            self.backend.sample(SampleRequest(prompts=request.prompts, params=params))
        self.rounds += 1
        self.stats["sample"] += time.perf_counter() - start
        sequences = [[SampledSequence(tokens=ids, logprobs=[0.0] * len(ids), finish_reason="stop")] for ids in answers]
        return SampleResponse(sequences=sequences)


def _busy_seconds() -> tuple[float, float]:
    """(seconds every CPU was busy, seconds this process and its waited-for children used), from /proc and rusage."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    busy = (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    own = sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)))
    return busy, own


def run_once(args: argparse.Namespace, workers: int, renderer: ChatTemplateRenderer, backend: Any) -> tuple[dict[str, float], list]:
    """One rollout of ``args.episodes`` MathTool episodes with ``workers`` env threads; its timings and trajectories."""
    stats = {"sample": 0.0, "render": 0.0, "env_busy": 0.0, "python_calls": 0.0}
    questions: list[str] = []
    lock = threading.Lock()
    envs = [TimedEnv(tinkergym.make("tinker/MathTool-v0", max_tool_calls=args.calls), stats, questions, lock) for _ in range(args.episodes)]
    sampler = ScriptedToolSampler(renderer, questions, args.calls, backend, args.sample_seconds, stats)
    config = RolloutConfig(max_turns=args.calls + 1, max_new_tokens=args.max_new_tokens, max_context=args.max_context, env_workers=workers)
    cpu_before = _busy_seconds()
    start = time.perf_counter()
    trajectories = rollout(envs, sampler, TimedRenderer(renderer, stats), config, seeds=list(range(args.episodes)))
    wall = time.perf_counter() - start
    cpu_after = _busy_seconds()
    other = max((cpu_after[0] - cpu_before[0]) - (cpu_after[1] - cpu_before[1]), 0.0) / wall
    env_wait = wall - stats["sample"] - stats["render"]
    return {"workers": workers, "wall": wall, **stats, "env_wait": env_wait, "share": env_wait / wall, "other_cores": other}, trajectories


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--calls", type=int, default=3, help="python tool calls per episode")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, RolloutConfig.env_workers], help="env_workers of each run")
    parser.add_argument("--sample-seconds", type=float, default=None, help="wait per sample call (default 2, or 0 with --model)")
    parser.add_argument("--model", default="none", help="TorchBackend model that generates on this machine, or 'none'")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--max-context", type=int, default=4096)
    parser.add_argument("--quick", action="store_true", help="4 episodes of 1 call, pools of 1 and 4, no wait per sample (a smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.episodes, args.calls, args.workers = 4, 1, [1, 4]
        args.sample_seconds = 0.0 if args.sample_seconds is None else args.sample_seconds
    if args.sample_seconds is None:
        args.sample_seconds = 2.0 if args.model == "none" else 0.0
    backend = None
    if args.model != "none":
        from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig

        backend = TorchBackend(TorchBackendConfig(model=args.model, lora_rank=0))
        renderer = ChatTemplateRenderer(backend.tokenizer)
    else:
        from tinkergym.backends.models import resolve_model

        renderer = ChatTemplateRenderer(resolve_model("tiny"))
    warm = argparse.Namespace(**{**vars(args), "episodes": 2, "sample_seconds": 0.0})
    run_once(warm, 2, renderer, backend)  # loads data, warms the model and the template caches
    rows, runs = [], []
    for workers in args.workers:
        row, trajectories = run_once(args, workers, renderer, backend)
        rows.append(row)
        runs.append(trajectories)
    print(f"{args.episodes} episodes x {args.calls} python calls; sampler: {args.sample_seconds:g} s per call, model {args.model}; {os.cpu_count()} cores")
    print(f"{'env_workers':>11} {'wall s':>7} {'sample s':>9} {'render s':>9} {'env wait s':>11} {'share':>6} "
          f"{'not sampling s':>15} {'env busy s':>11} {'python calls':>13} {'other':>6}")
    for r in rows:
        print(f"{r['workers']:>11} {r['wall']:>7.2f} {r['sample']:>9.2f} {r['render']:>9.2f} {r['env_wait']:>11.2f} {r['share']:>6.0%} "
              f"{r['wall'] - r['sample']:>15.2f} {r['env_busy']:>11.2f} {int(r['python_calls']):>13} {r['other_cores']:>6.2f}")
    same = all(run == runs[0] for run in runs)
    print(f"identical trajectories: {'yes' if same else 'NO'}")
    print(json.dumps({"args": vars(args), "rows": rows, "identical": same}))


if __name__ == "__main__":
    main()
