"""Hugging Face interop: import (parity with transformers' own Llama / Qwen2 classes), export (plain
and trust_remote_code), upcycling into fbt / lrt / rgpt, and one-line errors. Offline: every
model is a tiny random one written here with `save_pretrained`."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from conftest import HF_RANDOM_SCALE, perturb_hf_weights

import latentloop as ll
from latentloop.archs import ARCHS
from latentloop.checkpoint import save_weights_checkpoint
from latentloop.cli import main
from latentloop.config import RunConfig, model_config
from latentloop.data import BPETokenizer, ByteTokenizer, HFTokenizer, load_tokenizer, write_hf_tokenizer
from latentloop.interop import export_hf, import_hf, initialise_from, upcycle_config
from latentloop.interop.hf_export import REMOTE_DIR, REMOTE_FILES, package_sources
from latentloop.runs import save_run

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

IMPORT_TOL = 1e-4  # vs transformers (fp32): the same arithmetic in a different order
EXACT_TOL = 1e-5  # latentloop vs its own exported code or upcycled model: the same operations
HF_VOCAB = 320  # model vocabulary; the tokenizer below has fewer ids (models pad their vocab)


def _hf_tokenizer(folder, bos: str | None = "<s>"):
    """A small byte-level BPE (as Llama 3 / Qwen2 use) saved as tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the latent loop carries state forward. " * 40], trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    settings = {"eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}
    if bos:
        settings["bos_token"] = bos
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))


def _hf_model(kind: str, folder, shard: bool = False):
    """A tiny random transformers model of `kind`, saved with its tokenizer."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(0)
    common = dict(vocab_size=HF_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                  eos_token_id=1)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, bos_token_id=0, rope_theta=500000.0))
    elif kind == "llama3":  # Llama 3.1 rope scaling, active well inside the 64-token context
        model = LlamaForCausalLM(LlamaConfig(**common, bos_token_id=0, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}))
    elif kind == "llama-linear":  # position interpolation: every frequency divided by the factor
        model = LlamaForCausalLM(LlamaConfig(**common, bos_token_id=0, rope_parameters={
            "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}))
    elif kind == "mistral":  # its window covers the whole context: full attention
        model = MistralForCausalLM(MistralConfig(**common, bos_token_id=0, sliding_window=64))
    else:  # Qwen2: q/k/v biases, tied embeddings, no BOS token
        model = Qwen2ForCausalLM(Qwen2Config(**common, bos_token_id=None, tie_word_embeddings=True))
    perturb_hf_weights(model)
    model.save_pretrained(folder, max_shard_size="200KB" if shard else "5GB")
    _hf_tokenizer(folder, bos=None if kind == "qwen2" else "<s>")
    return model.eval()


def _run(folder, arch="gpt", tokenizer=None, perturb=True, **overrides):
    """A run folder holding a random model (config, tokenizer, one weights-only checkpoint)."""
    torch.manual_seed(1)
    config = model_config(arch, "test", **overrides)
    model = ll.build(arch, "test", **overrides)
    if perturb:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "gate_out.bias" not in name:
                    p.add_(torch.randn_like(p) * HF_RANDOM_SCALE)
    folder.mkdir(parents=True)
    RunConfig(model=config).save_json(folder / "config.json")
    (tokenizer or ByteTokenizer()).save(folder)
    save_weights_checkpoint(folder, 0, model, {"step": 0})
    return model.eval()


def _one_line_error(argv, capsys) -> str:
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    return err


LLAMA_OPTIONS = dict(learned_norms=True, qk_norm=False, embed_norm=False, mlp="swiglu", intermediate_size=96,
                     norm_eps=1e-5, n_kv_head=2)


# --------------------------------------------------------------------------------------------
# Backbone options
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", list(ARCHS))  # every registered architecture
def test_default_state_dict_keys_are_unchanged(arch):
    """Checkpoints written before the Llama options still load: with every option at its default no
    new tensor exists."""
    names = ll.build(arch, "test").state_dict()
    new = [n for n in names if re.search(r"ln_[12f]\.|c_qkv\.bias|qk_norm|embed_norm|fuse_scale", n)]
    assert not new


@pytest.mark.parametrize("field, value, words", [
    ("norm_eps", 0.0, "norm_eps"), ("intermediate_size", -1, "intermediate_size"),
    ("rope_scaling", "yarn", "rope_scaling"), ("rope_factor", 0.0, "rope_factor"),
    ("rope_low_freq_factor", 8.0, "rope_low_freq_factor"), ("rope_original_max_positions", 0, "rope_original"),
    ("learned_norms", "maybe", "learned_norms"),
])
def test_new_fields_are_validated(field, value, words):
    with pytest.raises(ll.ConfigError, match=words):
        model_config("gpt", "test", **{field: value})


# --------------------------------------------------------------------------------------------
# Import: parity with transformers
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "llama3", "llama-linear", "mistral", "qwen2"])
def test_import_matches_transformers(kind, tmp_path, capsys):
    hf = _hf_model(kind, tmp_path / "hf", shard=kind == "llama")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file() == (kind == "llama")
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    model, tokenizer = ll.load(tmp_path / "run")
    c = model.config
    assert (c.qkv_bias, c.tie_embeddings, c.rope_scaling) == {
        "llama": (False, False, "none"), "llama3": (False, False, "llama3"), "llama-linear": (False, False, "linear"),
        "mistral": (False, False, "none"), "qwen2": (True, True, "none")}[kind]
    torch.manual_seed(2)
    idx = torch.randint(0, HF_VOCAB, (2, 48))
    with torch.no_grad():
        ours, theirs = model(idx).logits, hf(idx).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=IMPORT_TOL)
    print(f"\n{kind}: max |logit difference| vs transformers {float((ours - theirs).abs().max()):.2e}")
    # greedy decoding token for token, one prompt and a left-padded batch of two
    prompts = [[5, 17, 33, 9, 120], [7, 8]]
    mine = ll.generate(model, prompts, 16, temperature=0)
    ids = torch.tensor([prompts[0], [0, 0, 0] + prompts[1]])
    mask = torch.tensor([[1] * 5, [0, 0, 0, 1, 1]])
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None,
                      pad_token_id=0)[:, 5:].tolist()
    assert mine == out and len(set(out[0])) > 1
    # the model's own tokenizer came along. Qwen2 names no BOS anywhere: latentloop separates its documents
    # with its EOS (no chat template here, so no end of turn it could be), and like every tokenizer here
    # (its tokenizer.json has no post-processor) it puts nothing before a prompt, as transformers does
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.vocab_size == HF_VOCAB
    assert (tokenizer.bos_id, tokenizer.eos_id) == ((1, 1) if kind == "qwen2" else (0, 1))
    text = "hello latent world"
    assert not tokenizer.adds_bos and tokenizer.as_prompt(tokenizer.encode(text)) == \
        transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))(text).input_ids
    reference = tokenizers.Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    assert tokenizer.encode(text) == reference.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert b"".join(tokenizer.token_to_bytes(t) for t in tokenizer.encode(text)) == text.encode()


def test_every_end_token_the_model_names_stops_generation_and_is_exported(tmp_path, capsys, monkeypatch):
    """Llama 3 instruct names several end tokens (config.json's eos_token_id list, and
    generation_config.json's): each stops a generation (the CLI passes them all to the engine), the
    run keeps them, and the export writes them back as a list."""
    from latentloop import engine

    _hf_model("llama", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config | {"eos_token_id": [1, 5]}))
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 5, 9]}))
    import_hf(tmp_path / "hf", tmp_path / "run")
    _, tokenizer = ll.load(tmp_path / "run")
    assert (tokenizer.eos_id, tokenizer.stop_ids) == (1, (1, 5, 9))
    seen = {}

    def recording_stream(model, prompt, max_new_tokens, stop_tokens=(), **kwargs):
        seen["stop"] = list(stop_tokens)
        return iter(())

    monkeypatch.setattr(engine, "stream", recording_stream)
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "run"), "--prompt", "hi", "--max-new-tokens", "2"]) == 0
    assert {1, 5, 9} <= set(seen["stop"])
    export_hf(tmp_path / "run", tmp_path / "back")  # and BOS (0), where latentloop's decoding stops too
    assert json.loads((tmp_path / "back" / "config.json").read_text())["eos_token_id"] == [1, 5, 9, 0]
    assert json.loads((tmp_path / "back" / "generation_config.json").read_text())["eos_token_id"] == [1, 5, 9, 0]


def test_an_imported_models_recommended_decoding_survives_its_export(tmp_path):
    """An instruct model's generation_config.json recommends its sampling; the import kept only its
    ids, so the exported folder had none and transformers decoded it greedily. It is kept (in the
    checkpoint's state) and written again beside the run's own ids; transformers reads it back."""
    transformers = pytest.importorskip("transformers")
    _hf_model("llama", tmp_path / "hf")
    recommended = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps(
        {**recommended, "eos_token_id": [1, 5], "transformers_version": "4.0.0"}))
    import_hf(tmp_path / "hf", tmp_path / "run")
    export_hf(tmp_path / "run", tmp_path / "back")
    written = json.loads((tmp_path / "back" / "generation_config.json").read_text())
    assert {k: written[k] for k in recommended} == recommended
    assert written["eos_token_id"] == [1, 5, 0] and "transformers_version" not in written  # the run's ids
    read = transformers.GenerationConfig.from_pretrained(str(tmp_path / "back"))
    assert (read.do_sample, read.temperature, read.top_p, read.top_k) == (True, 0.7, 0.8, 20)
    # a run trained from the import (a fine-tune of the instruct model) exports its base's decoding too
    assert main(["train", "--init-from", str(tmp_path / "run"), "--data", "task:addition:n=200", "--steps", "1",
                 "--batch-size", "2", "--set", "sequence_len=32", "--set", "eval_batches=1",
                 "--out", str(tmp_path / "tuned"), "--no-progress"]) == 0
    export_hf(tmp_path / "tuned", tmp_path / "tuned-hf")
    tuned = json.loads((tmp_path / "tuned-hf" / "generation_config.json").read_text())
    assert {k: tuned[k] for k in recommended} == recommended


def test_imported_run_evaluates_generates_and_refuses_resume(tmp_path, capsys):
    _hf_model("llama", tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "run", sequence_len=32)
    assert ll.load(tmp_path / "run")[0].config.sequence_len == 32
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "run"), "--prompt", "hello", "--max-new-tokens", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["new_tokens"] <= 4
    err = _one_line_error(["train", "--out", str(tmp_path / "run"), "--resume", "--steps", "2", "--no-progress"],
                          capsys)
    assert "--init-from" in err


def test_sentencepiece_style_tokens_and_missing_specials(tmp_path):
    """Byte-fallback tokens are their byte, ▁ is a space, specials have no bytes; a model folder
    that names no BOS/EOS token is refused."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁hello": 3, "<0x0A>": 4, "é": 5}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    t = load_tokenizer(str(tmp_path))
    assert isinstance(t, HFTokenizer) and (t.bos_id, t.eos_id, t.pad_id) == (1, 2, 2)
    assert [t.token_to_bytes(i) for i in range(6)] == [b"<unk>", b"", b"", b" hello", b"\n", "é".encode()]
    assert t.token_byte_lengths().tolist() == [5, 0, 0, 6, 1, 2]
    saved = load_tokenizer(str(t.save(tmp_path / "saved")))
    assert saved.fingerprint() == t.fingerprint() and saved.encode("é") == t.encode("é")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ll.DataError, match="neither a BOS nor an EOS"):
        HFTokenizer.from_pretrained_folder(tmp_path)


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _transformers_warnings():
    """The messages at WARNING and above that transformers' logger emits inside the block."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger, handler = logging.getLogger("transformers"), Collect(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


@pytest.mark.parametrize("options, family", [
    (dict(LLAMA_OPTIONS, rope_scaling="llama3", rope_factor=4.0, rope_original_max_positions=16), "Llama"),
    (dict(qk_norm=False, embed_norm=False, mlp="swiglu", qkv_bias=True, tie_embeddings=True), "Qwen2"),
])
def test_plain_export_round_trip(options, family, tmp_path, capsys):
    """A gpt with Llama options -> a plain transformers class (parameter-free norms as gains of 1)
    -> the same logits; imported back -> the same logits again; AutoTokenizer loads the tokenizer.
    Both load as a user loads them (no trust_remote_code) without one warning: Python's warnings and
    transformers' own logger (which does not propagate to the root logger) are both recorded."""
    model = _run(tmp_path / "run", **options)
    assert main(["export", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf"), "--plain"]) == 0
    stages = [line for line in capsys.readouterr().err.splitlines() if line.startswith("export: ")]
    assert [line.split()[1] for line in stages] == ["loading", "writing"] and "MiB" in stages[1]
    assert not any((tmp_path / "hf" / name).exists() for name in REMOTE_FILES)
    with _transformers_warnings() as logged, warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
        auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert [str(w.message) for w in warned] == [] and logged == []
    assert type(hf).__name__ == f"{family}ForCausalLM"
    idx = torch.randint(0, 259, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx).logits, rtol=0, atol=IMPORT_TOL)
    import_hf(tmp_path / "hf", tmp_path / "back")
    with torch.no_grad():
        torch.testing.assert_close(ll.load(tmp_path / "back")[0](idx).logits, model(idx).logits, rtol=0,
                                   atol=IMPORT_TOL)
    text = "héllo, wörld\n"
    assert auto(text, add_special_tokens=False)["input_ids"] == ByteTokenizer().encode(text)
    assert (auto.bos_token_id, auto.eos_token_id) == (ByteTokenizer.bos_id, ByteTokenizer.eos_id)


@pytest.mark.parametrize("arch, overrides, options", [
    ("gpt", {}, [{}]),  # nanochat options: QK-norm, normed embedding, ReLU² -> custom code
    ("fbt", {}, [{"regime": "standard"}, {"regime": "soft"}, {"regime": "fused", "passes": 3}]),
    ("fbt", dict(LLAMA_OPTIONS, tie_embeddings=False), [{"regime": "soft"}]),  # untied, no embedding norm
    ("lrt", dict(LLAMA_OPTIONS, kv_projection="layerwise"), [{}]),
    ("rgpt", dict(n_layer=3, recurrence_steps=2), [{"steps": 2}, {"steps": 3}]),
])
def test_remote_code_export_matches_the_package(arch, overrides, options, tmp_path, torch_products):
    """fbt / lrt / rgpt (and non-Llama gpt) -> trust_remote_code folder: forward logits (scored as
    decoding produces them) and transformers' generate() give what the package gives (the same
    products on both sides: `torch_products`)."""
    model = _run(tmp_path / "run", arch, **overrides)
    summary = export_hf(tmp_path / "run", tmp_path / "hf")
    assert summary["format"].startswith("LatentloopForCausalLM") and summary["plain_blockers"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True).eval()
    torch.manual_seed(3)
    idx = torch.randint(0, 256, (2, 24))
    prompts = [[256, 10, 20, 30, 40, 50], [256, 99, 98]]
    ids = torch.tensor([prompts[0], [258, 258, 258] + prompts[1]])
    mask = torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]])
    for opts in options:
        with torch.no_grad():
            torch.testing.assert_close(hf(idx, **opts).logits, ll.teacher_forced_logits(model, idx, **opts),
                                       rtol=0, atol=EXACT_TOL)
        mine = ll.generate(model, prompts, 12, temperature=0, pad_id=258, **opts)
        theirs = hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None,
                             pad_token_id=258, **opts)[:, 6:].tolist()
        assert theirs == mine, opts
    if arch == "rgpt":  # the checks that need the model's depth are the package's too
        # (the folder's own copy of ConfigError: the remote code imports nothing of latentloop)
        with pytest.raises(Exception, match=r"min_steps must be at most the decoding depth \(2 steps\)") as refused:
            hf.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, exit_threshold=0.01,
                        min_steps=5)
        assert type(refused.value).__name__ == "ConfigError"
        card = (tmp_path / "hf" / "README.md").read_text()
        assert "only with exit_threshold > 0" in card  # the card's option help says when one applies


@pytest.mark.parametrize("arch", list(ll.archs.ARCHS))
def test_remote_code_is_self_contained(arch):
    """The wrapper and the package files an export ships import nothing of latentloop and nothing
    outside the folder: only `from .name import` of files that are in it."""
    spec = ll.archs.get_arch(arch)
    files = {name: (REMOTE_DIR / name).read_text() for name in REMOTE_FILES}
    files |= package_sources(spec.model_class, spec.config_class)
    for name, source in files.items():
        assert not re.search(r"^\s*(from|import)\s+latentloop", source, re.MULTILINE), name
        assert not re.search(r"^\s*from\s+\.\.", source, re.MULTILINE), name
        for local in re.findall(r"^\s*from\s+\.(\w+)\s+import", source, re.MULTILINE):
            assert f"{local}.py" in files, f"{name} imports .{local}, which the export does not ship"
    # an export never carries the inference package: the models compute with torch's own ops
    inference = {path.name for path in (Path(ll.__file__).parent / "inference").iterdir()}
    assert not inference & set(files), sorted(inference & set(files))
    assert not any(re.search(r"torch\._C|ctypes|mkldnn", source) for source in files.values())


def test_export_errors_are_one_line(tmp_path, capsys):
    _run(tmp_path / "run")
    err = _one_line_error(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf"), "--plain"], capsys)
    assert "qk_norm=true" in err and "embed_norm=true" in err and "mlp=relu2" in err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert "exists and is not empty" in _one_line_error(["export", str(tmp_path / "run"), "--out",
                                                     str(tmp_path / "full")], capsys)


def test_a_chat_export_stops_where_latentloops_chat_stops(tmp_path):
    """A fine-tuned chat run's export ends a generation where `latentloop chat` and the server do: at
    EOS, at the end of turn and at BOS; EOS first, each once (config.json and generation_config.json)."""
    tokenizer = ByteTokenizer(chat=True)
    _run(tmp_path / "run", tokenizer=tokenizer, vocab_size=tokenizer.vocab_size, **LLAMA_OPTIONS)
    export_hf(tmp_path / "run", tmp_path / "hf")
    expected = [tokenizer.eos_id, tokenizer.chat_tokens.end, tokenizer.bos_id]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == expected
    generation = transformers.GenerationConfig.from_pretrained(str(tmp_path / "hf"))
    assert generation.eos_token_id == expected
    from latentloop.serve.scheduler import Scheduler  # the server's stop set (latentloop.chat passes the same)
    idle = type("Idle", (Scheduler,), {"_loop": lambda self: None})  # never started: only its stop set is read
    server = idle(ll.load(tmp_path / "run")[0], tokenizer, 1, 1, 0.0).stop_tokens
    assert set(server) == set(expected)


def test_a_remote_code_export_generates_in_bfloat16(tmp_path):
    """Loaded with dtype=torch.bfloat16, the remote code computes its RoPE tables in the weights' dtype
    on the first forward and greedy-decodes the tokens the package's model.to(bfloat16) decodes."""
    model = _run(tmp_path / "run", "fbt")
    export_hf(tmp_path / "run", tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True,
                                                           dtype=torch.bfloat16).eval()
    assert next(hf.parameters()).dtype == torch.bfloat16
    prompt = [256, 10, 20, 30, 40, 50]
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert hf.model.rope_cos.dtype == torch.bfloat16
    mine = ll.generate(model.to(torch.bfloat16), [prompt], 8, temperature=0)
    assert theirs[:, len(prompt):].tolist() == mine


@pytest.mark.parametrize("make", [lambda: ByteTokenizer(), lambda: ByteTokenizer(chat=True),
                                  lambda: BPETokenizer.train(["the loop carries state " * 40], 300)
                                  .with_chat_tokens()], ids=["byte", "byte-chat", "bpe-chat"])
def test_an_exported_tokenizer_starts_with_bos_as_latentloop_prompts(make, tmp_path):
    """transformers' default encoding of an exported latentloop tokenizer is [BOS] + encode(text), what
    latentloop prompts its models with; without special tokens, and in the chat template (which writes
    its own BOS), nothing is added; latentloop reading the folder back never adds BOS to encode()."""
    ours = make()
    write_hf_tokenizer(ours, tmp_path)
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    text = "héllo, the loop carries\n"
    assert auto(text).input_ids == [ours.bos_id] + ours.encode(text)
    assert auto(text, add_special_tokens=False).input_ids == ours.encode(text)
    assert load_tokenizer(str(tmp_path)).encode(text) == ours.encode(text)
    assert HFTokenizer.from_pretrained_folder(tmp_path).encode(text) == ours.encode(text)
    if ours.chat_tokens is not None:
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the loop"}]
        ids = auto.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=True, return_dict=False)
        assert list(ids) == ours.render_prompt(messages[:1]) and list(ids).count(ours.bos_id) == 1
        assert HFTokenizer.from_pretrained_folder(tmp_path).render(messages) == ours.render(messages)


@pytest.mark.parametrize("writer", ["write_hf_tokenizer", "save_file"])
def test_a_failed_export_leaves_nothing_and_a_retry_works(writer, tmp_path, capsys, monkeypatch):
    """A disk that fills up while the folder is written (an OSError, or safetensors' own error) is one
    line; no output folder (nor staging folder, nor parent made for it) is left, so a retry works."""
    import errno
    import os

    from safetensors import SafetensorError

    from latentloop.interop import hf_export

    _run(tmp_path / "run")

    def full_disk(*args, **kwargs):
        if writer == "save_file":
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(hf_export, writer, full_disk)
    out = tmp_path / "exports" / "hf"
    err = _one_line_error(["export", str(tmp_path / "run"), "--out", str(out), "--no-progress"], capsys)
    assert "No space left on device" in err and str(out) in err
    assert not (tmp_path / "exports").exists()
    monkeypatch.undo()
    assert main(["export", str(tmp_path / "run"), "--out", str(out), "--no-progress"]) == 0
    assert (out / "model.safetensors").is_file() and (out / "README.md").is_file()
    assert sorted(p.name for p in out.parent.iterdir()) == ["hf"]


def test_an_output_folder_under_a_file_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    from latentloop.interop import hf_export

    _run(tmp_path / "run")
    (tmp_path / "afile").write_text("")

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the output folder was checked")

    monkeypatch.setattr(hf_export, "build_model", no_loading)
    err = _one_line_error(["export", str(tmp_path / "run"), "--out", str(tmp_path / "afile" / "sub")], capsys)
    assert "afile" in err and "is a file" in err
    err = _one_line_error(["export", str(tmp_path / "run"), "--out", str(tmp_path / "afile")], capsys)
    assert "is a file; give a folder to create" in err


# --------------------------------------------------------------------------------------------
# Upcycling
# --------------------------------------------------------------------------------------------


@pytest.fixture
def base_run(tmp_path):
    """A 4-block gpt with Llama options (learned norms, untied, no embedding norm), as imported."""
    model = _run(tmp_path / "base", n_layer=4, **LLAMA_OPTIONS)
    return tmp_path / "base", model


@torch.no_grad()
@pytest.mark.parametrize("kv_projection", ["shared", "layerwise"])
def test_upcycled_lrt_equals_its_base_at_step_0(base_run, kv_projection):
    run, base = base_run
    config = upcycle_config(run, "lrt", kv_projection=kv_projection)
    assert config.residual_gamma_init == 0.0
    model = ll.archs.build_model(config).eval()
    report = initialise_from(model, run)
    assert report["exact_at_step0"] == "all recurrences"
    idx = torch.randint(0, 259, (2, 20))
    expected = base(idx).logits
    for recurrence in ("sequential", "interleaved", "multi_refine"):
        torch.testing.assert_close(model(idx, recurrence=recurrence).logits, expected, rtol=0, atol=EXACT_TOL)
    torch.testing.assert_close(ll.teacher_forced_logits(model, idx), expected, rtol=0, atol=EXACT_TOL)


@torch.no_grad()
def test_upcycled_rgpt_reproduces_the_chosen_blocks(base_run):
    """R = 1, gate saturated open, W_proj = [I, 0]: prelude -> core -> coda is the pretrained stack
    restricted to the chosen blocks (all of them by default, or blocks 0, 1, 3 for 1 + 1 + 1)."""
    run, base = base_run
    idx = torch.randint(0, 259, (2, 20))
    saturated = dict(recurrence_steps=1, gate_bias_init=-30.0)
    model = ll.archs.build_model(upcycle_config(run, "rgpt", **saturated)).eval()
    assert (model.config.n_pre, model.config.n_rec, model.config.n_coda) == (1, 2, 1)
    assert initialise_from(model, run)["exact_at_step0"] == "steps=1"
    torch.testing.assert_close(model(idx, steps=1).logits, base(idx).logits, rtol=0, atol=EXACT_TOL)

    subset = ll.archs.build_model(upcycle_config(run, "rgpt", n_pre=1, n_rec=1, n_coda=1, **saturated)).eval()
    report = initialise_from(subset, run)
    assert "coda = block 3" in report["mapping"]
    ctx = base.context(idx, None, None)
    chosen = [base.blocks[0], base.blocks[1], base.blocks[3]]
    expected = base.readout(base.run_blocks(base.embed(idx), ctx, chosen))
    torch.testing.assert_close(subset(idx, steps=1).logits, expected, rtol=0, atol=EXACT_TOL)

    default = ll.archs.build_model(upcycle_config(run, "rgpt")).eval()  # gate bias -4: trainable, not exact
    assert initialise_from(default, run)["exact_at_step0"].startswith("no")
    assert not torch.allclose(default(idx, steps=1).logits, base(idx).logits, atol=EXACT_TOL)


@torch.no_grad()
def test_upcycled_untied_fbt_is_its_base_in_the_standard_regime(base_run):
    run, base = base_run
    model = ll.archs.build_model(upcycle_config(run, "fbt")).eval()
    assert initialise_from(model, run)["exact_at_step0"] == "regime=standard"
    assert model.lm_head is not None and model.fuse_scale is not None
    torch.testing.assert_close(model.fuse_scale, base.wte.weight.pow(2).mean().sqrt().reshape(1))
    idx = torch.randint(0, 259, (2, 20))
    torch.testing.assert_close(ll.teacher_forced_logits(model, idx, regime="standard"), base(idx).logits,
                               rtol=0, atol=EXACT_TOL)
    soft = ll.teacher_forced_logits(model, idx, regime="soft")
    assert torch.isfinite(soft).all() and not torch.allclose(soft, base(idx).logits, atol=EXACT_TOL)


@pytest.mark.parametrize("arch", ["fbt", "lrt"])
def test_upcycled_training_runs_its_objective_and_reduces_the_loss(arch, base_run, corpus, tmp_path, capsys):
    run, _ = base_run
    out = tmp_path / arch
    extra = ["--set", "feedback_start=0", "--set", "pass_mix=[0,1]"] if arch == "fbt" else []
    settings = [arg for pair in ("batch_size=4", "sequence_len=32", "eval_batches=2", "log_every=1")
                for arg in ("--set", pair)]
    assert main(["train", "--arch", arch, "--init-from", str(run), "--data", f"text:{corpus}", "--steps", "6",
                 "--lr", "3e-3", *settings, "--out", str(out), "--no-progress", *extra]) == 0
    assert "initialised from" in capsys.readouterr().err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < losses[0]
    if arch == "fbt":  # the multi-pass objective ran (2 passes per step)
        assert {r.get("passes") for r in rows if "loss" in r} == {2}
    config = json.loads((out / "config.json").read_text())["model"]
    assert config["learned_norms"] and config["n_layer"] == 4 and config["arch"] == arch

    err = _one_line_error(["train", "--arch", arch, "--init-from", str(run), "--preset", "tiny", "--out",
                           str(tmp_path / "x")], capsys)
    assert "--preset" in err


# --------------------------------------------------------------------------------------------
# What cannot be imported
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "llama"
    _hf_model("llama", folder)
    return folder


@pytest.mark.parametrize("change, words", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ({"model_type": "mixtral", "num_local_experts": 8}, "mixture of experts"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"attention_bias": True}, "o_proj"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_scaling type 'yarn'"),
    ({"model_type": "mistral", "sliding_window": 16}, "sliding-window"),
    # transformers' Mistral slides whatever this Qwen2 switch says
    ({"model_type": "mistral", "sliding_window": 16, "use_sliding_window": False}, "sliding-window"),
    ({"model_type": "qwen2", "sliding_window": 16, "use_sliding_window": True, "max_window_layers": 0},
     "sliding-window"),
    ({"sliding_window": 16, "layer_types": ["full_attention", "sliding_attention", "full_attention"]},
     "sliding-window"),
    ({"head_dim": 32}, "head_dim"),
    ({"num_hidden_layers": 5}, "lacks tensor"),
    ("no-tokenizer", "tokenizer.json"),
    ("bin-only", ".bin checkpoints are not supported"),
])
def test_unsupported_checkpoints_are_one_line_errors(change, words, llama_folder, tmp_path, capsys):
    folder = tmp_path / "hf"
    shutil.copytree(llama_folder, folder)
    if change == "no-tokenizer":
        (folder / "tokenizer.json").unlink()
    elif change == "bin-only":
        (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    else:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config | change))
    err = _one_line_error(["import-hf", str(folder), "--out", str(tmp_path / "run")], capsys)
    assert words in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("change, dropped", [
    # no sliding_window key: transformers' Mistral slides over 4,096 tokens (logits differed past them)
    ({"model_type": "mistral", "max_position_embeddings": 4160}, ("sliding_window",)),
    # no max_window_layers key: transformers' Qwen2 slides from layer 28 on
    ({"model_type": "qwen2", "num_hidden_layers": 30, "sliding_window": 8, "use_sliding_window": True},
     ("max_window_layers", "layer_types")),
])
def test_a_window_a_config_leaves_to_its_class_default_is_read_as_transformers_reads_it(
        change, dropped, llama_folder, tmp_path, capsys):
    folder = tmp_path / "hf"
    shutil.copytree(llama_folder, folder)
    config = json.loads((folder / "config.json").read_text()) | change
    for key in dropped:
        config.pop(key, None)
    (folder / "config.json").write_text(json.dumps(config))
    assert "sliding-window attention" in _one_line_error(["import-hf", str(folder), "--out", str(tmp_path / "run")],
                                                         capsys)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("family, extra", [("llama", {}), ("mistral", {"sliding_window": None}), ("qwen2", {})])
def test_a_context_a_config_leaves_out_is_its_familys_as_transformers_reads_it(family, extra):
    """Without max_position_embeddings transformers gives a Mistral 131,072 positions and a Qwen2 32,768;
    the import gave every family Llama's 2,048 (and exported that), a context 64x too short."""
    transformers = pytest.importorskip("transformers")
    from latentloop.interop.hf_import import config_from_hf

    classes = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "qwen2": transformers.Qwen2Config}
    hf = {"model_type": family, "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
          "intermediate_size": 128, "vocab_size": 300, **extra}
    assert config_from_hf(hf).sequence_len == classes[family]().max_position_embeddings


def test_a_sequence_len_past_the_models_positions_is_taken_with_a_warning(capsys):
    """`import-hf --sequence-len 8192` of a 2,048-position model was taken without a word, and the export
    then wrote 8,192 as the model's max_position_embeddings."""
    from latentloop.interop.hf_import import config_from_hf

    hf = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
          "intermediate_size": 128, "vocab_size": 300, "max_position_embeddings": 2048}
    capsys.readouterr()
    assert config_from_hf(hf, sequence_len=1024).sequence_len == 1024 and capsys.readouterr().err == ""
    assert config_from_hf(hf, sequence_len=8192).sequence_len == 8192
    assert "--sequence-len 8192 is past the 2048 positions this model was made for" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["train", "--init-from", "{hf}", "--steps", "1", "--out", "{out}"],
                                     ["generate", "{hf}", "--prompt", "a"], ["export", "{hf}", "--out", "{out}"]])
def test_a_hugging_face_folder_where_a_run_belongs_says_to_import_it(command, llama_folder, tmp_path, capsys):
    """`--init-from HF_FOLDER` named every key of its config.json an unknown config section; a sharded
    one (most Hub models) said it held no checkpoint; a latentloop export was sent to import-hf, which
    refuses it."""
    sharded = tmp_path / "sharded"
    shutil.copytree(llama_folder, sharded)
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00001.safetensors")
    exported = tmp_path / "exported"
    exported.mkdir()
    (exported / "config.json").write_text(json.dumps({"model_type": "latentloop", "latentloop": {}}))
    (exported / "model.safetensors").write_bytes(b"")
    for folder in (llama_folder, sharded):
        argv = [a.format(hf=folder, out=tmp_path / "out") for a in command]
        assert f"holds a Hugging Face model, not a latentloop run: import it first (latentloop import-hf {folder}" \
            in _one_line_error(argv, capsys)
    argv = [a.format(hf=exported, out=tmp_path / "out") for a in command]
    assert "is a latentloop export (Hugging Face remote code), not a run: load it with transformers" \
        in _one_line_error(argv, capsys)
    assert not (tmp_path / "out").exists()


def test_a_qwen2_window_that_no_layer_uses_is_full_attention(llama_folder, tmp_path, capsys):
    """Qwen2 slides only in its layers from max_window_layers on (transformers' layer_types): at or past
    the layer count, none does, and the import goes through as full attention."""
    folder = tmp_path / "hf"
    shutil.copytree(llama_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"sliding_window": 16, "use_sliding_window": True,
                                                             "max_window_layers": config["num_hidden_layers"]}))
    assert main(["import-hf", str(folder), "--out", str(tmp_path / "run")]) == 0


def test_a_sliding_window_model_keeps_its_window_past_the_import(llama_folder, tmp_path, capsys):
    """A Mistral imported within its window attends fully, which is its window's attention only up
    to the window: the run keeps the window (`attention_window`), and training it on from there at a
    longer context is refused in one line (it was checked at import only, then forgotten)."""
    folder = tmp_path / "hf"
    shutil.copytree(llama_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"model_type": "mistral", "sliding_window": 16}))
    assert main(["import-hf", str(folder), "--out", str(tmp_path / "run"), "--sequence-len", "16"]) == 0
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["model"]
    assert saved["attention_window"] == 16 and saved["sequence_len"] == 16
    err = _one_line_error(["train", "--init-from", str(tmp_path / "run"), "--stage", "extend", "--steps", "1",
                           "--set", "sequence_len=32", "--out", str(tmp_path / "longer")], capsys)
    assert "sequence_len 32 is past the model's sliding attention window (16 tokens)" in err
    assert not (tmp_path / "longer").exists()
    # exported, the window is written (as Llama it was lost: a round trip gave attention_window 0, and the
    # exported model attended fully past the window where the source slides), and imported back the same
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "exported"), "--plain"]) == 0
    exported = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert exported["architectures"] == ["MistralForCausalLM"] and exported["sliding_window"] == 16
    assert main(["import-hf", str(tmp_path / "exported"), "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "config.json").read_text())["model"]
    assert again["attention_window"] == 16 and again["sequence_len"] == 16
    source = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    copy = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported")).eval()
    ids = torch.arange(3, 3 + 40)[None] % source.config.vocab_size  # past the window: its attention slides
    with torch.no_grad():
        torch.testing.assert_close(copy(ids).logits, source(ids).logits, rtol=1e-4, atol=1e-4)


def test_the_hub_download_fetches_every_file_the_import_reads(monkeypatch, tmp_path):
    """What `snapshot_download` is asked for: every file a local import reads (the chat template that
    transformers 5 saves as chat_template.jinja among them), and not Mistral's consolidated weights."""
    from fnmatch import fnmatch

    huggingface_hub = pytest.importorskip("huggingface_hub")
    asked = {}

    def fake_download(repo_id, allow_patterns, ignore_patterns=None, **kwargs):
        asked.update(allow=allow_patterns, ignore=ignore_patterns or [])
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    from latentloop.interop.hf_import import resolve_source

    assert resolve_source("org/model") == tmp_path

    def fetched(name: str) -> bool:
        return (any(fnmatch(name, p) for p in asked["allow"])
                and not any(fnmatch(name, p) for p in asked["ignore"]))

    for name in ("config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
                 "tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert fetched(name), name
    assert not fetched("consolidated.safetensors") and not fetched("pytorch_model.bin")


def test_hub_name_offline_is_one_line_error(monkeypatch, tmp_path, capsys):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    err = _one_line_error(["import-hf", "latentloop-tests/no-such-model", "--out", str(tmp_path / "run")], capsys)
    assert "offline" in err and "HF_HUB_OFFLINE" in err
    assert "not a Hub name" in _one_line_error(["import-hf", str(tmp_path / "nothing/here/x"), "--out",
                                                str(tmp_path / "run")], capsys)


def test_an_export_in_bfloat16_rounds_each_weight_once(tmp_path, capsys):
    """`export --dtype bfloat16`: every tensor of the folder is the float32 export's rounded once, and
    the config says so (transformers' loading of it, for every arch: tests/test_contract.py); a dtype it
    does not know is a usage error."""
    from safetensors.torch import load_file

    _run(tmp_path / "run", "gpt", **LLAMA_OPTIONS)
    export_hf(tmp_path / "run", tmp_path / "f32")
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16",
                 "--no-progress"]) == 0
    full, half = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("f32", "bf16"))
    assert full.keys() == half.keys()
    for name, tensor in full.items():
        assert half[name].dtype == torch.bfloat16 and torch.equal(half[name], tensor.to(torch.bfloat16)), name
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with pytest.raises(SystemExit) as refused:
        main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "x"), "--dtype", "int4"])
    assert refused.value.code == 2 and "invalid choice: 'int4'" in capsys.readouterr().err
    # a weight past float16's 65,504 was written as inf, exit 0
    model, tokenizer = ll.load(tmp_path / "run")
    with torch.no_grad():
        model.wte.weight[3, 0] = 70_000.0
    save_run(model, tokenizer, tmp_path / "large")
    assert main(["export", str(tmp_path / "large"), "--out", str(tmp_path / "f16"), "--dtype", "float16",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "does not fit float16" in err and len(err.splitlines()) == 1 and not (tmp_path / "f16").exists()
