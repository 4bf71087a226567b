"""Every printed loss says what it was measured on: train's final validation figure (the first
train.eval_batches batches of the val split) and eval's (its tokens, split, source and batches),
and the two agree when they cover the same batches; eval shows its progress unless told not to."""

from __future__ import annotations

import json

from latentloop.cli import main


def test_train_and_eval_name_what_their_losses_cover_and_agree_on_the_same_batches(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--arch", "gpt", "--preset", "test", "--data", f"text:{corpus}", "--steps", "1",
                 "--batch-size", "2", "--out", str(run), "--no-progress", "--set", "eval_batches=3"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "tokens: the first 3 batches of the val split; `latentloop eval` scores all of it)" in line, line
    train_loss = float(line.split("val loss ")[1].split(",")[0])
    assert main(["eval", str(run), "--json", "--batches", "3", "--batch-size", "2", "--data", f"text:{corpus}"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["measured_on"] == (f"{metrics['tokens']:,} tokens of the val split of text:{corpus} (the first 3 "
                                      f"batches); train's val figure scores the first 3 batches of 2 sequences")
    assert f"(on {metrics['tokens']:,} tokens:" in line  # the same batches: the same count ...
    assert abs(metrics["loss"] - train_loss) < 1e-4  # ... and the same loss (train prints 4 decimals)
    assert main(["eval", str(run), "--data", f"text:{corpus}"]) == 0
    captured = capsys.readouterr()
    assert "measured_on: " in captured.out and "(every batch)" in captured.out
    assert "eval batches" in captured.err and "eval batches" not in captured.out  # a progress bar, on stderr
    assert main(["eval", str(run), "--data", f"text:{corpus}", "--no-progress"]) == 0
    assert "eval batches" not in capsys.readouterr().err
