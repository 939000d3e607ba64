"""The benchmarks still run against the current mesh (tiny sizes; their figures are not
checked here, only that they measure and print them)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
BENCH = Path(__file__).resolve().parents[2] / "bench"


def run_bench(name: str, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, str(BENCH / name), *args], capture_output=True, text=True, timeout=420
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout


def test_step_breakdown_measures_a_real_mesh_step() -> None:
    text = run_bench("step_breakdown.py", "--steps", "3")
    assert "step total" in text and "mesh cost per step" in text
    cpu = {line.split()[0]: line.split()[-1] for line in text.split("CPU per step")[-1].splitlines()
           if line.startswith("  ")}  # fmt: skip
    assert {"rollout", "trainer", "envhub", "scheduler", "redis", "all"} <= set(cpu), text
    assert float(cpu["all"]) > 0, text


def test_env_throughput_measures_envhub_against_in_process() -> None:
    text = run_bench("env_throughput.py", "--steps", "20", "--concurrency", "1,2")
    assert "in-process:" in text and "overhead" in text


def test_trainer_memory_measures_both_paths() -> None:
    text = run_bench("trainer_memory.py", "--quick")
    assert "old MiB" in text and "new MiB" in text
    rows = [line.split() for line in text.splitlines() if line.split()[:1] == ["16"]]
    assert rows and rows[0][2].isdigit() and rows[0][3].isdigit()  # both measured, no error


def test_shared_prompt_memory_measures_both_paths_with_and_without_checkpointing() -> None:
    text = run_bench("shared_prompt_memory.py", "--quick")
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.split()[:1]
            in (["off"], ["on"])}  # fmt: skip
    assert set(rows) == {"off", "on"}, text
    for row in rows.values():  # plain and shared MiB and seconds all measured, no error
        assert all(float(cell.rstrip("x")) >= 0 for cell in row[1:]), text


def test_gateway_overhead_measures_the_sdk_through_the_gateway_and_grpc() -> None:
    text = run_bench("gateway_overhead.py", "--calls", "2")
    assert "forward_backward" in text and "sample" in text and "overhead" in text


def test_vs_inprocess_measures_the_mesh_and_one_process() -> None:
    text = run_bench("vs_inprocess.py", "--quick", "--staleness", "0,1")
    assert "mesh, staleness 0" in text and "mesh, staleness 1" in text and "in-process" in text
    assert "ratio mesh, staleness 1 / in-process (s/step):" in text
    assert "step split (mesh, staleness 1" in text


def test_vs_inprocess_builds_the_model_size_asked_for() -> None:
    text = run_bench(
        "vs_inprocess.py", "--quick", "--staleness", "0", "--hidden-size", "64", "--layers", "1"
    )
    assert "hidden 64, 1 layers, 0.1M parameters" in text, text
    assert "ratio mesh, staleness 0 / in-process (s/step):" in text, text


def test_prefix_cache_measures_continued_turns_against_plain_ones() -> None:
    text = run_bench("prefix_cache.py", "--episodes", "4", "--turns", "3", "--rounds", "1")
    assert "every prompt again" in text and "continued" in text, text
    assert "x as fast" in text, text
    shared = ("--episodes", "4", "--turns", "3", "--rounds", "1", "--adapters", "2")
    text = run_bench("prefix_cache.py", *shared)
    assert "a shared engine with 2 LoRA adapters" in text and "x as fast" in text, text


def test_loss_positions_measures_the_head_on_trained_tokens_against_every_position() -> None:
    args = ["--calls", "1", "--vocab", "4096", "--hidden-size", "64", "--layers", "1"]
    text = run_bench("loss_positions.py", *args, "--prompt-tokens", "8", "--model-tokens", "4",
                     "--env-tokens", "6")  # fmt: skip
    # 2 groups x 4 samples of 1-3 turns (15 in all, 4 trained tokens each), 8 x (32 - 1) positions
    assert "8 episodes, 248 positions, 60 trained (24%)" in text, text
    assert "head everywhere" in text and "on trained tokens" in text and "x\n" in text, text


def test_padding_passes_measures_one_padded_pass_against_like_length_passes() -> None:
    args = ["--calls", "1", "--hidden-size", "32", "--layers", "1", "--groups", "2",
            "--prompt-tokens", "8", "--model-tokens", "4", "--env-tokens", "12"]  # fmt: skip
    text = run_bench("padding_passes.py", *args)
    # turns 1..8 cycle over 2 groups x 4 samples: lengths 12 (1 turn) to 76 (5 turns)
    assert "8 episodes of 1-8 turns" in text and "lengths 12-76" in text, text
    assert "one padded pass" in text and "1 passes, 608 padded tokens" in text, text
    assert "like-length passes" in text and "x as fast" in text, text


def test_gpu_rl_runs_its_job_and_prints_the_start_up_timeline(tmp_path: Path) -> None:
    """The GPU check's RL bench on CPU (transformers engine, tiny model): a device lease is
    too short to find out there that the bench itself is broken."""
    from opentinker.services.modeling.tiny_model import ensure_tiny_model

    model = ensure_tiny_model(tmp_path / "tiny")
    sizes = ("--steps", "3", "--prompts", "2", "--samples", "2", "--max-new-tokens", "4")
    text = run_bench("gpu_rl.py", "--engine", "transformers", "--model", str(model), *sizes)
    assert "SUCCEEDED (lora)" in text, text
    timeline = text.split("start-up, from its logs:")[1].split("step 1:")[0].splitlines()
    events = [line.split()[2:] for line in timeline if line.strip()]
    assert ["worker", "process_started"] in events and ["rollout", "rollout_serving"] in events
    assert events[-1] == ["trainer", "step"], text  # up to the first step
    rewards = text.split("reward_mean by step:")[1].split()
    assert len(rewards) == 3 and all(0.0 <= float(r) <= 1.0 for r in rewards), text


def test_multi_turn_job_runs_the_mesh_with_the_prefix_cache_on_and_off() -> None:
    args = ["--steps", "3", "--turns", "2", "--prompts", "2", "--samples", "2", "--rounds", "1"]
    text = run_bench("multi_turn_job.py", *args)
    assert "prefix cache" in text and "every prompt again" in text, text
    assert "x faster" in text, text


def test_scaling_measures_concurrent_jobs_and_batch_sizes() -> None:
    sizes = ("--jobs", "2", "--steps", "3", "--batches", "16", "--batch-steps", "3")
    text = run_bench("scaling.py", *sizes)
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line[:1] == " "}
    assert "== concurrent jobs" in text and "== batch size" in text
    assert float(rows["2"][1]) > 0 and float(rows["16"][1]) > 0, text  # both measured a step


def test_multi_lora_measures_a_shared_engine_against_separate_ones() -> None:
    text = run_bench(
        "multi_lora.py", "--ks", "1,2", "--prompts", "2", "--new-tokens", "4", "--rounds", "1"
    )
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line[:3].strip()}
    assert "shared/separate" in text, text
    assert float(rows["2"][1]) > 0 and float(rows["2"][2]) > 0, text  # both sides measured


@pytest.mark.unit
def test_multi_lora_with_vllm_says_what_it_needs_where_it_cannot_run() -> None:
    if (
        "cuda"
        in subprocess.run(
            [sys.executable, "-c", "import torch; print('cuda' * torch.cuda.is_available())"],
            capture_output=True,
            text=True,
        ).stdout
    ):
        pytest.skip("a GPU is here: bench/gpu_check.sh multilora runs the vLLM side")
    out = subprocess.run(
        [sys.executable, str(BENCH / "multi_lora.py"), "--engine", "vllm", "--model", "m"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "needs a CUDA GPU and the vllm extra" in out.stderr


@pytest.mark.unit
def test_no_bench_module_is_named_as_a_stdlib_or_installed_one() -> None:
    """A bench runs with bench/ as sys.path[0], and mypy reads bench/ through mypy_path
    (pyproject.toml): a bench named as a stdlib or installed module (``profile.py``) would
    shadow that module there."""
    site = [sysconfig.get_paths()[key] for key in ("purelib", "platlib")]
    installed = {module.name for module in pkgutil.iter_modules(site)}
    benches = {path.stem for path in BENCH.glob("*.py")}
    assert not benches & (installed | set(sys.stdlib_module_names))


@pytest.mark.unit
def test_vs_inprocess_rounds_give_medians_and_spread_per_round(
    capsys: pytest.CaptureFixture[str],
) -> None:
    sys.path.insert(0, str(BENCH))
    from vs_inprocess import Run, report_rounds  # noqa: PLC0415 - bench/ is not a package

    def round_of(mesh_s: float | None, base_s: float) -> list[Run]:
        mesh = Run("mesh, staleness 0", steps=10, seconds_to_target=mesh_s, train_seconds=2.0)
        return [mesh, Run("in-process", steps=10, seconds_to_target=base_s, train_seconds=1.0)]

    report_rounds([round_of(30.0, 10.0), round_of(None, 20.0), round_of(60.0, 20.0)])
    text = capsys.readouterr().out
    assert "over 3 rounds" in text
    # each ratio pairs a mesh run with its own round's in-process run: 3.00x and 3.00x
    assert "s to target 3.00x [3.00, 3.00] (1 not reached)" in text, text
    assert "s/step 2.00x [2.00, 2.00]" in text, text
    assert "in-process           s to target 20.00s [10.00, 20.00]" in text, text


@pytest.mark.unit
def test_the_gpu_check_runs_every_test_file_that_holds_a_gpu_test() -> None:
    """A `gpu` test runs only on a lent GPU machine, through bench/gpu_check.sh's file list."""
    script = (BENCH / "gpu_check.sh").read_text()
    tests = BENCH.parent / "tests"
    holding = {
        str(f.relative_to(tests))
        for f in tests.glob("*/test_*.py")
        if any(line.strip() == "@pytest.mark.gpu" for line in f.read_text().splitlines())
    }
    assert "rollout/test_prefix_cache.py" in holding
    missing = sorted(name for name in holding if f"tests/{name}" not in script)
    assert not missing, f"bench/gpu_check.sh's tests step leaves out {missing}"


@pytest.mark.unit
def test_the_gpu_check_goes_on_after_a_failed_step_and_ends_what_a_hung_one_left(
    tmp_path: Path,
) -> None:
    """One call runs several steps of a 15-minute device budget: a failure or a hang in one
    must not cost the others, nor leave a process holding the GPU (the mesh's services run in
    sessions of their own, out of the step timeout's reach). Processes it did not start stay."""
    fake_bin = tmp_path / "bin"  # python3 stands in for pytest: it hangs after leaving a service
    fake_bin.mkdir()
    (fake_bin / "python3").write_text(
        "#!/bin/sh\nsetsid sh -c 'sleep 60' opentinker.services.leftover-$$ &\nsleep 60\n"
    )
    (fake_bin / "python3").chmod(0o755)
    bystander = subprocess.Popen(["sh", "-c", "sleep 60", "opentinker.services.bystander"])
    env = {"PATH": f"{fake_bin}:/usr/bin:/bin", "OUT": str(tmp_path / "out"),
           "GPU_CHECK_STEP_LIMIT_S": "2"}  # fmt: skip
    out = subprocess.run(
        ["bash", str(BENCH / "gpu_check.sh"), "no-such-step", "tests", "rl"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "GPU CHECK no-such-step: FAILED (unknown step" in text, text
    assert "GPU CHECK tests: FAILED (over its 2 s limit)" in text, text
    assert "GPU CHECK rl lora: FAILED (over its 2 s limit)" in text, text  # ran after both
    assert "ended the processes the step left" in text, text
    summary = "GPU CHECK SUMMARY: passed none; failed no-such-step tests rl lora"
    assert text.rstrip().endswith(summary), text
    left = subprocess.run(["pgrep", "-f", "opentinker.services.leftover-"], capture_output=True)
    assert left.returncode == 1, left.stdout  # none is left
    assert bystander.poll() is None  # a process the check did not start is left alone
    bystander.kill()


@pytest.mark.unit
def test_the_size_and_turn_benches_refuse_counts_that_measure_nothing() -> None:
    """0 rounds crashed prefix_cache.py on an empty median; 0 turns divided by zero."""
    for name, arg in (("prefix_cache.py", "--rounds"), ("multi_turn_job.py", "--turns")):
        out = subprocess.run(
            [sys.executable, str(BENCH / name), arg, "0"], capture_output=True, text=True
        )
        assert out.returncode == 2, out.stderr[-2000:]
        assert f"argument {arg}: needs at least 1, got 0" in out.stderr
