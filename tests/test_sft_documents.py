"""SFT evaluation's documents are the packed conversations: the packing records where each starts in
its row (`PackedRows.starts`) and `row_documents` numbers the targets by those starts. It counted a new
conversation only at a BOS target, which a ChatML conversation of a tokenizer that puts no BOS before
it (an imported Qwen2 instruct model's) does not have: 4 conversations packed into 2 rows counted as 2,
and the per-document intervals merged conversations (12-06 review)."""

from __future__ import annotations

import json

import pytest
import torch

import latentloop as ll
from latentloop.cli import main
from latentloop.config import DataConfig, RunConfig
from latentloop.data import ByteTokenizer, HFTokenizer
from latentloop.data.chat import masked_batches, pack_conversations, prepare_chat
from latentloop.eval.loss import row_documents
from latentloop.runs import save_run

tokenizers = pytest.importorskip("tokenizers")

# ChatML as Qwen2 instruct writes it: no BOS, every turn opened by <|im_start|> and closed by <|im_end|>
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
ENDOFTEXT, IM_START, IM_END = 0, 1, 2
SEQUENCE_LEN = 64
VAL_FRACTION = 0.5  # a few conversations of a small file in each split


def _chatml_tokenizer() -> HFTokenizer:
    """A small byte-level BPE with Qwen2's special tokens and ChatML: `<|endoftext|>` separates
    latentloop's documents (BOS) and pads; no post-processor, so nothing goes before a conversation."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["hello world, the loop carries state forward " * 20], trainer=trainer)
    tok = HFTokenizer(bpe.to_str(), ENDOFTEXT, IM_END, ENDOFTEXT, chat_template=CHATML)
    assert not tok.adds_bos
    return tok


def _conversations(tokenizer, count: int = 4) -> list[tuple[list[int], list[bool]]]:
    return [tokenizer.render([{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)}])
            for a, b in ((1, 2), (13, 4), (7, 70), (5, 555))[:count]]


def _documents(rows, tokenizer, starts) -> tuple[torch.Tensor, torch.Tensor]:
    """(documents, mask) of every target of the rows, through `masked_batches` in batches of one row."""
    batches = list(row_documents(masked_batches(rows, 1), tokenizer.bos_id, starts))
    return torch.cat([b[3] for b in batches]), torch.cat([b[2] for b in batches])


def test_four_chatml_conversations_without_bos_in_two_rows_are_four_documents():
    tok = _chatml_tokenizer()
    conversations = _conversations(tok)
    assert all(ids[0] == IM_START and tok.bos_id not in ids for ids, _ in conversations)
    lengths = [len(ids) for ids, _ in conversations]
    width = max(lengths[0] + lengths[1], lengths[2] + lengths[3])  # two conversations to a row
    assert width < min(lengths) * 3
    rows, counts = pack_conversations(conversations, width - 1, tok.pad_id)
    assert (counts["conversations"], counts["rows"]) == (4, 2)
    assert rows.starts.tolist() == [[i in (0, lengths[0]) for i in range(width)],
                                    [i in (0, lengths[2]) for i in range(width)]]
    documents, mask = _documents(rows, tok, rows.starts)
    counted = documents[mask]
    assert len(torch.unique(counted)) == 4
    # each document's trained targets are one conversation's: its reply and end of turn
    per_document = [int((counted == d).sum()) for d in torch.unique(counted, sorted=True)]
    assert per_document == [sum(trained) for _, trained in conversations]
    assert not set(documents[0].tolist()) & set(documents[1].tolist())  # rows never share a document


def test_conversations_that_start_with_bos_are_the_same_documents_by_starts_or_by_bos():
    """latentloop's own format starts each conversation with BOS: the recorded starts give the
    documents BOS gave (rows built without starts, as before, are still told by BOS)."""
    chat = ByteTokenizer(chat=True)
    conversations = _conversations(chat)
    assert all(ids[0] == chat.bos_id for ids, _ in conversations)
    rows, counts = pack_conversations(conversations, 2 * len(conversations[-1][0]), chat.pad_id)
    assert counts["rows"] < counts["conversations"] == 4
    by_starts, mask = _documents(rows, chat, rows.starts)
    by_bos, _ = _documents(rows, chat, None)
    assert torch.equal(by_starts, by_bos) and len(torch.unique(by_starts[mask])) == 4


def test_eval_of_chat_data_counts_each_conversation_a_document(tmp_path, capsys):
    """`latentloop eval --data chat:FILE` of a run with a ChatML tokenizer without BOS: "documents" is
    the number of conversations scored, not of rows."""
    tok = _chatml_tokenizer()
    torch.manual_seed(0)
    model = ll.build("gpt", preset="test", vocab_size=tok.vocab_size, bos_id=tok.bos_id, sequence_len=SEQUENCE_LEN)
    config = RunConfig(model=model.config, data=DataConfig(val_fraction=VAL_FRACTION))
    run = save_run(model, tok, tmp_path / "run", config).parents[1]
    lines = [json.dumps({"messages": [{"role": "user", "content": f"{a}+{a}="},
                                      {"role": "assistant", "content": str(2 * a)}]}) for a in range(24)]
    (tmp_path / "chat.jsonl").write_text("\n".join(lines) + "\n")
    spec = f"chat:{tmp_path / 'chat.jsonl'}"
    data = prepare_chat(spec, tok, SEQUENCE_LEN, VAL_FRACTION)
    rows, conversations = data.val.tokens, data.meta["val"]["conversations"]
    assert data.meta["val"]["cut"] == data.meta["val"]["dropped"] == 0
    assert conversations == int((rows == IM_START).sum()) // 2 > len(rows)  # packed: several to a row
    capsys.readouterr()
    assert main(["eval", str(run), "--data", spec, "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["documents"] == conversations
