"""Hugging Face chat templates: an imported tokenizer renders conversations with its own template
(ids as `transformers`' `apply_chat_template` gives them, the mask on each assistant reply and
what closes it), latentloop's format round-trips through an exported template, and an imported
model with a template goes through SFT and chat without new tokens."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from latentloop.chat import stream_reply
from latentloop.cli import main
from latentloop.data import BPETokenizer, ByteTokenizer, HFTokenizer, load_tokenizer
from latentloop.data import chat as chat_data
from latentloop.data.chat import ChatFormatError, ChatTemplateLimitError, TemplateLimits, render_template
from latentloop.data.tokenizers import ChatTemplate, write_hf_tokenizer
from latentloop.errors import DataError
from latentloop.runs import load_run

transformers = pytest.importorskip("transformers")

# ChatML, as Qwen2 / SmolLM2 write it (no BOS; the template opens every turn itself)
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world"},
                {"role": "assistant", "content": "the loop"}, {"role": "user", "content": "state?"},
                {"role": "assistant", "content": "carried forward"}]


def _chatml_folder(folder, template: str = CHATML):
    """A byte-level BPE with ChatML's special tokens and `template`, as a model folder holds them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=CHATML_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the latent loop carries state forward. 12+34=46; " * 40], trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    settings = {"eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return folder


def _hf_ids(folder, messages, add_generation_prompt: bool) -> list[int]:
    """The independent reference: transformers' own template rendering and tokenization."""
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                  return_dict=False)
    return list(ids)


def test_a_chatml_template_renders_as_transformers_does_and_masks_each_reply(tmp_path):
    folder = _chatml_folder(tmp_path / "qwenish")
    tok = HFTokenizer.from_pretrained_folder(folder)
    end = tok.encode_markup("<|im_end|>")
    assert isinstance(tok.chat_tokens, ChatTemplate) and [tok.chat_tokens.end] == end
    assert tok.with_chat_tokens() is tok  # no tokens added: the model's own format
    bos = []  # ChatML writes no BOS and the tokenizer adds none: neither does latentloop, as transformers
    assert tok.render_prompt(CONVERSATION[:2]) == bos + _hf_ids(folder, CONVERSATION[:2], True)
    ids, mask = tok.render(CONVERSATION)
    assert ids == bos + _hf_ids(folder, CONVERSATION, False)
    trained = [i for i, m in zip(ids, mask) if m]
    assert trained == tok.encode_markup("the loop<|im_end|>\n") + tok.encode_markup("carried forward<|im_end|>\n")
    for turns in (2, 4):  # the mask of each reply starts exactly where its prompt ends
        prompt = tok.render_prompt(CONVERSATION[:turns])
        assert ids[:len(prompt)] == prompt and mask[len(prompt)] and not any(mask[:len(prompt)][-3:])
    assert mask.index(True) == len(tok.render_prompt(CONVERSATION[:2]))


def test_the_tokenizers_own_eos_is_the_templates_eos_token_and_the_configs_still_stops(tmp_path):
    """A finetune whose tokenizer_config.json names <|im_end|> as its EOS while config.json keeps the
    base model's <|endoftext|> (Llama 3 Instruct's <|eot_id|> against <|end_of_text|>): transformers
    writes the tokenizer's in a template's `eos_token`; the import took config.json's, so every
    reply ended in another token than the model was tuned on, and the export renamed its EOS."""
    template = CHATML.replace("'<|im_end|>' + '\n'", "eos_token + '\n'")
    folder = _chatml_folder(tmp_path / "tuned", template)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(settings | {"eos_token": "<|im_end|>"}))
    config = {"eos_token_id": 0}  # <|endoftext|>
    (folder / "config.json").write_text(json.dumps(config))
    tok = HFTokenizer.from_pretrained_folder(folder, config=config)
    [im_end] = tok.encode_markup("<|im_end|>")
    assert tok.eos_id == im_end and set(tok.stop_ids) == {im_end, 0}
    ids, _ = tok.render(CONVERSATION)
    assert ids == _hf_ids(folder, CONVERSATION, False)
    exported = tmp_path / "exported"
    exported.mkdir()
    write_hf_tokenizer(tok, exported)
    assert transformers.AutoTokenizer.from_pretrained(str(exported)).eos_token == "<|im_end|>"


# Mistral-7B-Instruct-v0.1's template: replies follow " [/INST]" straight, with no markup between
MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
           "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
           "{{ message['content'] + eos_token }}{% endif %}{% endfor %}")


def _sentencepiece_folder(folder):
    """A Llama-2-style tokenizer.json (a "▁" prepended, spaces as "▁") with Mistral's template."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    folder.mkdir(parents=True)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tokenizer.train_from_iterator(["[INST] hello world [/INST] the loop carries state forward. " * 40], trainer=trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                              "tokenizer_class": "PreTrainedTokenizerFast",
                                                              "chat_template": MISTRAL}))
    return folder


def test_a_sentencepiece_template_trains_on_the_ids_transformers_and_the_chat_prompt_give(tmp_path):
    """Each span of a rendered conversation was encoded alone: a SentencePiece-style tokenizer put a
    "▁" of its own before every reply, so the trained ids differed from `apply_chat_template`'s and
    from the chat-time prompt of every later turn (12-06 review). The whole text is encoded once now;
    a token is trained when it begins inside a reply."""
    folder = _sentencepiece_folder(tmp_path / "mistralish")
    tok = HFTokenizer.from_pretrained_folder(folder)
    conversation = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "the loop"},
                    {"role": "user", "content": "state?"}, {"role": "assistant", "content": "carried forward"}]
    ids, mask = tok.render(conversation)
    assert ids == _hf_ids(folder, conversation, False)
    for turns in (1, 3):  # each chat-time prompt is the trained row's prefix, and its reply is trained
        prompt = tok.render_prompt(conversation[:turns])
        assert ids[:len(prompt)] == prompt and mask[len(prompt)] and not any(mask[:len(prompt)][-3:])
    pieces = "".join(tok._tokenizer.id_to_token(i) for i, m in zip(ids, mask) if m).replace("▁", "")
    assert pieces == "theloop</s>carriedforward</s>"  # each reply and its end token, nothing of the prompts


def test_the_template_survives_the_run_folder_and_export(tmp_path):
    tok = HFTokenizer.from_pretrained_folder(_chatml_folder(tmp_path / "qwenish"))
    tok.save(tmp_path / "run")
    back = load_tokenizer(str(tmp_path / "run" / "tokenizer.json"))
    assert back.chat_template == CHATML and back.fingerprint() == tok.fingerprint()
    assert back.render(CONVERSATION) == tok.render(CONVERSATION)
    write_hf_tokenizer(back, tmp_path / "export")
    assert json.loads((tmp_path / "export" / "tokenizer_config.json").read_text())["chat_template"] == CHATML
    plain = HFTokenizer(tok.hf_json(), tok.bos_id, tok.eos_id, tok.pad_id)  # the template changes rendering:
    assert plain.fingerprint() != tok.fingerprint()  # cached chat data keyed by it must not be reused


def _gpt2_like_with_chat_tokens(folder: Path) -> HFTokenizer:
    """An imported tokenizer whose config names a BOS token its post-processor never adds (GPT-2's), so
    its prompts start without one, with latentloop's chat tokens (SFT here)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(["the loop carries state forward " * 40], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    gpt2_config = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
                   "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(gpt2_config))
    imported = HFTokenizer.from_pretrained_folder(folder, config={"bos_token_id": 0, "eos_token_id": 0})
    assert not imported.adds_bos and imported.names_bos
    return imported.with_chat_tokens()


def _metaspace_first_with_chat_tokens(folder: Path) -> HFTokenizer:
    """A SentencePiece-style tokenizer that prepends "▁" to a text's first piece only (Metaspace,
    prepend_scheme "first"), no template of its own, with latentloop's chat tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir()
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    # every character of the test's conversations and of the import's probe ("Hi", "Hello"): an <unk> in a
    # reply would read as the special token that ends a turn
    text = "Hi Hello. Be brief. hello world, the loop carries state forward? " * 40
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                        show_progress=False))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                              "tokenizer_class": "PreTrainedTokenizerFast"}))
    return HFTokenizer.from_pretrained_folder(folder, config={"bos_token_id": 1, "eos_token_id": 2},
                                              adds_bos=True).with_chat_tokens()


@pytest.mark.parametrize("make", [lambda _: ByteTokenizer(chat=True),
                                  lambda _: BPETokenizer.train(["the loop carries state " * 40], 300)
                                  .with_chat_tokens(),
                                  lambda path: _gpt2_like_with_chat_tokens(path / "gpt2-like"),
                                  lambda path: _metaspace_first_with_chat_tokens(path / "metaspace-first")],
                         ids=["byte", "bpe", "no-bos", "metaspace-first"])
def test_latentloops_format_exports_as_a_template_that_renders_the_same(tmp_path, make):
    """Exported chat runs carry latentloop's format as a chat template: transformers renders the
    same ids, and the same folder imported back renders the same ids and mask via its template."""
    # no-bos: its template wrote a BOS latentloop never prompts with; metaspace-first: each message, encoded
    # alone, begins with "▁", which transformers' one text lacked after a special token
    ours = make(tmp_path)
    exported = tmp_path / "export"
    write_hf_tokenizer(ours, exported)
    assert _hf_ids(exported, CONVERSATION[:2], True) == ours.render_prompt(CONVERSATION[:2])
    assert _hf_ids(exported, CONVERSATION, False) == ours.render(CONVERSATION)[0]
    imported = HFTokenizer.from_pretrained_folder(exported)
    assert isinstance(imported.chat_tokens, ChatTemplate) and imported.chat_tokens.end == ours.chat_tokens.end
    assert imported.render(CONVERSATION) == ours.render(CONVERSATION)
    assert imported.render_prompt(CONVERSATION[:4]) == ours.render_prompt(CONVERSATION[:4])


def test_a_tokenizer_without_a_template_gains_latentloops_tokens(tmp_path):
    folder = _chatml_folder(tmp_path / "plain")
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    del settings["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    tok = HFTokenizer.from_pretrained_folder(folder, vocab_size=320)
    assert tok.chat_tokens is None
    chat = tok.with_chat_tokens()
    assert chat.chat_tokens.ids == tuple(range(tok.own_size, tok.own_size + 4)) and chat.vocab_size == 320
    assert chat.encode("hello world") == tok.encode("hello world")
    ids, mask = chat.render(CONVERSATION[1:3])
    assert ids[-1] == chat.chat_tokens.end and chat.decode([i for i, m in zip(ids, mask) if m]) == "the loop"


@pytest.mark.parametrize("template, error, words", [
    ("{{ messages[-1]['content'] }}", ChatFormatError, "growing prefix"),  # renders only the last turn
    ("{{ raise_exception('only user and assistant roles') }}", ChatFormatError, "only user and assistant roles"),
    ("{% for m in messages %}{{ m.content }", DataError, "does not compile"),
])
def test_a_template_that_cannot_be_trained_on_is_one_clear_error(tmp_path, template, error, words):
    tok = HFTokenizer.from_pretrained_folder(_chatml_folder(tmp_path / "bad", template))
    with pytest.raises(error, match=words):
        tok.render(CONVERSATION[1:3])
    write_hf_tokenizer(tok, tmp_path / "export")  # exporting never renders: the template goes back as read
    assert json.loads((tmp_path / "export" / "tokenizer_config.json").read_text())["chat_template"] == template


def test_an_imported_model_with_a_template_fine_tunes_and_chats_in_its_own_format(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = _chatml_folder(tmp_path / "hf")
    tok = HFTokenizer.from_pretrained_folder(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    assert main(["import-hf", str(folder), "--out", str(tmp_path / "base")]) == 0
    assert main(["train", "--stage", "sft", "--init-from", str(tmp_path / "base"), "--data",
                 "chat:task:addition_steps:n=80", "--steps", "2", "--batch-size", "2", "--out", str(tmp_path / "sft"),
                 "--no-progress", "--set", "eval_every=0"]) == 0
    model, run_tok, config, _ = load_run(tmp_path / "sft")
    assert config.model.vocab_size == 320 and run_tok.chat_template == CHATML  # nothing grown: its own format
    reply = "".join(stream_reply(model, run_tok, [{"role": "user", "content": "12+34="}], max_new_tokens=6))
    assert isinstance(reply, str) and "<|im_end|>" not in reply


# -- templates that would hang or exhaust memory ----------------------------------------------------
# short limits, so that each case takes a second at most
SHORT_LIMITS = TemplateLimits(time_s=1.0, output_chars=100_000, memory_bytes=256 * 2**20)
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}BODY{% endfor %}{% endfor %}"


@pytest.fixture
def short_limits(monkeypatch):
    monkeypatch.setattr(chat_data, "TEMPLATE_LIMITS", SHORT_LIMITS)
    return SHORT_LIMITS


@pytest.mark.parametrize("template, words", [
    (NESTED_LOOPS.replace("BODY", ""), "longer than 1 s"),  # loops forever writing nothing: only the clock stops it
    (NESTED_LOOPS.replace("BODY", "x"), "output over 100,000 characters"),  # stopped while it writes
    ("{{ lipsum(10**7) }}", "output over"),
    ("{{ 'a' * 10**10 }}", "output over"),
    ("{{ 'a' * 10**8 }}", "output over"),  # tokenized, this much text made `tokenizers` panic (abort)
    ("{{ messages | tojson(indent=10**10) }}", "output over"),
    ("{{ '{:>10000000000}'.format(1) }}", "output over"),
    ("{{ '%10000000000d' % 1 }}", "output over"),
    ("{{ 2 ** (10 ** 9) }}", "output over"),
    # what no cheap check looks at: the worker's address space and the clock still hold
    ("{{ 'a' | center(10**10) }}", "out of memory"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s[:9] }}",
     "out of memory|longer than 1 s"),
])
def test_a_template_that_breaks_a_limit_is_one_clear_error_and_the_next_renders(tmp_path, short_limits, template,
                                                                                   words):
    good = HFTokenizer.from_pretrained_folder(_chatml_folder(tmp_path / "good"))
    expected = good.render_prompt(CONVERSATION[:2])
    tok = HFTokenizer.from_pretrained_folder(_chatml_folder(tmp_path / "bad", template))
    started = time.monotonic()
    with pytest.raises(ChatTemplateLimitError, match=words) as error:
        tok.render_prompt(CONVERSATION[:2])
    assert time.monotonic() - started < 10 * short_limits.time_s and "\n" not in str(error.value)
    assert str(error.value).startswith("chat template: ")
    assert good.render_prompt(CONVERSATION[:2]) == expected  # a killed worker is replaced


def test_the_output_limit_is_checked_before_the_tokenizer_reads_the_text(monkeypatch, short_limits):
    source = "{{ 'a' * n }}"
    assert render_template(source, {"n": short_limits.output_chars}) == "a" * short_limits.output_chars
    with pytest.raises(ChatTemplateLimitError, match="output over"):
        render_template(source, {"n": short_limits.output_chars + 1})
    # a conversation's own text is capped as well (every format tokenizes all of it at once)
    long = [{"role": "user", "content": "a" * (chat_data.MAX_CHAT_TEXT_CHARS + 1)}]
    with pytest.raises(ChatFormatError, match="characters of text"):
        ByteTokenizer(chat=True).render_prompt(long)


def test_rendering_is_safe_from_many_threads_at_once(short_limits):
    """Concurrent calls (a server's thread pool) each get their own text; a looping template among
    them fails alone, after its time limit, and the others are not held up by it."""
    from concurrent.futures import ThreadPoolExecutor

    def render(index: int):
        if index == 5:
            source = NESTED_LOOPS.replace("BODY", "")
        else:
            source = "{% for m in messages %}{{ m.content }}|{% endfor %}" + str(index)
        context = {"messages": [{"role": "user", "content": f"message {index}"}], "add_generation_prompt": True}
        try:
            return render_template(source, context)
        except ChatTemplateLimitError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(render, range(24)))
    assert isinstance(results[5], ChatTemplateLimitError) and "longer than" in str(results[5])
    assert all(results[i] == f"message {i}|{i}" for i in range(24) if i != 5)


def test_a_looping_template_ends_chat_and_sft_with_one_line(tmp_path, short_limits, monkeypatch, capsys):
    import io

    from latentloop.api import build
    from latentloop.runs import save_run

    tok = HFTokenizer.from_pretrained_folder(_chatml_folder(tmp_path / "hf", NESTED_LOOPS.replace("BODY", "")))
    save_run(build("gpt", preset="test", vocab_size=tok.vocab_size, bos_id=tok.bos_id), tok, tmp_path / "run")
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main(["chat", str(tmp_path / "run")]) == 2
    assert main(["train", "--stage", "sft", "--init-from", str(tmp_path / "run"), "--data",
                 "chat:task:addition_steps:n=8", "--steps", "1", "--batch-size", "2", "--out", str(tmp_path / "sft"),
                 "--no-progress"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("latentloop: error")]
    assert len(err) == 2 and all("chat template: rendering took longer than 1 s" in line for line in err)


@pytest.mark.parametrize("render", ["text", "spans"])
def test_the_worker_stops_a_template_by_the_characters_it_writes(render):
    """A few very long pieces (each `{{ text }}` is one) pass the limit at once: the worker stops the
    template after the first piece past it, not the caller's check on a text already built."""
    limits = TemplateLimits(time_s=5.0, output_chars=1_000, memory_bytes=256 * 2**20)
    source = "{% for i in range(3) %}{{ messages[0]['content'] }}{% endfor %}"
    context = {"messages": [{"role": "user", "content": "a" * 4_000}, {"role": "assistant", "content": "b"}],
               "add_generation_prompt": False}
    with pytest.raises(ChatTemplateLimitError) as error:
        if render == "text":
            render_template(source, context, limits)
        else:
            chat_data.template_spans(source, context, limits)
    assert str(error.value) == ("chat template: output over 1,000 characters (limit): the renderer stopped it at "
                                "4,000 characters")


# -- templates that render no reply or an empty prompt ----------------------------------------------
# name: (template, words of the one-line error SFT and chat give, words import-hf gives)
NO_REPLY = "renders no assistant reply"
EMPTY_PROMPT = "renders the prompt as nothing"
EMPTY_TEMPLATES = {
    "nothing": ("{# nothing #}", NO_REPLY, NO_REPLY),
    "only newlines": ("{% for m in messages %}{{ '\n' }}{% endfor %}", NO_REPLY, NO_REPLY),
    "only the replies": ("{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content + '<|im_end|>' }}"
                         "{% endif %}{% endfor %}", EMPTY_PROMPT, EMPTY_PROMPT),
}


def _errors(capsys) -> list[str]:
    """stderr's lines, checked to hold no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("latentloop: error")]


@pytest.mark.parametrize("name", sorted(EMPTY_TEMPLATES))
def test_a_template_that_renders_no_reply_or_prompt_is_refused_by_import_sft_and_chat(tmp_path, name, capsys,
                                                                                         monkeypatch):
    import io

    from transformers import LlamaConfig, LlamaForCausalLM

    from latentloop.api import build
    from latentloop.runs import save_run

    template, words, import_words = EMPTY_TEMPLATES[name]
    named = chat_data.template_name(template)
    folder = _chatml_folder(tmp_path / "hf", template)
    tok = HFTokenizer.from_pretrained_folder(folder)
    config = LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    assert main(["import-hf", str(folder), "--out", str(tmp_path / "base")]) == 2
    assert not (tmp_path / "base").exists()
    [line] = _errors(capsys)
    assert import_words in line and named in line and str(folder) in line, line

    # a run folder that holds such a template anyway (written before the check, or by hand)
    save_run(build("gpt", preset="test", vocab_size=tok.vocab_size, bos_id=tok.bos_id), tok, tmp_path / "run")
    kept = sorted(p.relative_to(tmp_path / "run") for p in (tmp_path / "run").rglob("*"))
    if words == NO_REPLY:  # nothing to train on: SFT stops before writing anything
        assert main(["train", "--stage", "sft", "--init-from", str(tmp_path / "run"), "--data",
                     "chat:task:addition_steps:n=8", "--steps", "1", "--batch-size", "2", "--out",
                     str(tmp_path / "sft"), "--no-progress"]) == 2
        assert not (tmp_path / "sft").exists()
        [line] = _errors(capsys)
        assert words in line and named in line, line
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main(["chat", str(tmp_path / "run")]) == 2
    [line] = _errors(capsys)
    assert words in line and named in line, line
    assert sorted(p.relative_to(tmp_path / "run") for p in (tmp_path / "run").rglob("*")) == kept


def test_the_tokenizer_refuses_an_empty_render_with_one_line(tmp_path):
    tok = HFTokenizer.from_pretrained_folder(_chatml_folder(tmp_path / "nothing", "{# nothing #}"))
    with pytest.raises(chat_data.EmptyChatTemplateError, match=f"^the tokenizer's chat template '{{# nothing #}}' "
                                                                f"{NO_REPLY}"):
        tok.render(CONVERSATION)
    replies_only = EMPTY_TEMPLATES["only the replies"][0]
    tok = HFTokenizer.from_pretrained_folder(_chatml_folder(tmp_path / "replies", replies_only))
    ids, mask = tok.render(CONVERSATION)  # the replies alone can be trained on ...
    trained = [i for i, m in zip(ids, mask) if m]
    assert trained == tok.encode_markup("the loop<|im_end|>") + tok.encode_markup("carried forward<|im_end|>")
    with pytest.raises(chat_data.EmptyChatTemplateError, match=EMPTY_PROMPT):  # ... but there is no prompt to answer
        tok.render_prompt(CONVERSATION[:2])
    long = "{# " + "x" * 200 + " #}"
    assert chat_data.template_name(long) == repr(long[:chat_data.TEMPLATE_NAME_CHARS] + "...")


def test_chat_tokens_on_a_padded_vocabularys_rows_start_at_the_mean_of_the_tokenizers_rows(tmp_path):
    """A tokenizer without a template whose model pads its vocabulary past the tokenizer: SFT's chat
    tokens fall on padding rows that were never trained, and kept them, where the docs say a new
    token starts at the mean of the old rows (12-06 review)."""
    import torch
    from safetensors.torch import load_file
    from test_interop import _run

    from latentloop.cli import main
    from latentloop.data import HFTokenizer

    folder = _chatml_folder(tmp_path / "tok")
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    del settings["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    tokenizer = HFTokenizer.from_pretrained_folder(folder, vocab_size=320)  # rows past the tokenizer's ids
    _run(tmp_path / "run", tokenizer=tokenizer, vocab_size=320)
    chat = tmp_path / "c.jsonl"
    chat.write_text("".join(json.dumps({"question": f"{i}?", "answer": f"it is {i}"}) + "\n" for i in range(40)))
    assert main(["train", "--stage", "sft", "--init-from", str(tmp_path / "run"), "--set", "sequence_len=128",
                 "--data", f"chat:{chat}:question=user,answer=assistant", "--steps", "1", "--set", "train.lr=1e-12",
                 "--set", "train.muon_lr=1e-12", "--set", "eval_batches=1", "--out", str(tmp_path / "sft"),
                 "--no-progress"]) == 0
    before = load_file(str(next((tmp_path / "run" / "checkpoints").iterdir()) / "model.safetensors"))["wte.weight"]
    after = load_file(str(next((tmp_path / "sft" / "checkpoints").iterdir()) / "model.safetensors"))["wte.weight"]
    ids = list(tokenizer.with_chat_tokens().chat_tokens.ids)
    assert before.shape == after.shape and min(ids) >= tokenizer.own_size  # on the padding rows
    torch.testing.assert_close(after[ids], before[: min(ids)].mean(0).expand(len(ids), -1), rtol=0, atol=1e-6)


def test_a_template_refusing_one_conversation_names_it(tmp_path):
    """A template that refuses one conversation (`raise_exception`) ended SFT with the refusal alone,
    without the file and line a malformed row's error names (12-06 review)."""
    from latentloop.data.chat import prepare_chat

    refusing = ("{% if messages[0]['content'] == 'bad' %}{{ raise_exception('not this one') }}{% endif %}" + CHATML)
    tok = HFTokenizer.from_pretrained_folder(_chatml_folder(tmp_path / "tok", refusing))
    rows = [{"question": "bad" if i == 7 else f"q{i}", "answer": f"a{i}"} for i in range(30)]
    chat = tmp_path / "c.jsonl"
    chat.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ChatFormatError, match=rf"{chat}:8: the chat template refused the conversation: not this one"):
        prepare_chat(f"chat:{chat}:question=user,answer=assistant", tok, 64)


# Qwen3's way with earlier replies: their <think> block is dropped, so the conversation does not render
# as a growing prefix (no spans to mark)
THINK_DROPPING = ("{%- set ns = namespace(last=0) -%}{%- for m in messages -%}{%- if m['role'] == 'user' -%}"
                  "{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}{%- for m in messages -%}"
                  "{%- set c = m['content'] -%}{%- if m['role'] == 'assistant' and loop.index0 < ns.last -%}"
                  "{%- set c = c.split('</think>')[-1] -%}{%- endif -%}"
                  "{{ '<|im_start|>' + m['role'] + '\n' + c + '<|im_end|>\n' }}{%- endfor -%}"
                  "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}")


def test_a_chats_earlier_replies_are_marked_through_a_template_or_read_plain_where_it_rewrites_them(tmp_path):
    """fbt replays a chat's earlier replies fused (`prompt_written`); through a template that drops
    earlier turns' <think> (no growing prefix), the second turn ended `chat` and got a 500 from serve,
    where the prompt is to be read plain."""
    import latentloop as ll
    from latentloop.data.chat import prompt_written, render_conversation

    history = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "<think>hm</think>world"},
               {"role": "user", "content": "again"}]
    chatml = HFTokenizer.from_pretrained_folder(_chatml_folder(tmp_path / "chatml"))
    prompt = chatml.render_prompt(history)
    ids, mask = render_conversation(chatml, history[:2])  # what SFT trains: the reply's tokens marked
    assert prompt[:len(ids)] == ids and prompt_written(chatml, history, prompt)[:len(ids)] == mask and any(mask)
    dropping = HFTokenizer.from_pretrained_folder(_chatml_folder(tmp_path / "qwen3ish", THINK_DROPPING))
    prompt = dropping.render_prompt(history)
    assert prompt_written(dropping, history, prompt) == [False] * len(prompt)
    torch.manual_seed(0)
    model = ll.build("fbt", preset="test", vocab_size=dropping.vocab_size, bos_id=dropping.bos_id).eval()
    list(stream_reply(model, dropping, history, 3, temperature=0.0, compile=False))  # answers: no ChatFormatError


def test_a_reply_streams_as_decode_gives_it_so_it_encodes_back_to_the_generated_ids(tmp_path):
    """latentloop's chat format encodes each message alone: a SentencePiece-style tokenizer prepends
    "▁" to a reply ("▁the") and its decoding drops it. The streamed reply kept it (" the loop"), and
    `chat` and the server's clients sent that back as history: one more "▁" token than was generated."""
    from latentloop.serve.text import RowText
    from latentloop.util import TokenText, drops_prepended_space

    folder = _sentencepiece_folder(tmp_path / "sp")
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    del settings["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    tok = HFTokenizer.from_pretrained_folder(folder).with_chat_tokens()
    assert drops_prepended_space(tok) and not drops_prepended_space(ByteTokenizer(chat=True))
    conversation = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "the loop"}]
    ids, mask = tok.render(conversation)
    reply = [i for i, m in zip(ids, mask) if m and i != tok.chat_tokens.end]

    def streamed(decoder) -> str:
        return "".join(decoder.add(i) for i in reply) + decoder.finish()

    assert streamed(TokenText(tok, message_start=True)) == tok.decode(reply) == "the loop"
    assert streamed(TokenText(tok)) == " the loop"  # a completion continues a text: its space is the text's
    row = RowText(tok, {}, message_start=True)
    for i in reply:
        row.add(i)
    assert row.text == "the loop"
    follow_up = {"role": "user", "content": "again"}
    as_sent_back = [conversation[0], {"role": "assistant", "content": streamed(TokenText(tok, message_start=True))},
                    follow_up]
    assert tok.render_prompt(as_sent_back) == tok.render_prompt([*conversation, follow_up])
    # under a chat template the whole conversation is one text: a "▁" before a reply is a space the
    # model wrote, which the text keeps (dropping it re-encoded to other ids)
    from latentloop.data.chat import replies_encoded_alone

    templated = HFTokenizer.from_pretrained_folder(_sentencepiece_folder(tmp_path / "mistralish"))
    assert replies_encoded_alone(tok) and not replies_encoded_alone(templated)
