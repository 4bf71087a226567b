"""The conversation format: chat tokens, rendering and its mask, packing, chat files and their errors."""

from __future__ import annotations

import json
import re

import pytest
import torch

import latentloop
from latentloop.checkpoint import grow_vocab_rows, token_row_tensors
from latentloop.cli import main
from latentloop.data import BPETokenizer, ByteTokenizer, load_tokenizer
from latentloop.data.chat import (
    MAX_CHAT_TEXT_CHARS,
    ChatFormatError,
    ChatLoader,
    assistant_start,
    iter_conversations,
    iter_split_conversations,
    pack_conversations,
    parse_chat_spec,
    prepare_chat,
)
from latentloop.errors import ConfigError, DataError

CHAT = ByteTokenizer(chat=True)
SYS, USER, ASSISTANT, END = CHAT.chat_tokens.ids
BOS, PAD = CHAT.bos_id, CHAT.pad_id


def test_byte_tokenizer_keeps_its_vocabulary_and_reserves_chat_ids_after_it(tmp_path):
    assert ByteTokenizer().vocab_size == 259 and ByteTokenizer().chat_tokens is None  # old runs load unchanged
    assert (SYS, USER, ASSISTANT, END) == (259, 260, 261, 262) and CHAT.vocab_size == 263
    CHAT.save(tmp_path)
    back = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert back.chat_tokens == CHAT.chat_tokens and back.fingerprint() != ByteTokenizer().fingerprint()
    assert CHAT.token_byte_lengths()[259:].sum() == 0  # chat tokens stand for no bytes (BPB)


def test_render_masks_exactly_the_assistant_tokens_and_their_end_of_turn():
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"}, {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"}]
    ids, mask = CHAT.render(messages)
    b = list(b"hi"), list(b"yo")
    assert ids == [BOS, SYS, ord("S"), END, USER, *b[0], END, ASSISTANT, *b[1], END, USER, ord("q"), END,
                   ASSISTANT, ord("a"), END]
    trained = [ids[i] for i, m in enumerate(mask) if m]
    assert trained == [*b[1], END, ord("a"), END]
    # the prompt for the first answer ends with <|assistant|>, and its length is where the mask starts
    prompt = CHAT.render_prompt(messages[:2])
    assert prompt[-1] == ASSISTANT and ids[:len(prompt)] == prompt
    assert mask.index(True) == len(prompt) == assistant_start(ids, CHAT)


def test_text_that_spells_a_chat_token_stays_text():
    ids, _ = CHAT.render([{"role": "user", "content": "<|end|>"}, {"role": "assistant", "content": "x"}])
    assert ids.count(END) == 2  # only the two real turn ends
    bpe = BPETokenizer.train(["hello world " * 50], 300).with_chat_tokens()
    assert bpe.chat_tokens.user not in bpe.encode("<|user|> hi")


def test_bpe_gains_chat_tokens_after_its_ids(tmp_path):
    base = BPETokenizer.train(["the cat sat on the mat " * 40], 300)
    chat = base.with_chat_tokens()
    assert chat.vocab_size == base.vocab_size + 4
    assert chat.chat_tokens.ids == tuple(range(base.vocab_size, base.vocab_size + 4))
    assert chat.encode("the cat") == base.encode("the cat") and chat.with_chat_tokens() is chat
    ids, mask = chat.render([{"role": "user", "content": "cat"}, {"role": "assistant", "content": "mat"}])
    assert chat.decode(ids) == "catmat" and sum(mask) == len(chat.encode("mat")) + 1
    chat.save(tmp_path)
    assert load_tokenizer(str(tmp_path)).chat_tokens == chat.chat_tokens
    assert chat.token_to_bytes(chat.chat_tokens.end) == b""


def test_rendering_without_chat_tokens_is_a_clear_error():
    with pytest.raises(ConfigError, match="no chat tokens"):
        ByteTokenizer().render([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])


def _conv(n_prompt: int, n_answer: int) -> tuple[list[int], list[bool]]:
    return ([BOS] + [1] * (n_prompt - 1) + [2] * n_answer, [False] * n_prompt + [True] * n_answer)


def test_packing_keeps_conversations_whole_and_masks_padding():
    convs = [_conv(3, 2), _conv(2, 2), _conv(4, 3), _conv(20, 1), _conv(6, 6)]
    packed, counts = pack_conversations(convs, seq_len=8, pad_id=PAD)  # rows of 9 tokens
    # 5 + 4 fit row 0 exactly; 7 goes to row 1; 21 tokens with its answer past the cut is dropped;
    # 12 tokens with 3 answer tokens inside the first 9 is cut to 9 and starts row 2
    assert counts == {"conversations": 4, "rows": 3, "cut": 1, "dropped": 1, "trained_tokens": 2 + 2 + 3 + 3}
    assert packed.tokens[0].tolist() == convs[0][0] + convs[1][0]
    assert packed.tokens[1].tolist() == convs[2][0] + [PAD, PAD]
    assert packed.mask[1].tolist() == convs[2][1] + [False, False]
    assert packed.tokens[2].tolist() == convs[4][0][:9]
    assert packed.mask[2].tolist() == [False] * 6 + [True] * 3
    x, y, loss_mask = packed.batch(torch.tensor([0]).numpy())
    assert torch.equal(y, x.new_tensor(packed.tokens[0][1:])[None])
    assert loss_mask[0].tolist() == packed.mask[0][1:].tolist()  # target t counts iff token t+1 is trained
    assert all(row[0] == BOS for row in packed.tokens)  # every row starts a conversation


def test_chat_loader_resumes_in_the_same_order():
    convs = [([BOS, i, i], [False, True, True]) for i in range(12)]  # rows of 3: one conversation each
    packed, _ = pack_conversations(convs, seq_len=2, pad_id=PAD)
    a = ChatLoader(packed, batch_size=4, seed=3)
    seen = torch.cat([a.next_batch()[0][:, 1] for _ in range(3)])
    assert sorted(seen.tolist()) == list(range(12)) and seen.tolist() != list(range(12))  # one shuffled epoch
    b = ChatLoader(packed, batch_size=4, seed=3)
    b.load_state_dict(a.state_dict())
    assert all(torch.equal(u, v) for u, v in zip(a.next_batch(), b.next_batch()))


def test_question_answer_files_map_fields_to_roles(tmp_path):
    path = tmp_path / "qa.jsonl"
    rows = [{"question": f"q{i}", "answer": f"a{i} #### {i}"} for i in range(30)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = parse_chat_spec(f"chat:{path}:question=user,answer=assistant")
    conversations = list(iter_conversations(spec))
    assert conversations[0][1] == [{"role": "user", "content": "q0"}, {"role": "assistant", "content": "a0 #### 0"}]
    data = prepare_chat(f"chat:{path}:question=user,answer=assistant", CHAT, seq_len=64, val_fraction=0.2)
    assert data.meta["train"]["conversations"] + data.meta["val"]["conversations"] == 30
    assert data.val.mask.any() and data.meta["sha256"]["train"] == data.train.sha256()


def test_task_conversations():
    (key, messages), *_ = iter_conversations("chat:task:addition_steps:n=5")
    assert messages[0]["role"] == "user" and messages[0]["content"].endswith("=")
    assert ";" in messages[1]["content"]


def _user_turns(rows) -> list[str]:
    """The text of every user turn packed into these rows."""
    turns = []
    for row in rows.tokens.tolist():
        starts = [i for i, t in enumerate(row) if t == USER]
        for start in starts:
            end = row.index(END, start)
            turns.append(bytes(row[start + 1:end]).decode())
    return turns


def test_chat_file_split_does_not_depend_on_how_the_path_is_typed(tmp_path, monkeypatch):
    folder = tmp_path / "data"
    folder.mkdir()
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(400)]
    (folder / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(folder)
    specs = ["chat:c.jsonl", "chat:./c.jsonl", f"chat:{folder / 'c.jsonl'}", f"chat:{folder}/../data/c.jsonl"]
    splits = [prepare_chat(spec, CHAT, seq_len=64, val_fraction=0.05) for spec in specs]
    assert all(d.meta["sha256"] == splits[0].meta["sha256"] for d in splits[1:])
    # the same rows in a file of the same name elsewhere (a copy on another machine) split the same way
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "c.jsonl").write_text((folder / "c.jsonl").read_text())
    assert prepare_chat(f"chat:{other / 'c.jsonl'}", CHAT, 64, 0.05).meta["sha256"] == splits[0].meta["sha256"]


def test_chat_task_val_conversations_are_held_out_problems_never_trained_on():
    spec = "chat:task:addition:digits=2,n=2000"
    train = {m[0]["content"] for m in iter_split_conversations(spec, "train", 0.05)}
    val = [m[0]["content"] for m in iter_split_conversations(spec, "val", 0.05)]
    assert len(train) > 100 and val and not set(val) & train
    data = prepare_chat(spec, CHAT, seq_len=64, val_fraction=0.05)
    assert data.meta["train"]["conversations"] == 2000 and data.meta["val"]["conversations"] == len(val)
    assert sorted(_user_turns(data.val)) == sorted(val) and not set(_user_turns(data.train)) & set(val)


@pytest.mark.parametrize("line, message", [
    ('{"messages": [{"content": "hi"}]}', "no 'role'"),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', "unknown role"),
    # a tool call's turn: its arguments were dropped and the empty turn read as the whole reply
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "ok", "tool_calls": '
     '[{"id": "1", "type": "function"}]}]}', "has 'tool_calls': tool calls are not supported"),
    ('{"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "x"}]}', "empty user turn"),
    ('{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]}', "must be a string"),
    ('{"messages": [{"role": "assistant", "content": "x"}]}', "expected user"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant turn"),
    ('{"messages": "hello"}', "non-empty list"),
    ('[1, 2]', "expected a JSON object"),
    ('{"text": "hi"}', "no 'messages'"),
    ('not json', "invalid JSON"),
    # a number Python's JSON reader refuses (its int-to-str limit): it was a ValueError traceback
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "id": ' + "7" * 5000
     + "}", "unreadable JSON"),
    ("[" * 100_000, "unreadable JSON"),  # nested too deeply: a RecursionError traceback
    # half of a character: the tokenizer's encode raised UnicodeEncodeError
    (r'{"messages": [{"role": "user", "content": "a\ud800"}, {"role": "assistant", "content": "b"}]}',
     "lone surrogate"),
    ('{"messages": [{"role": "user", "content": "' + "a" * (MAX_CHAT_TEXT_CHARS + 1) + '"}, {"role": "assistant", '
     '"content": "b"}]}', "characters of text"),
], ids=lambda value: value[:40] if isinstance(value, str) else None)
def test_bad_chat_files_are_one_line_errors(tmp_path, capsys, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "ok"}]}\n'
                    + line + "\n")
    with pytest.raises(ChatFormatError, match=message) as error:
        list(iter_conversations(f"chat:{path}"))
    assert f"{path}:2" in str(error.value) and "\n" not in str(error.value)
    assert issubclass(ChatFormatError, DataError)
    # through the CLI: one line, exit 2 (a base run is not even needed to find out)
    base = tmp_path / "base"
    from latentloop.api import build
    from latentloop.runs import save_run

    save_run(build("gpt", preset="test"), ByteTokenizer(), base)
    code = main(["train", "--stage", "sft", "--init-from", str(base), "--data", f"chat:{path}", "--steps", "1",
                 "--out", str(tmp_path / "sft"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message.split()[0] in err


def test_bad_specs(tmp_path):
    with pytest.raises(DataError, match="not found"):
        parse_chat_spec("chat:/nope.jsonl")
    (tmp_path / "a.jsonl").write_text("")
    with pytest.raises(DataError, match="FIELD=ROLE"):
        parse_chat_spec(f"chat:{tmp_path / 'a.jsonl'}:question=robot")


def test_grown_vocabulary_rows_start_at_the_mean_and_old_rows_keep_their_ids():
    old = {"wte.weight": torch.randn(259, 8), "blocks.0.x": torch.randn(3)}
    own = {"wte.weight": torch.zeros(263, 8), "blocks.0.x": torch.zeros(3)}
    weights = dict(old)
    assert grow_vocab_rows(weights, own, {"wte.weight"}) == ["wte.weight"]
    grown = weights["wte.weight"]
    assert grown.shape == (263, 8) and torch.equal(grown[:259], old["wte.weight"])
    torch.testing.assert_close(grown[259:], old["wte.weight"].mean(0).expand(4, 8))


def test_every_tensor_with_a_row_per_token_grows_and_added_ids_inside_a_padded_vocabulary_start_at_the_mean():
    """lrt's value embeddings have a row per token id too: SFT from an lrt run with value_embeds was
    refused ("does not fit this model"), as only wte and lm_head grew. And chat ids that fall on a
    padded vocabulary's rows (never trained) kept those rows instead of the mean (12-06 review). The
    tensors are the model's embeddings of the vocabulary and its head, found by module: a weight whose
    rows merely number the vocabulary's is left alone."""
    lrt = latentloop.build("lrt", preset="test", value_embeds=True, tie_embeddings=False)
    names = token_row_tensors(lrt)
    assert {"wte.weight", "lm_head.weight"} < names and any("value_embed" in name for name in names)
    # its 64-wide weights have as many rows as its vocabulary has ids
    square = latentloop.build("gpt", preset="test", vocab_size=64, bos_id=0)
    assert token_row_tensors(square) == {"wte.weight"} | ({"lm_head.weight"} & set(square.state_dict()))
    old = {"wte.weight": torch.randn(259, 8), "lm_head.weight": torch.randn(259, 8),
           "blocks.0.attn.value_embed.weight": torch.randn(259, 4), "blocks.0.mlp.w": torch.randn(259, 259)}
    own = {"wte.weight": torch.zeros(263, 8), "lm_head.weight": torch.zeros(263, 8),
           "blocks.0.attn.value_embed.weight": torch.zeros(263, 4), "blocks.0.mlp.w": torch.zeros(259, 259)}
    tokens = {"wte.weight", "lm_head.weight", "blocks.0.attn.value_embed.weight"}
    weights = dict(old)
    assert grow_vocab_rows(weights, own, tokens) == sorted(tokens)
    assert torch.equal(weights["blocks.0.mlp.w"], old["blocks.0.mlp.w"])  # not a row per token: as it was
    torch.testing.assert_close(weights["blocks.0.attn.value_embed.weight"][259:],
                               old["blocks.0.attn.value_embed.weight"].mean(0).expand(4, 4))
    # a tokenizer of 299 ids, padded to 320 rows; a 320-row weight that is no token's beside it
    padded = {"wte.weight": torch.randn(320, 8), "blocks.0.mlp.w": torch.randn(320, 16)}
    grown = dict(padded)
    own = {name: torch.zeros_like(t) for name, t in padded.items()}
    assert grow_vocab_rows(grown, own, {"wte.weight"}, new_ids=[299, 300, 301, 302]) == ["wte.weight"]
    mean = padded["wte.weight"][:299].mean(0)
    torch.testing.assert_close(grown["wte.weight"][299:303], mean.expand(4, 8))
    assert torch.equal(grown["wte.weight"][:299], padded["wte.weight"][:299])
    assert torch.equal(grown["wte.weight"][303:], padded["wte.weight"][303:])
    assert torch.equal(grown["blocks.0.mlp.w"], padded["blocks.0.mlp.w"])


def test_sft_starts_from_an_lrt_run_with_value_embeddings(tmp_path):
    from latentloop.cli import main

    base = tmp_path / "base"
    assert main(["train", "--arch", "lrt", "--preset", "test", "--set", "value_embeds=true", "--data", "stdlib",
                 "--set", "data.max_bytes=200000", "--steps", "1", "--batch-size", "2", "--out", str(base),
                 "--no-progress"]) == 0
    assert main(["train", "--stage", "sft", "--init-from", str(base), "--data", "chat:task:addition",
                 "--steps", "1", "--batch-size", "2", "--set", "sequence_len=128", "--set", "eval_batches=1",
                 "--out", str(tmp_path / "sft"), "--no-progress"]) == 0


# -- the chat CLI -----------------------------------------------------------------------------------
@pytest.fixture
def chat_run(tmp_path):
    from latentloop.api import build
    from latentloop.runs import save_run

    torch.manual_seed(0)
    save_run(build("fbt", preset="test", vocab_size=CHAT.vocab_size), CHAT, tmp_path / "chat")
    return tmp_path / "chat"


def test_stream_reply_is_the_engine_continuation_of_the_rendered_prompt(chat_run):
    from latentloop import generate
    from latentloop.chat import chat_prompt, stream_reply
    from latentloop.runs import load_run

    model, tokenizer, _, _ = load_run(chat_run)
    messages = [{"role": "user", "content": "2+2="}]
    pieces = list(stream_reply(model, tokenizer, messages, 10, regime="soft"))
    ids = generate(model, tokenizer.render_prompt(messages), 10, temperature=0.0, regime="soft",
                   stop_tokens=[END, tokenizer.eos_id, BOS])
    assert "".join(pieces) == tokenizer.decode(ids)
    # a long history keeps its system turn and the newest exchanges
    history = [{"role": "system", "content": "S"}] + [{"role": r, "content": "x" * 10} for r in
                                                      ["user", "assistant"] * 5] + [{"role": "user", "content": "q"}]
    ids = chat_prompt(tokenizer, history, 40)
    assert len(ids) <= 40 and ids[:3] == [BOS, SYS, ord("S")] and ids[-4:] == [USER, ord("q"), END, ASSISTANT]


def test_a_chats_earlier_replies_reach_the_engine_as_the_models_own(chat_run, monkeypatch):
    """SFT fuses every assistant token of a conversation, earlier replies included; chat prefilled the
    history plain, so a second turn's reply read a history training never showed (fbt: +0.78
    nats/token on a two-turn task). The earlier reply's content and <|end|> are marked `written`."""
    from latentloop import chat
    from latentloop.data.chat import prompt_written
    from latentloop.runs import load_run

    model, tokenizer, _, _ = load_run(chat_run)
    messages = [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"},
                {"role": "user", "content": "3+3="}]
    prompt = tokenizer.render_prompt(messages)
    start = prompt.index(ASSISTANT) + 1  # the first reply's content
    written = prompt_written(tokenizer, messages, prompt)
    assert [i for i, w in enumerate(written) if w] == list(range(start, start + len(tokenizer.encode("4")) + 1))
    assert prompt[start + 1] == END
    assert prompt_written(tokenizer, messages[:1], tokenizer.render_prompt(messages[:1])) == \
        [False] * len(tokenizer.render_prompt(messages[:1]))  # a first turn: nothing the model wrote
    seen = []
    real_stream = chat.stream
    monkeypatch.setattr(chat, "stream", lambda *args, **kwargs: seen.append(kwargs["written"]) or
                        real_stream(*args, **kwargs))
    pieces = list(chat.stream_reply(model, tokenizer, messages, 8, regime="soft"))
    assert seen == [written]
    ids = latentloop.generate(model, prompt, 8, temperature=0.0, regime="soft", written=written,
                              stop_tokens=[END, tokenizer.eos_id, BOS])
    assert "".join(pieces) == tokenizer.decode(ids)


def test_scripted_chat_session(chat_run, monkeypatch, capsys):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n/reset\n\n/what\n/quit now\nagain\n"))  # EOF ends it
    assert main(["chat", str(chat_run), "--max-new-tokens", "5", "--regime", "fused", "--passes", "2"]) == 0
    out, err = capsys.readouterr()
    assert out.count("> ") == 7 and "[new conversation]" in out
    assert "unknown command /what" in err
    assert "[/quit takes no argument: " in err  # it said "unknown command /quit" of a command it knows
    monkeypatch.setattr("sys.stdin", io.StringIO("/quit\nnever read\n"))
    assert main(["chat", str(chat_run)]) == 0
    assert capsys.readouterr().out == "> "


def test_chat_mistakes_are_one_line(chat_run, tmp_path, capsys):
    from latentloop.api import build
    from latentloop.runs import save_run

    save_run(build("gpt", preset="test"), ByteTokenizer(), tmp_path / "base")
    assert main(["chat", str(tmp_path / "base")]) == 2  # no chat tokens
    assert main(["chat", str(chat_run), "--steps", "2"]) == 2  # an rgpt option on an fbt run
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "no chat tokens" in err[0]
    # a cache dtype the decoding would not use: refused at every message, and the session ended with 0
    assert main(["chat", str(chat_run), "--kv-dtype", "float16", "--decode", "eager"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "compiled step's cache" in err[0]


def test_chat_sends_bytes_that_are_not_utf8_as_replacement_characters(chat_run, monkeypatch, capsys):
    """A stray byte in typed or piped input (Latin-1 text, a cut character) was a UnicodeEncodeError
    traceback; it is replaced by U+FFFD, as a terminal shows it, the user is told, and the turn goes on."""
    import io

    from latentloop.engine import PromptError

    seen = []

    def reply(model, tokenizer, messages, *args, **kwargs):
        seen.append(messages[-1]["content"])
        tokenizer.render_prompt(messages)  # what failed: the text's ids
        raise PromptError("stop here")

    monkeypatch.setattr("latentloop.chat.stream_reply", reply)
    for stdin in (io.TextIOWrapper(io.BytesIO(b"h\xffi\n"), encoding="utf-8", errors="surrogateescape"),  # a real stdin
                  io.StringIO("h\udcffi\n")):  # a text stream with the byte escaped
        monkeypatch.setattr("sys.stdin", stdin)
        assert main(["chat", str(chat_run), "--max-new-tokens", "2"]) == 0
        assert "not valid text" in capsys.readouterr().err
    assert seen == ["h\ufffdi", "h\ufffdi"]


@pytest.mark.parametrize("flags", [["--temperature", "nan"], ["--temperature", "inf"], ["--temperature", "-1"],
                                   ["--seed", "-3"], ["--max-new-tokens", "1000"], ["--system", "x" * 300],
                                   ["--system", "h\udcffi"]])  # a budget past the context, a system turn
def test_chat_with_a_bad_setting_exits_2_before_reading(chat_run, monkeypatch, capsys, flags):  # too long / not text
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main(["chat", str(chat_run), *flags]) == 2  # it printed the message per turn and exited 0
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("latentloop: error:")


def test_a_system_message_that_is_not_utf8_names_the_byte_not_a_surrogate(chat_run, monkeypatch, capsys):
    """A shell's non-UTF-8 byte reaches Python as a lone surrogate ("surrogateescape"): the refusal
    spoke of escapes such as \\ud800 the user never wrote. It names the byte now."""
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main(["chat", str(chat_run), "--system", "h\udcffi"]) == 2  # what $'h\xffi' arrives as
    err = capsys.readouterr().err
    assert "--system is not valid UTF-8 text (byte 0xff at character 2)" in err and "surrogate" not in err


def test_a_message_over_the_text_limit_keeps_the_chat_session(chat_run):
    from latentloop.chat import chat_prompt
    from latentloop.engine import PromptError

    history = [{"role": "user", "content": "x" * 50}, {"role": "assistant", "content": "y" * 50},
               {"role": "user", "content": "z" * MAX_CHAT_TEXT_CHARS}]
    assert chat_prompt(CHAT, history[2:3], 10**7)[-1] == ASSISTANT  # at the limit: rendered
    history[2]["content"] += "z"
    with pytest.raises(PromptError, match="characters a conversation may hold"):  # a PromptError: the session stays
        chat_prompt(CHAT, history, 10**7)


@pytest.mark.parametrize("messages, words", [
    (["hello"], "message 0 must be an object with 'role' and 'content', got str 'hello'"),
    ("hello", "'messages' must be a non-empty list, got str 'hello'"),
    (None, "'messages' must be a non-empty list, got NoneType None"),
])
def test_messages_that_are_not_a_list_of_objects_are_one_line_errors_before_the_prompt_is_fitted(messages, words):
    """`chat_prompt` / `stream_reply` read the first message's role before the messages were checked:
    an AttributeError or TypeError traceback, where the format's own check has one line."""
    from latentloop.chat import chat_prompt

    with pytest.raises(ChatFormatError, match=re.escape(words)):
        chat_prompt(CHAT, messages, 10**7)


def test_openai_content_parts_are_their_text_and_other_parts_are_refused():
    """OpenAI clients may send a message's content as a list of parts: the text parts stand for
    their text, joined by newlines (vLLM's rule); an image part is one clear error. The list was
    refused as "'content' must be a string"."""
    from latentloop.data.chat import ChatFormatError, check_messages

    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
    assert check_messages(parts, for_training=False) == [{"role": "user", "content": "hi\nthere"}]
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    for content, words in [(image, "content part 0 is of type 'image_url'"),
                           ([{"type": "text", "text": 5}], "content part 0's 'text' must be a string"),
                           (["hi"], "content part 0 is str 'hi'"),
                           ([], "empty user turn")]:
        with pytest.raises(ChatFormatError, match=re.escape(words)):
            check_messages([{"role": "user", "content": content}], for_training=False)


def test_a_reply_budget_that_leaves_no_room_for_a_message_exits_2_before_reading(chat_run, monkeypatch, capsys):
    """Without --system the start was not checked: a budget of the context less one was taken, and
    every message was then refused, the session ending with exit 0."""
    import io

    from latentloop.runs import load_run

    context = load_run(chat_run)[0].config.sequence_len
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    assert main(["chat", str(chat_run), "--max-new-tokens", str(context - 1)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "the chat format takes" in err
    least = len(CHAT.render_prompt([{"role": "user", "content": "?"}]))
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["chat", str(chat_run), "--max-new-tokens", str(context - least)]) == 0  # just room: taken


def test_a_seeded_chat_draws_each_turn_with_a_seed_of_its_own_and_replays(chat_run, monkeypatch, capsys):
    """One seed for every turn gave two different messages the same draws (a sampled reply repeated)."""
    import io

    seeds = []

    def reply(model, tokenizer, messages, budget, seed=None, **kwargs):
        seeds.append(seed)
        yield "ok"

    monkeypatch.setattr("latentloop.chat.stream_reply", reply)
    for _ in range(2):
        monkeypatch.setattr("sys.stdin", io.StringIO("one\ntwo\n/reset\nthree\n"))
        assert main(["chat", str(chat_run), "--temperature", "0.9", "--seed", "7"]) == 0
    assert seeds == [7, 8, 9] * 2  # a seed per turn, the same session replayed alike
    seeds.clear()
    monkeypatch.setattr("sys.stdin", io.StringIO("one\ntwo\n"))
    assert main(["chat", str(chat_run), "--temperature", "0.9"]) == 0
    assert seeds == [None, None]  # unseeded stays unseeded


def test_chat_with_stdin_closed_ends_as_at_the_end_of_input(chat_run, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", None)  # `latentloop chat RUN <&-`: an AttributeError traceback
    assert main(["chat", str(chat_run)]) == 0
    assert capsys.readouterr().out == "> \n"


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_reader_that_goes_away_ends_the_command_quietly(chat_run, command):
    """`latentloop generate RUN ... | head -c 5` ended in a BrokenPipeError traceback."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", "latentloop", command, str(chat_run), "--max-new-tokens", "8", "--decode", "eager"]
    if command == "generate":
        argv += ["--prompt", "hello"]
    process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()  # the reader is gone before the first byte
    _, err = process.communicate(b"hello\n", timeout=120)
    assert b"Traceback" not in err and b"Exception ignored" not in err, err.decode()
    assert process.returncode == 141  # as a shell reports a writer ended by SIGPIPE


def test_a_chat_format_that_refuses_the_first_message_says_so_without_blaming_system():
    """The start check runs without --system too; a refusal of the format blamed a --system never given."""
    from latentloop.cli.decoding import _check_chat_start
    from latentloop.data.chat import ChatFormatError
    from latentloop.errors import LatentloopError

    class Refusing:
        def render_prompt(self, messages):
            raise ChatFormatError("a system turn must come first")

    with pytest.raises(LatentloopError, match="^the chat format refuses a first message: a system turn"):
        _check_chat_start(Refusing(), [], 8, 64)
    with pytest.raises(LatentloopError, match="^--system is not a usable system message"):
        _check_chat_start(Refusing(), [{"role": "system", "content": "x"}], 8, 64)


def test_ctrl_c_during_a_reply_stops_the_reply_not_the_session(chat_run, monkeypatch, capsys):
    """Ctrl+C while a reply streams ended the whole session (exit 130, the conversation lost): it
    stops that reply, which is kept as far as it went, and the session goes on."""
    import io

    sent: list[list[dict]] = []

    def reply(model, tokenizer, messages, budget, **kwargs):
        sent.append([dict(m) for m in messages])
        yield "partial"
        if len(sent) == 1:
            raise KeyboardInterrupt  # the user's Ctrl+C, between two pieces

    monkeypatch.setattr("latentloop.chat.stream_reply", reply)
    monkeypatch.setattr("sys.stdin", io.StringIO("one\ntwo\n"))
    assert main(["chat", str(chat_run)]) == 0
    captured = capsys.readouterr()
    assert "[stopped: the reply so far is kept" in captured.err
    assert [m["content"] for m in sent[1]] == ["one", "partial", "two"]


def test_a_conversation_held_twice_goes_to_one_split_and_a_row_added_above_moves_none(tmp_path):
    """A file's split was keyed by its name and line number: the copies of a conversation a dataset holds
    twice went to train and val alike (val scored what was trained on), and a row added at the top moved
    every later conversation's split. Keyed by the messages now."""
    rows = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(200)]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows + rows))  # every conversation twice
    train = [m[0]["content"] for m in iter_split_conversations(f"chat:{path}", "train", 0.2)]
    val = [m[0]["content"] for m in iter_split_conversations(f"chat:{path}", "val", 0.2)]
    assert val and train and not set(val) & set(train)
    assert len(train) + len(val) == 400 and all(train.count(q) == 2 for q in set(train))
    added = tmp_path / "added.jsonl"
    extra = {"messages": [{"role": "user", "content": "new"}, {"role": "assistant", "content": "row"}]}
    added.write_text("".join(json.dumps(row) + "\n" for row in [extra] + rows))
    moved_val = [m[0]["content"] for m in iter_split_conversations(f"chat:{added}", "val", 0.2)]
    assert [q for q in moved_val if q != "new"] == sorted(set(val), key=val.index)


def test_an_empty_tool_calls_list_is_no_tool_call():
    """Clients and datasets with a list-typed tool_calls column write [] on every turn without a call: such a
    turn was refused as a tool call (its mere key)."""
    from latentloop.data.chat import check_messages

    messages = [{"role": "user", "content": "hi", "tool_call_id": None},
                {"role": "assistant", "content": "yo", "tool_calls": []}, {"role": "user", "content": "and"}]
    assert [m["content"] for m in check_messages(messages, for_training=False)] == ["hi", "yo", "and"]
    with pytest.raises(ChatFormatError, match="tool calls are not supported"):
        check_messages([{**messages[0], "tool_call_id": "call_1"}], for_training=False)
