"""CLI: the happy path end to end, and one-line errors with exit code 2 for bad input."""

import json
import subprocess
import sys

import pytest
from conftest import TINY_RUN_CONTEXT

from latentloop.cli import main


def test_train_eval_generate(tiny_run, tiny_corpus, capsys):
    run_dir = tiny_run("gpt")
    capsys.readouterr()
    assert main(["eval", str(run_dir), "--json", "--batches", "2", "--data", f"text:{tiny_corpus}"]) == 0
    printed = capsys.readouterr()
    metrics = json.loads(printed.out)  # stdout: one JSON document
    assert set(metrics) >= {"loss", "ppl", "bpb"} and metrics["bpb"] > 0
    assert "eval batches" in printed.err  # the bar, on stderr: a whole split takes minutes (fbt: three times)
    assert main(["generate", str(run_dir), "--prompt", "hello", "--max-new-tokens", "5", "--temperature", "0",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["new_tokens"] == 5 and len(out["ids"]) == 5
    assert main(["generate", str(run_dir), "--prompt", "hé", "--max-new-tokens", "3", "--seed", "1"]) == 0
    assert capsys.readouterr().out.startswith("hé")


def test_eval_of_a_model_whose_logits_overflow_is_one_line_and_exit_2(tiny_run_copy, tiny_corpus, capsys):
    """Finite weights whose logits overflow (an output head at 3e38) give a loss of nan: eval printed
    "loss: nan  bpb: nan" as a result and exited 0."""
    import torch

    import latentloop as ll
    from latentloop.checkpoint import save_weights_checkpoint

    run = tiny_run_copy("gpt")
    model, _ = ll.load(run)
    head = model.lm_head.weight if model.lm_head is not None else model.wte.weight
    with torch.no_grad():
        head.fill_(3e38)
    save_weights_checkpoint(run, 10_000, model, {"step": 10_000})  # the latest: eval's
    capsys.readouterr()
    assert main(["eval", str(run), "--batches", "1", "--data", f"text:{tiny_corpus}", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is nan: its logits are not finite" in err[0] and "step_00010000" in err[0], err


def test_resume_extends_a_run(tiny_run_copy, capsys):
    run = tiny_run_copy("gpt")
    capsys.readouterr()  # what building the shared run printed, when this test is the first to ask for it
    assert main(["train", "--out", str(run), "--resume", "--steps", "6", "--no-progress", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 6


def test_resume_refuses_a_preset_it_would_ignore(tiny_run_copy, capsys):
    """`--resume --preset tiny` on a `test` run trained on at the saved shape, exit 0: the saved fields
    override a preset's (12-07 review)."""
    run = tiny_run_copy("gpt")
    metrics = (run / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--steps", "6", "--preset", "tiny", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot resume with --preset tiny: its n_embd is 128, and the run holds 64" in err[0]
    assert (run / "metrics.jsonl").read_text() == metrics
    # the preset it was made with is what the docs' resume gives ("the same command plus --resume")
    assert main(["train", "--out", str(run), "--resume", "--steps", "6", "--preset", "test", "--set",
                 f"sequence_len={TINY_RUN_CONTEXT}", "--no-progress"]) == 0


def test_resuming_a_finished_run_says_so_and_its_json_is_strict(tiny_run_copy, capsys):
    """It printed `"train_loss": NaN` (not JSON) and "trained ... for N steps" for a run that trained nothing."""
    run = tiny_run_copy("gpt")
    capsys.readouterr()
    step = json.loads((sorted((run / "checkpoints").iterdir())[-1] / "state.json").read_text())["step"]
    assert main(["train", "--out", str(run), "--resume", "--steps", str(step), "--no-progress", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out, parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))
    assert summary["nothing_to_train"] and summary["step"] == step
    assert main(["train", "--out", str(run), "--resume", "--steps", str(step), "--no-progress"]) == 0
    assert f"already at step {step} of {step}: nothing to train" in capsys.readouterr().out


@pytest.mark.parametrize("argv, words", [
    (["train", "--arch", "nope", "--out", "{tmp}/x"], "unknown arch"),
    (["train", "--preset", "huge", "--out", "{tmp}/x"], "unknown preset"),
    (["train", "--set", "n_head=3", "--out", "{tmp}/x"], "n_embd"),
    (["train", "--data", "ftp:thing", "--out", "{tmp}/x"], "unknown data source"),
    (["train", "--data", "text:{tmp}/nothing", "--out", "{tmp}/x"], "nothing"),
    (["train", "--steps", "0", "--out", "{tmp}/x"], "positive integer"),
    (["train", "--config", "{tmp}/missing.yaml", "--out", "{tmp}/x"], "not found"),
    (["eval", "{tmp}/no-run"], "no run"),
    (["generate", "{run}", "--prompt", "{long}"], "context"),
    (["generate", "{run}", "--prompt", "x", "--regime", "soft"], "regime"),
    (["generate", "{run}", "--prompt", "x", "--top-p", "1.5"], "top-p"),
    (["train", "--out", "{run}", "--no-progress"], "already holds a run"),
])
def test_bad_input_is_one_line_exit_2(argv, words, tiny_run, tmp_path, capsys):
    run = tiny_run("gpt")
    capsys.readouterr()  # what training the shared run printed, when this test is the first to ask for it
    argv = [a.format(tmp=tmp_path, run=run, long="y" * 200) for a in argv]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse rejects flags before main's own handler runs
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and words in err, err
    assert not (tmp_path / "x").exists()


def test_entry_point_reports_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "latentloop.cli", "eval", str(tmp_path / "none")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1


def test_bpe_tokenizer_train_then_train_a_model(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the latent loop carries state forward; " * 300 + "naïve café " * 50)
    assert main(["tokenizer", "train", "--data", f"text:{corpus}", "--vocab-size", "300",
                 "--out", str(tmp_path / "tok")]) == 0
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    run = tmp_path / "run"
    assert main(["train", "--preset", "test", "--data", f"text:{corpus}", "--tokenizer", str(tmp_path / "tok"),
                 "--steps", "2", "--out", str(run), "--set", "batch_size=2", "--set", "sequence_len=16",
                 "--no-progress"]) == 0
    from latentloop.data import load_tokenizer

    vocab = load_tokenizer(str(tmp_path / "tok")).vocab_size
    assert 259 < vocab <= 300  # a small corpus may run out of merges before 300
    assert json.loads((run / "config.json").read_text())["model"]["vocab_size"] == vocab
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "the latent", "--max-new-tokens", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["completion"] is not None
    assert main(["tokenizer", "train", "--data", f"text:{corpus}", "--vocab-size", "100",
                 "--out", str(tmp_path / "tok2")]) == 2



def test_tokenizer_train_reads_no_more_than_max_bytes_of_one_large_document(tmp_path, monkeypatch):
    """--max-bytes capped the text only between documents, and a `.txt` file is one document: a corpus
    of one big file was read whole. The document that reaches the cap is cut there, on a character."""
    from latentloop.data import BPETokenizer

    text = "naïve café " * 2000  # 13 UTF-8 bytes a piece, 'ï' its bytes 2 and 3: one document of 26 kB
    cap = 13 * 77 + 3  # inside an 'ï': the cut keeps the whole characters before it
    seen: list[str] = []
    learn = BPETokenizer.train.__func__

    def recording(cls, texts, vocab_size):
        texts = list(texts)
        seen.extend(texts)
        return learn(cls, texts, vocab_size)
    monkeypatch.setattr(BPETokenizer, "train", classmethod(recording))
    corpus = tmp_path / "one.txt"
    corpus.write_text(text)
    assert main(["tokenizer", "train", "--data", f"text:{corpus}", "--vocab-size", "270", "--max-bytes", str(cap),
                 "--out", str(tmp_path / "tok")]) == 0
    assert seen == [text.encode()[:cap - 1].decode()]

def test_loading_a_run_of_any_arch_imports_no_compiler(tiny_run):
    """A command that loads a run (generate, eval, serve, ...) checks its weights' shapes against a
    model built on the meta device first; meta-device arithmetic and random initialisers run as
    Python decompositions that import torch._dynamo (1.5-3.5 s of a core before the command goes
    on). The load must import none of it and leave torch's initialisers as they were (the shape
    check itself: test_robustness's checkpoint cases)."""
    from pathlib import Path

    from latentloop.archs import ARCHS

    runs = [str(tiny_run(arch)) for arch in ARCHS]
    script = ("import sys, torch\n"
              "from latentloop.runs import load_run\n"
              "normal = torch.nn.init.normal_\n"
              "for run in sys.argv[1:]:\n"
              "    load_run(run)\n"
              "assert torch.nn.init.normal_ is normal\n"
              "print(sorted(name for name in sys.modules if name.startswith('torch._dynamo')))\n")
    repo = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", script, *runs], capture_output=True, text=True, cwd=repo,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_train_help_names_the_archs_a_gpt_run_upcycles_into(capsys):
    """`--init-from`'s help lists the archs whose spec says they upcycle a gpt run (it listed every
    arch but gpt, mor included, which refuses)."""
    import re

    from latentloop.archs import ARCHS

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help's lines
    named = re.search(r"--arch ([\w /]+?) upcycles it", text).group(1).split(" / ")
    assert named == [name for name, spec in ARCHS.items() if spec.upcycles] and "mor" not in named


class _FullOutput:
    """An stdout that takes nothing (`> /dev/full`)."""

    def write(self, text):
        raise OSError(28, "No space left on device")

    def flush(self):
        raise OSError(28, "No space left on device")


def test_an_output_that_takes_nothing_is_one_line_and_a_closed_one_discards(tiny_run, capsys, monkeypatch):
    """`generate ... > /dev/full` ended in an OSError's traceback, and with stdout closed (`>&-`, which
    leaves sys.stdout None) in an AttributeError's."""
    run = str(tiny_run("gpt"))
    capsys.readouterr()
    argv = ["generate", run, "--prompt", "hi", "--max-new-tokens", "3", "--temperature", "0", "--decode", "eager"]
    monkeypatch.setattr(sys, "stdout", _FullOutput())
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == "latentloop: error: cannot write to standard output: No space left on device"
    monkeypatch.setattr(sys, "stdout", None)
    assert main(argv) == 0
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="no /dev/full here")
def test_a_full_stdout_is_one_line_when_the_output_was_buffered_too(tmp_path):
    """Outside a terminal Python buffers stdout: a command's output met the full device only at the
    interpreter's last flush, after the command ("Exception ignored ... OSError", exit 120)."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "latentloop", "plan", "--arch", "gpt", "--preset", "test",
                               "--tokens", "1M", "--json"], stdout=full, stderr=subprocess.PIPE, text=True, env=env,
                              cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == "latentloop: error: cannot write to standard output: No space left on device"
