"""Longer checks, deselected by default (`make test-all` runs them)."""

import json

import pytest
import torch

from latentloop.archs import ARCHS
from latentloop.config import DataConfig, RunConfig, TrainConfig, model_config
from latentloop.train import fit, setup

# fp32 through inductor: fused and reordered reductions agree to rounding, and three optimizer steps
# carry that rounding into the weights the later losses see
COMPILED_FIT_TOL = 1e-4


def _losses(arch, corpus, run, compile: bool) -> tuple[list[float], float]:
    """(the training loss of every step, the final validation loss) of a 3-step run."""
    config = RunConfig(model=model_config(arch, "test", sequence_len=32),
                       train=TrainConfig(steps=3, batch_size=2, eval_batches=1, compile=compile, warmup_steps=1,
                                         log_every=1, dtype="float32"),
                       data=DataConfig(source=f"text:{corpus}"))
    summary = fit(setup(config, run, progress=False), progress=False)
    assert summary["step"] == 3
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row["loss"] for row in rows if "loss" in row], summary["val_loss"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_fit_with_torch_compile_trains_as_eager(corpus, tmp_path, arch):
    """`fit` with train.compile: every logged training loss and the final validation loss equal the
    eager run's (the compiled step alone: test_compiled_training.py)."""
    # inductor draws random numbers its own way unless told to call torch's RNG as eager does
    with torch._inductor.config.patch(fallback_random=True):
        eager = _losses(arch, corpus, tmp_path / "eager", compile=False)
        compiled = _losses(arch, corpus, tmp_path / "compiled", compile=True)
    assert len(eager[0]) == 3
    torch.testing.assert_close(torch.tensor(compiled[0]), torch.tensor(eager[0]), rtol=0, atol=COMPILED_FIT_TOL)
    torch.testing.assert_close(compiled[1], eager[1], rtol=0, atol=COMPILED_FIT_TOL)
