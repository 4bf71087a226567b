"""`latentloop export --format hf` writes a model card (README.md): the architecture and its own
options (from the registry), the training data and tokens (the checkpoint's state.json), the final
metrics (the run's metrics.jsonl) and how to load the folder (trust_remote_code where it ships code)."""

from __future__ import annotations

import json

import pytest

from latentloop.archs import ARCHS
from latentloop.cli import main
from latentloop.config import ModelConfig
from latentloop.interop.hf_export import _shown_source

CARD_ARCHS = [name for name in ARCHS if name != "gpt"][:1] + ["gpt"]  # a variant (remote code) and the baseline


@pytest.mark.parametrize("arch", CARD_ARCHS)
def test_export_writes_a_model_card_of_the_run(arch, tiny_run, tmp_path, capsys):
    run = tiny_run(arch)
    capsys.readouterr()  # what training the shared run printed
    out = tmp_path / "hf"
    assert main(["export", str(run), "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    card = (out / "README.md").read_text()
    assert summary["model_card"] == str(out / "README.md")
    assert card.startswith("---\nlibrary_name: transformers\n") and f"tags: [latentloop, {arch}]" in card

    config = json.loads((run / "config.json").read_text())
    checkpoint = sorted((run / "checkpoints").iterdir())[-1]
    state = json.loads((checkpoint / "state.json").read_text())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    final = [row for row in rows if "val_loss" in row][-1]

    assert f"**{arch}** model: {ARCHS[arch].summary.rstrip('.')}" in card
    for name in config["model"]:  # the arch's own fields
        if name not in ModelConfig.__dataclass_fields__ and name != "arch":
            assert f"- {name}: " in card, name
    for option in ARCHS[arch].options:
        assert f"`{option.name}` (default {option.default!r})" in card
    assert f"- data: `{_shown_source(config['data']['source'])}`" in card  # the files, not the folders
    assert "/" not in _shown_source(config["data"]["source"]).removeprefix("text:")
    assert f"steps: {state['step']}, tokens: {state['tokens_seen']:,}" in card
    assert f"validation loss at step {final['step']}: {final['val_loss']:.4g}" in card
    assert f"validation bpb at step {final['step']}: {final['val_bpb']:.4g}" in card
    remote = "trust_remote_code" in summary["format"]
    assert ('from_pretrained("PATH/TO/THIS/FOLDER", trust_remote_code=True)' in card) == remote
    # the tokenizer too: AutoTokenizer reads config.json, whose auto_map names remote code
    assert ('AutoTokenizer.from_pretrained("PATH/TO/THIS/FOLDER", trust_remote_code=True)' in card) == remote
    # the remote code loads on transformers 5 only (the plain folders on 4.x too): the card and config say so
    assert ("transformers>=5" in card) == remote
    hf_config = json.loads((out / "config.json").read_text())
    assert (hf_config.get("transformers_version") == "5.0.0") == remote


def test_the_card_skips_damaged_metrics_rows(tiny_run_copy, tmp_path, capsys):
    """A row whose step is not an int (null: TypeError comparing it with the checkpoint's step;
    missing: KeyError naming it) or that is not UTF-8 (read with replacement characters and kept)
    is a damaged row: left out of the card, as the resume leaves it out of the log."""
    run = tiny_run_copy("gpt")
    step = json.loads((sorted((run / "checkpoints").iterdir())[-1] / "state.json").read_text())["step"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    final = [row for row in rows if "val_loss" in row][-1]
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": null, "val_loss": 71.5}\n{"loss": 81.5}\n{"step": "2", "loss": 81.5}\n')
        f.write(b'{"step": %d, "val_loss": 91.5, "note": "\xed\xa0\x80"}\n' % step)
    capsys.readouterr()
    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 0, capsys.readouterr().err
    card = (tmp_path / "hf" / "README.md").read_text()
    assert f"validation loss at step {final['step']}: {final['val_loss']:.4g}" in card
    assert not any(number in card for number in ("71.5", "81.5", "91.5"))
