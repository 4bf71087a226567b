"""BOS as an imported model's own tokenizer puts it: latentloop put a BOS before every prompt, so an
imported Qwen2 instruct model (tokenizer_config `bos_token: null`, a post-processor that adds nothing,
a ChatML template that starts at `<|im_start|>`) read other ids than transformers gives it in
`generate`, `chat`, `serve` and `eval`, and its greedy tokens differed; a folder without
`bos_token_id` in config.json even took its EOS, the end of turn `<|im_end|>`, for BOS, which then
opened every prompt and was exported as the model's `bos_token`. Every model here is a tiny random
one written with `save_pretrained`; transformers is the reference."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import perturb_hf_weights

import latentloop as ll
from latentloop.checkpoint import add_checksum
from latentloop.cli import main
from latentloop.data import HFTokenizer, load_tokenizer, write_hf_tokenizer
from latentloop.data.chat import render_conversation, render_prompt
from latentloop.errors import DataError
from latentloop.eval import core
from latentloop.eval.lm_eval_adapter import LatentloopLM
from latentloop.interop import export_hf
from latentloop.serve.limits import Limits
from latentloop.serve.protocol import completion_prompts, tokenizer_info

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

# ChatML as Qwen2 instruct writes it: no BOS, every turn opened by <|im_start|> and closed by <|im_end|>
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Qwen2's pre-tokenizer split (its tokenizer.json's, and transformers' Qwen2Tokenizer's)
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
ENDOFTEXT, IM_START, IM_END = 0, 1, 2  # the special tokens' ids, in Qwen2's order
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_SPECIALS = ["<s>", "</s>"]
LLAMA_BOS, LLAMA_EOS = 0, 1
TRAINING_TEXT = "hello world, the latent loop carries state forward. 12+34=46; " * 40
TOKENIZER_VOCAB = 300
MODEL_VOCAB = 320  # models pad their vocabulary past the tokenizer's ids
NEW_TOKENS = 8
SERVE_LIMITS = Limits(context=64, max_tokens_cap=16, max_rows=4)
PROMPT = "hello world, the loop"
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world"},
                {"role": "assistant", "content": "the loop"}, {"role": "user", "content": "state?"},
                {"role": "assistant", "content": "carried forward"}]


def _tokenizer_json(folder, specials: list[str], post_processor=None) -> None:
    """A byte-level BPE with Qwen2's normalizer and pre-tokenizer, trained on a little text."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TRAINING_TEXT], trainer=trainer)
    tok.post_processor = post_processor
    tok.save(str(folder / "tokenizer.json"))


def _perturbed(model):
    torch.manual_seed(0)
    perturb_hf_weights(model)
    return model.eval()


SMALL = dict(vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)

# where a Qwen2 instruct folder without bos_token_id in config.json may still name the id documents start with
QWEN2_BOS_SOURCES = {
    "generation_config bos_token_id": {"bos_token_id": ENDOFTEXT, "eos_token_id": [IM_END, ENDOFTEXT],
                                       "pad_token_id": ENDOFTEXT},
    "generation_config end token": {"eos_token_id": [IM_END, ENDOFTEXT], "pad_token_id": ENDOFTEXT},
    "tokenizer_config pad_token": None,  # no generation_config.json
}


def _qwen2_instruct_folder(folder, bos_source: str = "generation_config bos_token_id"):
    """A Qwen2 instruct model as its folder holds it, with config.json naming no BOS: tokenizer_config
    `bos_token` null, EOS `<|im_end|>`, PAD `<|endoftext|>`, ChatML, a ByteLevel post-processor that adds
    nothing (Qwen2's). Returns the transformers model."""
    from tokenizers import processors
    from transformers import Qwen2Config, Qwen2ForCausalLM

    folder.mkdir(parents=True)
    torch.manual_seed(0)
    model = _perturbed(Qwen2ForCausalLM(Qwen2Config(**SMALL, bos_token_id=None, eos_token_id=IM_END,
                                                    tie_word_embeddings=True)))
    model.save_pretrained(folder)
    generation = QWEN2_BOS_SOURCES[bos_source]
    (folder / "generation_config.json").unlink(missing_ok=True)
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    assert json.loads((folder / "config.json").read_text()).get("bos_token_id") is None
    _tokenizer_json(folder, CHATML_SPECIALS, processors.ByteLevel(trim_offsets=False))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML,
        "tokenizer_class": "Qwen2Tokenizer", "add_prefix_space": False, "errors": "replace"}))
    return model


def _llama_folder(folder, bos_first: bool = True):
    """A Llama model whose tokenizer names `<s>` as BOS (config.json and tokenizer_config.json) and,
    with `bos_first`, puts it before a text (Llama 2 / 3's post-processor); without, adds nothing
    (SmolLM2's: a ByteLevel post-processor)."""
    from tokenizers import processors
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True)
    torch.manual_seed(0)
    model = _perturbed(LlamaForCausalLM(LlamaConfig(**SMALL, bos_token_id=LLAMA_BOS, eos_token_id=LLAMA_EOS)))
    model.save_pretrained(folder)
    post_processor = (processors.TemplateProcessing(single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1",
                                                    special_tokens=[("<s>", LLAMA_BOS)])
                      if bos_first else processors.ByteLevel(trim_offsets=False))
    _tokenizer_json(folder, LLAMA_SPECIALS, post_processor)
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                              "tokenizer_class": "PreTrainedTokenizerFast"}))
    return model


def _chat_ids(hf_tokenizer, messages, add_generation_prompt: bool) -> list[int]:
    return list(hf_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                                 return_dict=False))


@pytest.mark.parametrize("bos_source", sorted(QWEN2_BOS_SOURCES))
def test_a_qwen2_instruct_folder_naming_no_bos_starts_documents_with_endoftext_not_its_end_of_turn(tmp_path,
                                                                                                   bos_source):
    """config.json without bos_token_id: the id latentloop separates documents with is generation_config's
    bos_token_id, else an end token or PAD the chat template does not write (<|endoftext|>), never the
    template's end of turn <|im_end|> (EOS here), which was chosen before; and no BOS goes before a prompt."""
    folder = tmp_path / "hf"
    _qwen2_instruct_folder(folder, bos_source)
    tok = HFTokenizer.from_pretrained_folder(folder, config=json.loads((folder / "config.json").read_text()))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (ENDOFTEXT, IM_END, ENDOFTEXT)
    assert not tok.adds_bos and not tok.names_bos
    tok.save(tmp_path / "run")  # a run folder keeps what tokenizer_config.json said
    saved = load_tokenizer(str(tmp_path / "run" / "tokenizer.json"))
    assert (saved.bos_id, saved.adds_bos, saved.names_bos) == (ENDOFTEXT, False, False)


def test_prompts_and_chat_renders_of_a_qwen2_instruct_tokenizer_are_the_ids_transformers_gives(tmp_path):
    """Every prompt site (chat render, generate's and the server's text prompts, CORE and lm-eval
    contexts) gives the ids transformers' tokenizer / apply_chat_template gives, and the SFT render of
    a conversation is the same ids, with each chat-time prompt its prefix."""
    folder = tmp_path / "hf"
    _qwen2_instruct_folder(folder)
    tok = HFTokenizer.from_pretrained_folder(folder, config=json.loads((folder / "config.json").read_text()))
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert hf.bos_token is None
    for turns in (2, 4):  # chat: the prompt, and the conversation SFT trains on
        assert render_prompt(tok, CONVERSATION[:turns]) == _chat_ids(hf, CONVERSATION[:turns], True)
    ids, mask = render_conversation(tok, CONVERSATION)
    assert ids == _chat_ids(hf, CONVERSATION, False) and ids[0] == IM_START
    for turns in (2, 4):  # the chat-time prompt is the start of the trained row, and its reply is trained
        prompt = render_prompt(tok, CONVERSATION[:turns])
        assert ids[:len(prompt)] == prompt and mask[len(prompt)] and not any(mask[len(prompt) - 3:len(prompt)])
    expected = hf(PROMPT).input_ids
    assert tok.as_prompt(tok.encode(PROMPT)) == expected  # `latentloop generate`
    assert completion_prompts(PROMPT, tok, MODEL_VOCAB, SERVE_LIMITS) == ([expected], [False])  # serve
    assert completion_prompts([expected], tok, MODEL_VOCAB, SERVE_LIMITS) == ([expected], [False])
    assert core._encode_all(tok, [PROMPT]) == [expected]  # CORE
    context, continuation = LatentloopLM.encode_pair(SimpleNamespace(tokenizer=tok), "hello world,", " the loop")
    assert context == hf("hello world,").input_ids and context + continuation == expected  # lm-eval


FOLDERS = {
    "qwen2 instruct (no BOS)": _qwen2_instruct_folder,
    "llama (BOS from its post-processor)": _llama_folder,
    "smollm2-like (BOS named, none added)": lambda folder: _llama_folder(folder, bos_first=False),
}


@pytest.mark.parametrize("kind", list(FOLDERS))
def test_latentloop_generate_of_an_imported_model_is_transformers_greedy_generate(tmp_path, capsys, kind):
    """`latentloop generate` (the CLI) on an imported model prompts with the ids transformers' tokenizer
    gives (BOS first exactly where it puts one) and writes transformers' greedy tokens, up to and
    including the first end token."""
    folder = tmp_path / "hf"
    model = FOLDERS[kind](folder)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    prompt = hf_tokenizer(PROMPT).input_ids
    assert main(["import-hf", str(folder), "--out", str(tmp_path / "run")]) == 0
    _, tokenizer = ll.load(tmp_path / "run")
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "run"), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS),
                 "--temperature", "0", "--json"]) == 0
    ours = json.loads(capsys.readouterr().out)
    stops = sorted({*tokenizer.stop_ids, tokenizer.bos_id})  # what the CLI stops at
    theirs = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                            max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=stops,
                            pad_token_id=tokenizer.pad_id)[0, len(prompt):].tolist()
    assert ours["ids"] == theirs and len(set(theirs)) > 1
    assert ours["prompt_tokens"] == len(prompt)
    assert tokenizer.adds_bos == (prompt[0] == tokenizer.bos_id) == (kind == "llama (BOS from its post-processor)")


def test_an_export_of_an_imported_qwen2_instruct_model_invents_no_bos_token(tmp_path):
    """The export writes tokenizer_config's bos_token only where the source named one: the id a model
    without BOS separates documents with is latentloop's, not a BOS of the model (it was written as
    `<|im_end|>`). The exported tokenizer gives the source's ids for a text and a chat."""
    folder = tmp_path / "hf"
    _qwen2_instruct_folder(folder)
    assert main(["import-hf", str(folder), "--out", str(tmp_path / "run")]) == 0
    export_hf(tmp_path / "run", tmp_path / "export")
    settings = json.loads((tmp_path / "export" / "tokenizer_config.json").read_text())
    assert "bos_token" not in settings and settings["eos_token"] == "<|im_end|>"
    source = transformers.AutoTokenizer.from_pretrained(str(folder))
    exported = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "export"))
    assert exported.bos_token is None and exported(PROMPT).input_ids == source(PROMPT).input_ids
    assert _chat_ids(exported, CONVERSATION, False) == _chat_ids(source, CONVERSATION, False)
    back = HFTokenizer.from_pretrained_folder(tmp_path / "export",
                                              config=json.loads((tmp_path / "export" / "config.json").read_text()))
    assert (back.bos_id, back.adds_bos, back.names_bos) == (ENDOFTEXT, False, False)  # the round trip keeps them


# -- a model trained here with a Hugging Face tokenizer ------------------------------------------------
# `adds_bos` belongs to the model: an imported one is prompted as transformers prompts it, one latentloop
# trains read every document after BOS (data/shards.py) and is prompted with BOS, whatever the post-processor

NO_BOS_FOLDERS = {
    "qwen2 instruct (no BOS named, none added)": _qwen2_instruct_folder,
    "smollm2-like (BOS named, none added)": lambda folder: _llama_folder(folder, bos_first=False),
}


def _train_from_scratch(tmp_path, tokenizer_spec: str):
    from conftest import write_corpus

    corpus = write_corpus(tmp_path / "corpus", documents=8)
    run = tmp_path / "scratch"
    assert main(["train", "--arch", "gpt", "--preset", "test", "--tokenizer", tokenizer_spec, "--data",
                 f"text:{corpus}", "--steps", "1", "--batch-size", "2", "--set", "sequence_len=32", "--set",
                 "eval_every=0", "--out", str(run), "--no-progress"]) == 0
    return run


@pytest.mark.parametrize("spec", ["folder", "tokenizer.json"])
@pytest.mark.parametrize("kind", list(NO_BOS_FOLDERS))
def test_a_model_trained_here_with_a_tokenizer_that_adds_no_bos_is_prompted_with_bos(tmp_path, capsys, kind, spec):
    """`train --tokenizer` a Hugging Face folder (or its tokenizer.json) whose post-processor puts no BOS
    first: the model read every document after BOS, so `ll.load` gives a tokenizer whose prompts, chat
    renders and `generate` start with BOS (they did not: the post-processor decided, 12-06 review); the
    run's tokenizer file says so, and an export of it gives transformers the same prompt."""
    folder = tmp_path / "hf"
    NO_BOS_FOLDERS[kind](folder)
    assert not HFTokenizer.from_pretrained_folder(folder).adds_bos  # as transformers reads the folder
    run = _train_from_scratch(tmp_path, str(folder if spec == "folder" else folder / "tokenizer.json"))
    _, tokenizer = ll.load(run)
    bos = tokenizer.bos_id
    assert tokenizer.adds_bos and tokenizer.as_prompt(tokenizer.encode(PROMPT)) == [bos, *tokenizer.encode(PROMPT)]
    assert json.loads((run / "tokenizer.json").read_text())["adds_bos"] is True
    assert completion_prompts(PROMPT, tokenizer, MODEL_VOCAB, SERVE_LIMITS)[0][0][0] == bos  # serve
    assert tokenizer_info(tokenizer, SERVE_LIMITS.context)["add_bos_token"] is True  # and its /tokenizer_info
    assert core._encode_all(tokenizer, [PROMPT])[0][0] == bos  # CORE
    chat = tokenizer.with_chat_tokens()  # SFT: its template, or latentloop's tokens added; BOS first either way
    assert chat.adds_bos and render_prompt(chat, CONVERSATION[:2])[0] == bos
    assert render_conversation(chat, CONVERSATION)[0][0] == bos
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", PROMPT, "--max-new-tokens", "2", "--temperature", "0",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt_tokens"] == len(tokenizer.encode(PROMPT)) + 1
    write_hf_tokenizer(tokenizer, tmp_path / "export")  # transformers prompts the exported model so too
    exported = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "export"))
    assert exported(PROMPT).input_ids == [bos, *tokenizer.encode(PROMPT)]
    if tokenizer.chat_template is not None:  # its own template writes no BOS: the exported one starts with it
        assert _chat_ids(exported, CONVERSATION, False) == render_conversation(tokenizer, CONVERSATION)[0]
        assert _chat_ids(exported, CONVERSATION[:2], True) == render_prompt(tokenizer, CONVERSATION[:2])
    assert HFTokenizer.from_pretrained_folder(tmp_path / "export").adds_bos  # and imported back


def test_a_model_trained_from_scratch_with_an_imported_runs_tokenizer_file_is_prompted_with_bos(tmp_path):
    """`train --tokenizer runs/imported/tokenizer.json`: that file says its model reads no BOS (Qwen2's),
    but the new model read every document after BOS: its prompts start with one (they did not)."""
    folder = tmp_path / "hf"
    NO_BOS_FOLDERS[next(iter(NO_BOS_FOLDERS))](folder)
    assert main(["import-hf", str(folder), "--out", str(tmp_path / "imported")]) == 0
    assert json.loads((tmp_path / "imported" / "tokenizer.json").read_text())["adds_bos"] is False
    run = _train_from_scratch(tmp_path, str(tmp_path / "imported" / "tokenizer.json"))
    _, tokenizer = ll.load(run)
    assert tokenizer.adds_bos and tokenizer.as_prompt(tokenizer.encode(PROMPT))[0] == tokenizer.bos_id
    _, imported = ll.load(tmp_path / "imported")  # the imported run itself keeps its own rule
    assert not imported.adds_bos


@pytest.mark.parametrize("kind", list(FOLDERS))
def test_an_imported_run_keeps_its_prompts_in_its_tokenizer_file(tmp_path, kind):
    """`import-hf` writes the post-processor's word into the run's tokenizer file: the run and a copy
    with the chat tokens (an SFT of it) prompt as transformers does, BOS first only for Llama."""
    folder = tmp_path / "hf"
    FOLDERS[kind](folder)
    assert main(["import-hf", str(folder), "--out", str(tmp_path / "run")]) == 0
    adds = kind == "llama (BOS from its post-processor)"
    assert json.loads((tmp_path / "run" / "tokenizer.json").read_text())["adds_bos"] is adds
    _, tokenizer = ll.load(tmp_path / "run")
    expected = transformers.AutoTokenizer.from_pretrained(str(folder))(PROMPT).input_ids
    assert tokenizer.adds_bos is adds and tokenizer.as_prompt(tokenizer.encode(PROMPT)) == expected
    assert tokenizer_info(tokenizer, SERVE_LIMITS.context)["add_bos_token"] is adds  # serve's /tokenizer_info
    chat = tokenizer.with_chat_tokens()
    assert chat.adds_bos is adds and chat.as_prompt(chat.encode(PROMPT)) == expected


def test_a_run_tokenizer_file_without_adds_bos_prompts_with_bos(tmp_path):
    """A run's tokenizer file written before `adds_bos` was kept (no key) reads True, what latentloop
    trained and prompted every model with until then, whatever its post-processor; a key that is no
    true / false is one error naming it."""
    folder = tmp_path / "hf"
    _qwen2_instruct_folder(folder)
    tok = HFTokenizer.from_pretrained_folder(folder)
    assert not tok.adds_bos
    path = tok.save(tmp_path / "run")
    content = json.loads(path.read_text())
    saved = {key: content.pop(key, None) for key in ("adds_bos", "names_bos")}  # as files written before
    path.write_text(json.dumps(content))
    old = load_tokenizer(str(path))
    assert old.adds_bos and old.as_prompt(old.encode(PROMPT)) == [ENDOFTEXT, *old.encode(PROMPT)]
    assert saved["adds_bos"] is False  # what a run's file keeps now, and reads back
    path.write_text(json.dumps({**content, "adds_bos": False}))
    assert not load_tokenizer(str(path)).adds_bos
    content["adds_bos"] = "no"
    path.write_text(json.dumps(content))
    with pytest.raises(DataError, match="adds_bos"):
        load_tokenizer(str(path))


def _as_written_before_adds_bos_was_kept(run) -> None:
    """A run's tokenizer files (its folder's, and each checkpoint's checksummed copy, which loading
    reads first) as latentloop wrote them before 2026-12-06: no `adds_bos`, no `names_bos`."""
    for path in [run / "tokenizer.json", *run.glob("checkpoints/*/tokenizer.json")]:
        content = json.loads(path.read_text())
        for key in ("adds_bos", "names_bos"):
            content.pop(key)
        path.write_text(json.dumps(content))
        if path.parent != run:
            add_checksum(path.parent, path.name)


def test_a_run_imported_before_adds_bos_was_kept_prompts_as_transformers(tmp_path):
    """A Qwen2 instruct model imported before the run's tokenizer file kept `adds_bos` read as BOS-first
    (the rule for runs latentloop trained), which transformers never does for it: a checkpoint whose
    state.json says `imported_from` is prompted as `import-hf` reads it now, through `ll.load`, export
    and `train --init-from` (whose new tokenizer file records it); a run trained here keeps BOS."""
    folder = tmp_path / "hf"
    _qwen2_instruct_folder(folder)
    assert main(["import-hf", str(folder), "--out", str(tmp_path / "run")]) == 0
    _as_written_before_adds_bos_was_kept(tmp_path / "run")
    expected = transformers.AutoTokenizer.from_pretrained(str(folder))(PROMPT).input_ids
    _, tokenizer = ll.load(tmp_path / "run")
    assert not tokenizer.adds_bos and tokenizer.as_prompt(tokenizer.encode(PROMPT)) == expected
    export_hf(tmp_path / "run", tmp_path / "export")
    exported = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "export"))
    assert exported(PROMPT).input_ids == expected
    # no BOS named that the source never named (as a fresh import's export): transformers took it for one
    assert exported.bos_token is None
    assert "bos_token" not in json.loads((tmp_path / "export" / "tokenizer_config.json").read_text())
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TRAINING_TEXT * 4)
    assert main(["train", "--init-from", str(tmp_path / "run"), "--data", f"text:{corpus}", "--steps", "1",
                 "--batch-size", "2", "--set", "sequence_len=32", "--set", "eval_every=0", "--out",
                 str(tmp_path / "tuned"), "--no-progress"]) == 0
    assert json.loads((tmp_path / "tuned" / "tokenizer.json").read_text())["adds_bos"] is False
    scratch = _train_from_scratch(tmp_path, str(tmp_path / "run" / "tokenizer.json"))
    _as_written_before_adds_bos_was_kept(scratch)  # no `imported_from`: trained here, read after BOS
    _, trained_here = ll.load(scratch)
    assert trained_here.adds_bos and trained_here.as_prompt(trained_here.encode(PROMPT))[0] == trained_here.bos_id


def test_adds_bos_is_the_models_and_chat_copies_keep_it(tmp_path):
    """The constructor takes `adds_bos` (None: the post-processor's); a copy with latentloop's chat
    tokens keeps it, and the fingerprint changes with it only where it is not the post-processor's (the
    rendered chat data differ; every other tokenizer's cache keys stay as they were)."""
    folder = tmp_path / "hf"
    _llama_folder(folder, bos_first=False)
    imported = HFTokenizer.from_pretrained_folder(folder)
    trained = load_tokenizer(str(folder))
    assert (imported.adds_bos, trained.adds_bos) == (False, True)
    plain = HFTokenizer(imported.hf_json(), imported.bos_id, imported.eos_id, imported.pad_id)
    assert plain.fingerprint() == imported.fingerprint() != trained.fingerprint()
    assert HFTokenizer(imported.hf_json(), LLAMA_BOS, LLAMA_EOS, LLAMA_EOS, adds_bos=True).adds_bos
    for tok in (imported, trained):
        chat = tok.with_chat_tokens()
        assert chat is not tok and chat.chat_tokens is not None and chat.adds_bos == tok.adds_bos
        chat.save(tmp_path / f"run-{tok.adds_bos}")
        assert load_tokenizer(str(tmp_path / f"run-{tok.adds_bos}")).adds_bos == tok.adds_bos
