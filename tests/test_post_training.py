"""experiments/post_training.py evaluates SFT on problems its SFT data never holds."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from latentloop.data.chat import iter_conversations
from latentloop.data.tasks import parse_task_spec

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "post_training.py"


def _script():
    spec = importlib.util.spec_from_file_location("post_training", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_post_training_evaluation_prompts_are_not_in_its_sft_data():
    script = _script()
    limit = 100  # the script's default --limit
    assert script.evaluated_in_sft(limit) == (0, limit)
    # counted here too, by prompt, from the specs it trains and evaluates on (the base's plain-format
    # evaluation and the SFT model's chat one read the same test items)
    sft = {messages[0]["content"] for _, messages in iter_conversations(f"chat:task:{script.TASK}")}
    parsed = parse_task_spec(script.EVAL_TASK)
    prompts = [example.prompt for example in parsed.task.examples("test", limit, parsed.seed)]
    assert len(sft) > 1_000 and len(prompts) == limit and not sft & set(prompts)


def test_post_training_refuses_to_resume_numbers_from_before_the_split(tmp_path):
    script = _script()
    (tmp_path / "post_training.json").write_text('{"task": {"gpt/0": {}}}')  # an old report: no tasks_version
    with pytest.raises(SystemExit, match="not held out"):
        script.run(SimpleNamespace(out=str(tmp_path)))


def test_post_training_report_pairs_each_regime_by_seed_beside_the_baselines():
    script = _script()

    def row(accuracy, trace):
        return {"accuracy": accuracy, "n": 10, "mean_trace_tokens": trace, "mean_reasoning_tokens": trace - 1,
                "by_length": {"1": {"n": 4, "accuracy": accuracy, "chance": 0.05, "copy": 0.0, "majority": 0.25},
                              "2": {"n": 6, "accuracy": accuracy, "chance": 0.01, "copy": None, "majority": 0.02}}}

    report = {"task": {}}
    for seed, shift in enumerate((0.0, 0.01, 0.02)):
        report["task"][f"gpt/{seed}"] = {"before": {"plain": row(0.0, 9)}, "after": {"plain": row(0.10 + shift, 9)}}
        report["task"][f"fbt/{seed}"] = {"after": {"standard": row(0.30 + 2 * shift, 9), "soft": row(0.30, 7 - seed),
                                                   "fused": row(0.0, 9 + seed)}}
    text = script.summarise(report)
    # fbt standard - gpt per seed: 0.20, 0.21, 0.22 -> mean 0.21, sd 0.01, t(0.975, 2) = 4.303
    assert "| accuracy after SFT, fbt standard - gpt | 0.210 [0.185, 0.235] | better |" in text
    assert "| trace tokens after SFT, fbt soft - fbt standard | -3.000 [-5.484, -0.516] | shorter |" in text
    assert "| trace tokens after SFT, fbt fused - fbt standard | 1.000 [-1.484, 3.484] | undecided |" in text
    assert "| chance | 0.05 | 0.01 |" in text and "| copy | 0.00 | n/a |" in text
    assert "| baseline | 1 digits | 2 digits |" in text and "| test items (n) | 4 | 6 |" in text
    assert "| gpt | 3 | 0.00 [0.00, 0.00] | 0.11 [0.09, 0.13] |" in text
    assert "rgpt" not in text  # no runs, no rows or comparisons
