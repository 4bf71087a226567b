"""Longer checks, deselected by default (`make test-all` runs them)."""

import pytest
import torch

from latentloop.config import DataConfig, RunConfig, TrainConfig, model_config
from latentloop.train import fit, setup


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt", "fbt"])
def test_training_with_torch_compile(corpus, tmp_path, arch):
    config = RunConfig(model=model_config(arch, "test", sequence_len=32),
                       train=TrainConfig(steps=3, batch_size=2, eval_batches=1, compile=True, warmup_steps=1),
                       data=DataConfig(source=f"text:{corpus}"))
    state = setup(config, tmp_path / "run", progress=False)
    summary = fit(state, progress=False)
    assert summary["step"] == 3 and torch.isfinite(torch.tensor(summary["val_loss"]))
