"""The prepared GPU benchmark (benchmarks/gpu.sh, benchmarks/gpu_bench.py) cannot run on a GPU in
the test suite; its CPU fallback runs the same code paths at a tiny shape: gpt alone in the default
suite, every architecture and the whole script (torchrun parts included) as slow tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH_TIMEOUT_S = 300  # seconds on 2 busy cores; about 30 s idle for every architecture
SCRIPT_TIMEOUT_S = 900  # gpu.sh on the CPU: about 2 minutes on 2 busy cores


def _gpu_bench():
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks import gpu_bench
    finally:
        sys.path.remove(str(ROOT))
    return gpu_bench


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.parametrize("name, peak", [("NVIDIA H200", 989e12), ("NVIDIA H100 80GB HBM3", 989e12),
                                        ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA H100 PCIe", None),
                                        ("NVIDIA H100 NVL", None), ("Tesla V100-SXM2-16GB", None)])
def test_mfu_is_against_the_gpu_it_ran_on(name, peak):
    """The MFU's peak is the named GPU's from `latentloop plan`'s table (an A100's MFU was taken against
    an H200's peak); a GPU the table does not know, or an H100 PCIe, gets none: --peak-tflops gives it."""
    assert _gpu_bench().dense_bf16_peak(name) == peak


def test_the_timers_wait_for_the_gpu_they_time(monkeypatch):
    """`make_sync` waits for the device the benchmark runs on: on `cuda:1`, a bare synchronize waited
    for cuda:0, and the timings measured only the launches."""
    import torch

    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.common import make_sync
    finally:
        sys.path.remove(str(ROOT))
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    make_sync(torch.device("cuda:1"))()
    assert waited == [torch.device("cuda:1")]


def test_gpu_script_parses():
    result = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu.sh")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _run_bench(out: Path, *only: str) -> dict:
    argv = [sys.executable, "-m", "benchmarks.gpu_bench", "--cpu", "--tiny", "--threads", "1", "--out-dir", str(out)]
    if only:
        argv += ["--only", *only]
    result = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "gpu_bench.json").read_text())
    assert json.loads(result.stdout) == report  # the JSON goes to stdout as well
    return report


def _check_training_row(row: dict, out: Path) -> None:
    assert row["tokens_per_s"] > 0 and row["final_loss"] > 0 and row["compile_s"] >= 0
    steps = row["step_ms_all"]  # each timed step's own time, and their median and range
    assert len(steps) == _gpu_bench().TINY.steps and min(steps) > 0
    assert row["step_ms_min"] <= row["step_ms_median"] <= row["step_ms_max"] and row["step_ms_mean"] > 0
    assert row["mfu"] is None and row["largest_micro_batch_estimate"] is None  # the CPU: no peak, no device memory
    profile = row["profile"]
    assert profile["steps"] == _gpu_bench().TINY.profile_steps and profile["step_ms"] > 0
    assert sum(profile["share_of_kernel_time"].values()) == pytest.approx(1, abs=1e-3)
    assert profile["share_of_kernel_time"].get("matmul", 0) > 0 and 0 <= profile["idle_share_of_window"] < 1
    trace = json.loads(Path(profile["trace"]).read_text())  # a Chrome trace (Perfetto, TensorBoard)
    assert Path(profile["trace"]).parent == out / "traces" and trace["traceEvents"]


def test_the_cpu_fallback_measures_gpt_end_to_end(tmp_path):
    """gpt's rows: training with its profile and trace, decode at both batch sizes after a warm-up,
    Hugging Face's generate with a static cache on the exported model beside latentloop's decode of
    the same weights (greedy: the same tokens in fp32)."""
    gpu_bench = _gpu_bench()
    report = _run_bench(tmp_path, "gpt")
    assert report["device"] == "cpu" and report["compiled"] is False and report["gpt_mfu_meets_target"] is None
    (train,) = report["training"]
    _check_training_row(train, tmp_path)
    batches = gpu_bench.TINY.decode_batches
    assert [(r["case"], r["batch"]) for r in report["decode"]] == [("gpt", b) for b in batches]
    assert all(r["decode_tokens_per_s_median"] > 0 and r["new_tokens"] == gpu_bench.TINY.new_tokens
               and r["warmup_s"] > 0 and len(r["decode_tokens_per_s_all"]) == gpu_bench.DECODE_RUNS
               for r in report["decode"])
    assert report["module"] == "benchmarks.gpu_bench" and report["args"]["only"] == ["gpt"]
    assert report["partial"] is False and report["commit"]  # which code gave the numbers
    assert [r["batch"] for r in report["hf"]] == list(batches)
    for row in report["hf"]:
        assert row["decode_tokens_per_s"] > 0 and row["latentloop_same_weights"]["decode_tokens_per_s"] > 0
        assert row["greedy_tokens_agree"] == 1.0
    assert (tmp_path / "hf" / "config.json").exists()  # the plain export transformers loaded
    assert report["fill"] == [{"case": "gpt filled", "skipped": "no estimate (the CPU, or gpt's row failed)"}]
    (loop,) = [row for row in report["checks"] if row["case"] == "a loop of generations (gpt)"]
    assert loop["generations"] == gpu_bench.LOOP_GENERATIONS and loop["first_s_median"] > 0 < loop["last_s_median"]
    # the CPU lends no tensors (no CUDA graphs to keep addresses for) and records none
    assert loop["cache_addresses_lent"] == 0 and loop["cuda_graphs_recorded_during_loop"] is None


@pytest.mark.slow
def test_the_cpu_fallback_runs_every_architecture(tmp_path):
    from latentloop.archs import ARCHS

    report = _run_bench(tmp_path)
    training = {row["case"]: row for row in report["training"]}
    assert list(training) == list(ARCHS)
    for row in training.values():
        _check_training_row(row, tmp_path)
    flops = {name: row["flops_per_token"] for name, row in training.items()}
    assert 1.8 * flops["gpt"] < flops["lrt"] < 2.6 * flops["gpt"]  # the structural count sees lrt's second pass
    assert training["fbt"]["plan"]["passes"] >= 2  # one kind of forward per case: the objective's common K
    decode = {(row["case"], row["batch"]) for row in report["decode"]}
    assert decode == {(name, b) for name in ARCHS for b in _gpu_bench().TINY.decode_batches}
    # the checks: flex attention against the dense mask, and a loop of generations (added 12-06; this line
    # unpacked one check and failed since)
    assert not [check for check in report["checks"] if "error" in check], report["checks"]
    (flex,) = [check for check in report["checks"] if "flex_masks_built" in check]
    assert flex["flex_masks_built"] > 0 and flex["subset_logits_max_abs_diff"] < 1e-5
    (loop,) = [check for check in report["checks"] if check.get("case") == "a loop of generations (gpt)"]
    assert loop["generations"] > 1 and loop["first_s_median"] > 0 and loop["last_s_median"] > 0


@pytest.mark.slow
def test_gpu_sh_runs_end_to_end_on_the_cpu(tmp_path):
    """The whole instrument at the tiny shape: the benchmark, then fsdp2 (lrt, compiled blocks,
    activation checkpointing), generate from its checkpoint, and ddp (gpt, compiled, --profile),
    each under torchrun with one process; one JSON report within the budget."""
    env = {**_env(), "GPU_SH_CPU": "1", "TOTAL_S": str(SCRIPT_TIMEOUT_S), "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), str(tmp_path)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S + 60)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["exit_codes"] == {"gpu_bench": 0, "fsdp2_train": 0, "generate": 0, "ddp_train": 0}
    assert report["within_budget"] and report["gpu_bench"]["training"]
    assert report["fsdp2_train"]["strategy"] == "fsdp2" and "model.safetensors" in report["fsdp2_checkpoint_files"]
    assert report["generate_from_fsdp2_run"]["new_tokens"] == 16
    assert report["ddp_train"]["strategy"] == "ddp" and report["ddp_profile"]["steps"] == 3
    assert list((tmp_path / "ddp-run" / "profile").glob("*.pt.trace.json"))


def test_decode_rows_are_timed_after_a_warm_up_of_the_same_lengths(monkeypatch):
    """The decode rows exclude compilation: before the clock, one generation of the same batch, prompt
    and length through the same path (compiled or not), which compiles and captures whatever the
    timed runs take (an H200 run on 12-04 timed a compile inside the stream: 15 tokens/s at batch 1)."""
    import torch

    import latentloop as ll

    gpu_bench = _gpu_bench()
    calls = []
    for name in ("generate", "stream"):
        real = getattr(ll, name)
        monkeypatch.setattr(ll, name, lambda *a, _real=real, _name=name, **k: calls.append(
            (_name, len(a[1]), a[2], k.get("compile"))) or _real(*a, **k))
    rows = gpu_bench.bench_decode("gpt", "gpt", {}, gpu_bench.TINY, torch.device("cpu"), compile_=False)
    assert len(rows) == len(gpu_bench.TINY.decode_batches) and all(r["decode_tokens_per_s_median"] > 0 for r in rows)
    new = gpu_bench.TINY.new_tokens
    expected = []
    for batch in gpu_bench.TINY.decode_batches:
        expected += [("generate", batch, new, False), *[("stream", batch, new, False)] * gpu_bench.DECODE_RUNS]
    assert calls == expected


def test_decode_rows_report_the_median_and_range_of_their_timed_runs(monkeypatch):
    """Each decode row's figure is the median of its timed runs, with their range and every run
    (it was the fastest of two, under the plain name)."""
    import torch

    gpu_bench = _gpu_bench()
    rates = iter([30.0, 10.0, 20.0, 5.0, 7.0, 6.0, 1.0, 2.0, 3.0])
    monkeypatch.setattr(gpu_bench, "_timed_stream", lambda *args: {
        "new_tokens": gpu_bench.TINY.new_tokens, "prefill_s": 0.5, "decode_tokens_per_s": next(rates)})
    monkeypatch.setattr(gpu_bench, "DECODE_RUNS", 3, raising=False)  # three runs: a median of its own
    rows = gpu_bench.bench_decode("gpt", "gpt", {}, gpu_bench.TINY, torch.device("cpu"), compile_=False)
    assert [(r["decode_tokens_per_s_median"], r["decode_tokens_per_s_min"], r["decode_tokens_per_s_max"])
            for r in rows] == [(20.0, 10.0, 30.0), (6.0, 5.0, 7.0)]
    assert rows[0]["decode_tokens_per_s_all"] == [30.0, 10.0, 20.0] and "decode_tokens_per_s" not in rows[0]


def test_training_rows_time_every_step(monkeypatch, tmp_path):
    """A training row keeps each timed step's milliseconds, their median and range, beside the
    tokens/s of the whole timed window."""
    import statistics

    import torch

    gpu_bench = _gpu_bench()
    monkeypatch.setattr(gpu_bench, "_profile", lambda *args: {})  # the profile and its trace: another test's
    row = gpu_bench.bench_training("gpt", "gpt", {}, gpu_bench.TINY, torch.device("cpu"), False, None, tmp_path)
    steps = row["step_ms_all"]
    assert len(steps) == gpu_bench.TINY.steps and min(steps) > 0
    assert (row["step_ms_min"], row["step_ms_max"]) == (min(steps), max(steps))
    assert row["step_ms_median"] == pytest.approx(statistics.median(steps))
    assert row["step_ms_mean"] >= min(steps) * 0.99 and row["tokens_per_s"] > 0


def test_each_finished_case_is_saved_before_the_next_starts(monkeypatch, tmp_path):
    """`gpu.sh` kills the benchmark at its time limit: the report, saved after every case (marked
    partial by `main`), keeps the cases that finished; it was written only at the very end."""
    gpu_bench = _gpu_bench()
    for name in ("bench_training", "bench_hf", "bench_decode", "check_flex", "check_generation_loop", "bench_fill"):
        monkeypatch.setattr(gpu_bench, name, lambda *args, name=name: {"case": name})
    saved: list[dict] = []
    report = gpu_bench.run(gpu_bench.parse_args(["--cpu", "--tiny", "--out-dir", str(tmp_path)]),
                           save=lambda partial: saved.append(json.loads(json.dumps(partial))))
    done = [sum(len(snapshot[k]) for k in ("training", "fill", "decode", "hf", "checks")) for snapshot in saved]
    assert done == list(range(1, len(saved) + 1)) and len(saved) == done[-1] > 5  # one case more each time
    assert saved[-1]["training"] == report["training"]
