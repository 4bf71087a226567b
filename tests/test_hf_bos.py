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

import latentloop as ll
from latentloop.cli import main
from latentloop.data import HFTokenizer, load_tokenizer
from latentloop.data.chat import render_conversation, render_prompt
from latentloop.eval import core
from latentloop.eval.lm_eval_adapter import LatentloopLM
from latentloop.interop import export_hf
from latentloop.serve.limits import Limits
from latentloop.serve.protocol import completion_prompts

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
RANDOM_SCALE = 0.1  # norm gains and biases perturbed from their init, so that they matter
WEIGHT_SCALE = 10.0  # transformers' 0.02 init makes greedy decoding repeat one token; this gives varied ones
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
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * RANDOM_SCALE)
            else:
                p.mul_(WEIGHT_SCALE)
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
