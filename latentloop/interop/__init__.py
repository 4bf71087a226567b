"""Hugging Face interop: import Llama-family checkpoints, upcycle a `gpt` run into fbt / lrt /
rgpt, export runs back to Hugging Face folders.

    import_hf("path/or/org-name", "runs/llama")                   # -> a gpt run folder
    upcycle_config("runs/llama", "lrt"); initialise_from(model, "runs/llama")
    export_hf("runs/x", "hf/x")                                   # LlamaForCausalLM, Qwen2ForCausalLM or
                                                                  # latentloop's own modeling code

Imports models, config, data (tokenizers), checkpoint and the arch registry; never train or the CLI.
"""

from .hf_export import export_hf
from .hf_import import import_hf
from .upcycle import initialise_from, upcycle_config, upcycle_fields

__all__ = ["export_hf", "import_hf", "initialise_from", "upcycle_config", "upcycle_fields"]
