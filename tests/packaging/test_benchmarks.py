"""The benchmarks still run: each script's ``--quick`` path on the tiny model, and the precision each side runs in.

Every benchmark runs each side at the fastest precision the device computes natively (tinkergym's
``dtype="auto"``), measures its matmul rate in that precision, sized by time, and records the CPU's kind. A CPU
without native bfloat16 is made here from this one with oneDNN's and ATen's instruction-set caps
(``ONEDNN_MAX_CPU_ISA=AVX2`` turns native bfloat16 off: torch then computes bfloat16 matmuls in its emulated
kernel, as on an AVX2-only CPU), so both paths run on any x86-64 machine.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_machine  # from benchmarks/, on sys.path from the line above

BENCHMARKS = Path(bench_machine.__file__).parent

#: An AVX2-only CPU, as far as torch's kernels can tell (see the module docstring).
AVX2 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
x86_only = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the instruction-set caps are x86-64's")


def run_benchmark(script: str, *args: str, env: dict[str, str] | None = None) -> tuple[dict[str, Any], str]:
    """Run ``benchmarks/<script>`` in a fresh interpreter; its last JSON line and everything it printed."""
    base = {k: v for k, v in os.environ.items() if k not in AVX2}
    proc = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True,
                          env={**base, **(env or {})}, cwd=BENCHMARKS.parent, timeout=900)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} {' '.join(args)} exited with {proc.returncode}:\n{output[-4000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"{script} printed no JSON result:\n{output[-4000:]}"
    return json.loads(lines[-1]), output


def native() -> str:
    from tinkergym.backends.torch.runtime import resolve_dtype

    return str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")


def check_machine(facts: dict[str, Any], capped: bool = False) -> None:
    """The CPU's kind as recorded in a result: torch's capability, native bfloat16 or not, the caps in force."""
    if capped:
        assert facts["cpu_capability"] == "AVX2" and facts["cpu_native_bfloat16"] is False and facts["native_dtype"] == "float32"
        assert facts["isa_caps"] == AVX2
    else:
        assert facts["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
        assert facts["native_dtype"] == native() and facts["cpu_native_bfloat16"] == (native() == "bfloat16")
        assert facts["isa_caps"] == {}


# ----- bench_machine -------------------------------------------------------------------------------
@pytest.mark.parametrize(("rate", "expected"), [(0.9e9, 256), (137e9, 2048), (1e15, 4096)])
def test_the_matmul_is_sized_by_time(rate: float, expected: int) -> None:
    """At an emulated bfloat16 rate the product stays small; at a native rate it grows to the cap, not past it."""
    timed: list[int] = []

    def seconds_of(n: int) -> float:
        timed.append(n)
        return 2.0 * n**3 / rate

    assert bench_machine.matmul_size(seconds_of, target_s=0.02, cap=4096) == expected
    assert all(2.0 * n**3 / rate < 0.02 for n in timed[:-1])  # only the last size timed took the target or more


def test_the_matmul_rate_is_measured_in_the_precision_asked() -> None:
    result = bench_machine.matmul_rate("cpu", "float32", seconds=0.2)
    assert result["matmul_dtype"] == "float32" and result["matmul_flops"] > 0
    assert 128 <= result["matmul_n"] <= 4096 and result["matmul_n"] & (result["matmul_n"] - 1) == 0


def test_a_forced_emulated_precision_names_its_cost() -> None:
    warning = bench_machine.emulation_cost("trl", "bfloat16", "float32", rate=0.9e9, float32_rate=137e9)
    assert warning is not None and "trl runs in bfloat16" in warning and "152x slower" in warning and "--dtype auto" in warning
    assert bench_machine.emulation_cost("trl", "float32", "bfloat16", rate=137e9, float32_rate=137e9) is None
    assert bench_machine.emulation_cost("trl", "bfloat16", "bfloat16", rate=0.9e9, float32_rate=137e9) is None
    assert bench_machine.emulation_cost("trl", "bfloat16", "float32", rate=200e9, float32_rate=137e9) is None  # not slower: no cost


def test_the_native_precision_is_tinkergyms_auto() -> None:
    assert bench_machine.native_dtype("cpu") == native()
    assert bench_machine.resolve_precision("auto", "cpu") == native() and bench_machine.resolve_precision("float32", "cpu") == "float32"
    check_machine(bench_machine.machine_facts("cpu"))


# ----- the GRPO step against TRL -------------------------------------------------------------------
def check_grpo(report: dict[str, Any], precision: str, modes: tuple[str, ...], sides: tuple[str, ...] = ("tinkergym", "trl")) -> None:
    results = {(r["side"], r["mode"]): r for r in report["results"]}
    shape = report["settings"]  # --quick's: 2 prompts x 4 samples of at most 8 new tokens
    assert (shape["prompts"], shape["group_size"], shape["max_new_tokens"]) == (2, 4, 8)
    assert set(results) == {(side, mode) for side in sides for mode in modes}
    for (side, _), r in results.items():
        assert r["dtype"] == precision, (side, r["dtype"])
        assert r["median"]["trained_sequences"] == shape["prompts"] * shape["group_size"] == 8  # hashed rewards: every group trains on both sides
        assert r["x_floor"] > 0 and math.isfinite(r["floor_s"])
        if side == "trl":
            assert r["bf16_autocast"] == (precision == "bfloat16")
            assert r["param_dtype"] == precision
    assert report["matmul"][precision]["matmul_dtype"] == precision
    if len(sides) == 2:
        assert set(report["tinkergym_over_trl"]) == set(modes) and all(v > 0 for v in report["tinkergym_over_trl"].values())


@pytest.mark.slow
def test_grpo_step_quick_runs_both_sides_at_the_native_precision() -> None:
    report, _ = run_benchmark("grpo_step.py", "--quick", "--model", "tiny", "--json")
    check_machine(report["machine"])
    check_grpo(report, native(), ("lora", "full"))
    assert not any(note.startswith("warning:") for note in report["notes"])


@x86_only
@pytest.mark.slow
def test_grpo_step_runs_trl_in_float32_where_bfloat16_is_emulated() -> None:
    report, _ = run_benchmark("grpo_step.py", "--quick", "--model", "tiny", "--modes", "lora", "--json", env=AVX2)
    check_machine(report["machine"], capped=True)
    check_grpo(report, "float32", ("lora",))
    assert set(report["matmul"]) == {"float32"}  # the emulated precision is never measured: nothing runs in it


@x86_only
@pytest.mark.slow
def test_grpo_step_warns_when_a_side_is_forced_into_emulated_bfloat16() -> None:
    report, output = run_benchmark("grpo_step.py", "--quick", "--model", "tiny", "--modes", "lora", "--only", "tinkergym",
                                   "--dtype", "bfloat16", "--json", env=AVX2)
    check_grpo(report, "bfloat16", ("lora",), sides=("tinkergym",))
    warnings = [note for note in report["notes"] if note.startswith("warning:")]
    assert len(warnings) == 1 and "tinkergym runs in bfloat16" in warnings[0] and "x slower" in warnings[0]
    assert warnings[0] in output  # printed as it runs, not only recorded
    assert report["matmul"]["bfloat16"]["matmul_flops"] < report["matmul"]["float32"]["matmul_flops"]


@pytest.mark.slow
def test_grpo_collapse_quick() -> None:
    report, output = run_benchmark("grpo_collapse.py", "--quick")
    assert [(r["side"], r["seed"]) for r in report["runs"]] == [("tinkergym", 11), ("trl", 11)]
    for run in report["runs"]:
        assert len(run["reward"]) == len(run["budget"]) == report["settings"]["steps"] == 3
        assert all(-0.1 <= r <= 1 for r in run["reward"]) and all(0 <= b <= 1 for b in run["budget"])
        assert run["summary"]["min"] == min(run["reward"])
    assert "collapses" in output  # the table


# ----- the other benchmarks ------------------------------------------------------------------------
@pytest.mark.slow
def test_decode_profile_quick() -> None:
    report, _ = run_benchmark("decode_profile.py", "--quick", "--model", "tiny")
    check_machine(report["machine"])
    assert report["dtype"] == native() and report["matmul"]["matmul_dtype"] == native()
    (mode,) = report["modes"]
    assert mode["mode"] == "lora" and mode["dtype"] == native() and mode["sequences"] == 64 and mode["median"]["current"]["total"] > 0


@pytest.mark.slow
def test_decode_profile_with_rows_of_many_lengths_against_another_revision() -> None:
    """--stop-every: rows stop at many lengths; --baseline times the sampler of another revision on the same request."""
    report, out = run_benchmark("decode_profile.py", "--quick", "--model", "tiny", "--stop-every", "3", "--baseline", "HEAD")
    (mode,) = report["modes"]
    assert mode["stop_every"] == 3 and mode["mean_tokens"] <= 4 and set(mode["median"]) == {"current", "baseline"}
    assert "sequences with the same ids as the baseline" in out


def test_decode_profile_refuses_a_negative_stop_period() -> None:
    import decode_profile  # from benchmarks/, on sys.path (see the top of this file)

    with pytest.raises(SystemExit) as refused:
        decode_profile.parse_args(["--stop-every", "-3"])
    assert refused.value.code == 2
    assert decode_profile.parse_args(["--stop-every", "5"]).stop_every == 5


@pytest.mark.slow
@pytest.mark.parametrize("capped", [False, pytest.param(True, marks=x86_only)])
def test_attention_cpu_quick(capped: bool) -> None:
    report, _ = run_benchmark("attention_cpu.py", "--quick", env=AVX2 if capped else None)
    check_machine(report["machine"], capped)
    precision = "float32" if capped else native()
    assert report["dtype"] == precision and report["matmul"]["matmul_dtype"] == precision
    assert [r["shape"] for r in report["results"]] == ["train rows", "train prompt", "prefill", "prefill pad", "decode"]
    assert all(r["sdpa_s"] > 0 and r["grouped_s"] > 0 for r in report["results"])


@pytest.mark.slow
def test_selfplay_throughput_quick() -> None:
    report, _ = run_benchmark("selfplay_throughput.py", "--quick", "--model", "tiny")
    check_machine(report["machine"])
    assert report["dtype"] == native() and report["games"] == 2
    assert report["batched"]["moves"] == report["one at a time"]["moves"] > 0


@pytest.mark.slow
def test_remote_step_quick() -> None:
    report, _ = run_benchmark("remote_step.py", "--quick", "--json")
    check_machine(report["machine"])
    (result,) = report["results"]
    assert result["model"] == "tiny" and result["dtype"] == native() == report["dtype"]
    assert result["median"]["requests"] >= 3 and result["ratio"] > 0 and len(result["steps"]) == 2


@pytest.mark.slow
def test_shared_lora_quick(tmp_path: Path) -> None:
    report, _ = run_benchmark("shared_lora.py", "--quick", "--json", "--memory-budget-gib", "24")
    check_machine(report["machine"])
    results = {(r["layout"], r["k"]): r for r in report["results"]}
    assert set(results) == {(layout, k) for layout in ("shared", "separate", "time_sliced") for k in (1, 2)}
    for (_, k), r in results.items():
        assert r["median"]["tokens_per_s"] > 0 and r["peak_rss_bytes"] >= r["loaded_rss_bytes"] > 0
        assert len(r["median"]["job_s"]) == k and all(s > 0 for s in r["median"]["job_s"])
    assert set(report["ratios"]) == {"1", "2"} and all(v > 0 for row in report["ratios"].values() for v in row.values())
    # jobs held at once: shared by the line through its two peaks, separate as processes at the K=1 peak each
    held, budget = report["capacity"], 24 * 2**30
    shared = [results[("shared", k)]["peak_rss_bytes"] for k in (1, 2)]
    assert held["separate"]["most_by_memory"] == budget // results[("separate", 1)]["peak_rss_bytes"]
    if shared[1] > shared[0]:
        assert held["shared"]["most_by_memory"] == int((budget - (2 * shared[0] - shared[1])) // (shared[1] - shared[0]))
    alone = results[("separate", 1)]["median"]["step_s"]
    for layout in ("shared", "separate"):
        within = [k for k in (1, 2) if results[(layout, k)]["median"]["step_s"] <= 1.5 * alone]
        assert held[layout]["most_by_time_measured"] == max(within, default=0)
    # a saved result is read back with the same figures
    saved = tmp_path / "shared_lora.json"
    saved.write_text(json.dumps(report) + "\n")
    again, printed = run_benchmark("shared_lora.py", "--report", str(saved), "--memory-budget-gib", "24")
    assert again["capacity"] == held and "jobs held at once in 24.0 GiB" in printed


@pytest.mark.slow
def test_league_quick() -> None:
    report, _ = run_benchmark("league.py", "--quick", "--json")
    check_machine(report["machine"])
    results = {(r["side"], r["players"]): r for r in report["results"]}
    assert set(results) == {(side, n) for side in ("league", "separate") for n in (1, 2)}
    assert all(r["games_per_step"] == 2 * n and r["median_step_s"] > 0 and r["peak_rss_bytes"] > 0 for (_, n), r in results.items())
    assert len(results[("separate", 2)]["runs"]) == 2, "N separate runs, a process each"
    assert results[("separate", 2)]["peak_rss_bytes"] == sum(r["peak_rss_bytes"] for r in results[("separate", 2)]["runs"])
    row = report["ratios"]["2"]
    assert row["league_memory_over_n1"] == results[("league", 2)]["peak_rss_bytes"] / results[("league", 1)]["peak_rss_bytes"]
    assert row["memory_league_over_separate"] < 1, "two adapters of one base hold less than two bases"


@pytest.mark.slow
def test_sharded_step_quick() -> None:
    """Both modes on the tiny model: one rank of FSDP2 computes the plain loss; 1 and 2 ranks (and 2 in lockstep) draw the
    same seeded samples, each configuration on all the cores."""
    report, _ = run_benchmark("sharded_step.py", "--quick", "--json")
    sharding, rollouts = report["sharding"], report["rollouts"]
    check_machine(sharding["machine"])
    check_machine(rollouts["machine"])
    assert sharding["sharded"]["first_loss"] == pytest.approx(sharding["plain"]["first_loss"], abs=1e-5)
    runs = {(r["ranks"], r["mode"]): r for r in rollouts["runs"]}
    assert set(runs) == {(1, "split"), (2, "split"), (2, "lockstep")}
    cores = os.cpu_count() or 1
    assert [runs[key]["threads"] for key in sorted(runs)] == [cores, max(1, cores // 2), max(1, cores // 2)]
    tokens = {key: [step["tokens"] for step in r["steps"]] for key, r in runs.items()}
    assert len(set(map(tuple, tokens.values()))) == 1 and tokens[(1, "split")][0] > 0, tokens
    assert all(r["rollout_tokens_per_s"] > 0 and r["median_train_s"] > 0 for r in runs.values())
    assert runs[(2, "split")]["rollout_throughput_over_one_rank"] == runs[(2, "split")]["rollout_tokens_per_s"] / runs[(1, "split")]["rollout_tokens_per_s"]


@pytest.mark.slow
def test_shared_fairness_quick() -> None:
    report, _ = run_benchmark("shared_fairness.py", "--quick", "--json")
    check_machine(report["machine"])
    assert report["model"] == "tiny" and report["batches"] == 6 and report["same_samples"] is True
    assert set(report["modes"]) == {"sliced", "whole"} and report["small_alone_s"] > 0
    assert all(m["small_beside_s"] > 0 and m["huge_s"] > 0 for m in report["modes"].values())


@pytest.mark.slow
def test_env_throughput_quick() -> None:
    from testkit import own_envs  # registered by tests/conftest.py

    ids = [spec.id for spec in own_envs()]  # the generated families' hundreds of ids are their packages' to test
    unavailable = "tinker/ta.Wordle-v0"  # needs NLTK data that is not installed here: skipped with the reason, not a failure
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "env_throughput.py"), "--quick", "--json", *ids, unavailable], capture_output=True,
                          text=True, cwd=BENCHMARKS.parent, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert {r["env"] for r in rows} == set(ids)
    assert f"{unavailable}: skipped:" in proc.stderr and "nltk" in proc.stderr
    assert all(r["steps"] > 0 for r in rows)


def test_sandbox_latency_quick() -> None:
    report, _ = run_benchmark("sandbox_latency.py", "--quick")
    assert set(report) == {"bubblewrap", "rlimits", "bare"} and all(v["median_ms"] > 0 for v in report.values())


@pytest.mark.slow
def test_rollout_env_share_quick() -> None:
    report, _ = run_benchmark("rollout_env_share.py", "--quick")
    assert report["identical"] is True and [r["workers"] for r in report["rows"]] == [1, 4]
    assert all(r["python_calls"] == 4 for r in report["rows"])  # 4 episodes x 1 sandboxed call, in both runs


@pytest.mark.slow
def test_scheduler_load_quick() -> None:
    report, _ = run_benchmark("scheduler_load.py", "--quick", "--json")
    (result,) = report["results"]
    assert result["database"] == "sqlite" and result["failures"] == 0 and result["submissions"] == 40
    assert result["jobs_in_db"] == result["expected_in_db"] == 50


@pytest.mark.slow
def test_tinker_step_quick() -> None:
    report, _ = run_benchmark("tinker_step.py", "--quick", "--json")
    check_machine(report["machine"])
    (result,) = report["results"]
    assert result["model"] == "tiny" and result["dtype"] == native() == report["dtype"] and len(result["steps"]) == 2
    median = result["median"]
    assert median["tinker_requests"] >= 3 and median["wire_requests"] >= 3  # every step went over both wires
    assert result["tinker_over_wire"] > 0 and result["tinker_over_local"] > 0 and median["tinker_server_call_s"] > 0
