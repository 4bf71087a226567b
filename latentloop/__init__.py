"""latentloop: language models whose transformers carry latent state forward.

    import latentloop as ll
    model = ll.build("gpt", preset="test", n_layer=2)
    model, tokenizer = ll.load("runs/NAME")
    ids = ll.generate(model, prompt_ids, max_new_tokens=16, temperature=0.0)
    for step in ll.stream(model, prompt_ids, 16):   # one DecodeStep per new token; break to stop
        ...
"""

from .api import build, generate, load, load_run, quantize_int8, stream, teacher_forced_logits
from .config import PRESETS, DataConfig, ModelConfig, RunConfig, TrainConfig, model_config
from .errors import CheckpointError, ConfigError, DataError, LatentloopError, SandboxUnavailable

__version__ = "0.1.0"

__all__ = ["PRESETS", "CheckpointError", "ConfigError", "DataConfig", "DataError", "LatentloopError", "ModelConfig",
           "RunConfig", "SandboxUnavailable", "TrainConfig", "build", "generate", "load", "load_run",
           "model_config", "quantize_int8", "stream", "teacher_forced_logits"]
