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
