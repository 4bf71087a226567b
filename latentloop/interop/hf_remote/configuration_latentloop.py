"""Configuration of latentloop models exported for Hugging Face transformers (trust_remote_code).

Self-contained: it needs transformers, never latentloop. `latentloop` holds the package's model
config as written by latentloop (arch and every backbone / variant field), `decoding` the default
decoding options of the arch (its declared options' defaults: fbt regime, passes; rgpt steps, ...),
which `generate(...)` and `forward(...)` keyword arguments override. The usual Hugging Face names
(hidden_size, ...) are mirrored for tools that read them.
"""

from transformers import PretrainedConfig

# Not used here: importing the generated module ties this file's cached copy to the architecture's
# files. transformers caches a remote module (and the files it imports) in a folder named by a hash
# of exactly those files, and reuses modules already imported from that folder; without this line
# two exports of different architectures would share one folder and the second would run the
# first one's `latentloop_arch`.
from .latentloop_arch import CONFIG_CLASS  # noqa: F401

# Hugging Face attribute -> latentloop config field, mirrored for generic tools
MIRRORED_FIELDS = (("vocab_size", "vocab_size"), ("hidden_size", "n_embd"), ("num_hidden_layers", "n_layer"),
                   ("num_attention_heads", "n_head"), ("num_key_value_heads", "n_kv_head"),
                   ("max_position_embeddings", "sequence_len"))


class LatentloopConfig(PretrainedConfig):
    model_type = "latentloop"

    def __init__(self, latentloop=None, decoding=None, **kwargs):
        self.latentloop = dict(latentloop or {})
        self.decoding = dict(decoding or {})
        for hf_name, field in MIRRORED_FIELDS:
            if field in self.latentloop:
                kwargs.setdefault(hf_name, self.latentloop[field])
        # latentloop ties by using the embedding as the head (there is no lm_head to tie)
        kwargs["tie_word_embeddings"] = False
        super().__init__(**kwargs)
