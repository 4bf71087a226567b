"""`latentloop.runs.save_run`: a loadable run folder from any model, never written over a run
that is there already."""

import pytest

import latentloop as ll
from latentloop.data import ByteTokenizer
from latentloop.errors import OutputError
from latentloop.runs import load_run, save_run


@pytest.mark.parametrize("held", ["config.json", "checkpoints"])
def test_save_run_refuses_a_folder_that_holds_a_run(held, tmp_path):
    """Saved over a trained run, step 0 sorted oldest and the rotation deleted it (and config.json
    was replaced): the folder is refused in one line and the run in it is left as it was."""
    run = tmp_path / "run"
    first = save_run(ll.build("gpt", preset="test"), ByteTokenizer(), run)
    config = (run / "config.json").read_bytes()
    if held == "checkpoints":  # a folder of checkpoints whose config.json is gone still holds a run
        (run / "config.json").unlink()
    with pytest.raises(OutputError, match=f"{run} holds a run already") as caught:
        save_run(ll.build("gpt", preset="test", n_layer=1), ByteTokenizer(), run)
    assert len(str(caught.value).splitlines()) == 1
    assert [p.name for p in (run / "checkpoints").iterdir()] == [first.name]
    if held == "config.json":
        assert (run / "config.json").read_bytes() == config
        assert load_run(run, accelerate=False)[3] == first
