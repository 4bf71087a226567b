"""Weights on transparent huge pages (`latentloop.inference.huge_pages`): which tensors move, that
they keep their objects and values, that the kernel was asked for huge pages, the off switches, and
that the compiled decode step moves them before it binds them and still decodes the eager tokens."""

from pathlib import Path

import pytest
import torch
from torch import nn

import latentloop as ll
from latentloop.inference import huge_pages
from latentloop.inference.fast import FastDecoder

needs_huge_pages = pytest.mark.skipif(huge_pages.huge_pages_status() is not None,
                                      reason=f"no huge pages here: {huge_pages.huge_pages_status()}")


class Tied(nn.Module):
    """A large weight used twice (tied), a large one, a small one and a large buffer."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(1024, 1024, bias=False)  # 4 MiB
        self.second = nn.Linear(1024, 1024, bias=False)
        self.second.weight = self.first.weight  # tied: one Parameter
        self.large = nn.Linear(1024, 768, bias=False)  # 3 MiB
        self.small = nn.Linear(64, 64)  # below a huge page
        self.register_buffer("table", torch.randn(2048, 512))  # 4 MiB


def thp_eligible(tensor: torch.Tensor) -> bool:
    """Whether the kernel may back `tensor`'s memory with huge pages (its mapping's THPeligible in smaps)."""
    address, current = tensor.data_ptr(), None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(part, 16) for part in head.split("-"))
            current = start <= address < end
        elif current and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    raise AssertionError("no mapping holds the tensor")


@needs_huge_pages
def test_large_weights_move_keeping_their_objects_and_values():
    torch.manual_seed(0)
    model = Tied()
    before = {name: (tensor, tensor.detach().clone(), tensor.data_ptr())
              for name, tensor in [*model.named_parameters(), *model.named_buffers()]}
    moved = huge_pages.weights_on_huge_pages(model)
    assert moved == (1024 * 1024 + 1024 * 768 + 2048 * 512) * 4  # the tied weight once, the small one not
    moved_tensors = [model.first.weight, model.large.weight, model.table]  # one mapping, a storage each
    assert len({t.untyped_storage().data_ptr() for t in moved_tensors}) == 3
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        kept, values, pointer = before[name]
        assert tensor is kept and torch.equal(tensor, values)
        assert (tensor.data_ptr() != pointer) is (tensor.nbytes >= huge_pages.MIN_TENSOR_BYTES), name
        if tensor.nbytes >= huge_pages.MIN_TENSOR_BYTES:
            assert thp_eligible(tensor), name
    assert model.second.weight is model.first.weight
    assert isinstance(model.first.weight, nn.Parameter) and model.first.weight.requires_grad
    assert huge_pages.weights_on_huge_pages(model) == 0  # once per model: a step bound to them keeps them
    # each tensor has a mapping of its own: a checkpoint of the moved model saves as usual
    safetensors = pytest.importorskip("safetensors.torch")
    safetensors.save(model.state_dict() | {"second.weight": model.first.weight.detach().clone()})


@needs_huge_pages
def test_weights_moved_inside_inference_mode_still_train():
    """The engine builds its decoders inside inference mode: the moved weights must stay ordinary
    tensors, or the model cannot train after a compiled generate."""
    torch.manual_seed(0)
    model = Tied()
    with torch.inference_mode():
        assert huge_pages.weights_on_huge_pages(model) > 0
    assert not any(t.is_inference() for t in [*model.parameters(), *model.buffers()])
    x = torch.randn(2, 1024)
    (model.large(model.second(model.first(x))).square().mean() + model.table.sum() * 0).backward()
    assert model.first.weight.grad is not None and model.large.weight.grad.abs().sum() > 0


@needs_huge_pages
def test_a_model_built_inside_inference_mode_still_runs_after_its_weights_move():
    """`with torch.inference_mode(): model = ...; generate(...)`: its weights are inference tensors,
    and an ordinary copy under them failed the next forward ("Inference tensors do not track version
    counter"; the decode-profile benchmark builds its model so)."""
    torch.manual_seed(0)
    x = torch.randn(2, 1024)
    with torch.inference_mode():
        model = Tied()
        before = model.large(model.second(model.first(x)))
        assert huge_pages.weights_on_huge_pages(model) > 0
        torch.testing.assert_close(model.large(model.second(model.first(x))), before, rtol=0, atol=0)


@needs_huge_pages
def test_weights_of_both_kinds_keep_their_kind_when_they_move():
    """One weight made inside inference mode beside ordinary ones: each copy is of its weight's kind
    (one mode for all would turn the ordinary ones into inference tensors, which cannot train), and
    grad mode is as it was after the move."""
    torch.manual_seed(0)
    model = Tied()
    with torch.inference_mode():
        model.large.weight = nn.Parameter(torch.randn(768, 1024), requires_grad=False)
    kinds = {name: t.is_inference() for name, t in [*model.named_parameters(), *model.named_buffers()]}
    assert huge_pages.weights_on_huge_pages(model) > 0 and torch.is_grad_enabled()
    assert {name: t.is_inference() for name, t in [*model.named_parameters(), *model.named_buffers()]} == kinds
    model.first(torch.randn(2, 1024)).square().mean().backward()
    assert model.first.weight.grad is not None
    with torch.inference_mode():
        assert torch.isfinite(model.large(torch.randn(2, 1024))).all()


@needs_huge_pages
def test_a_refused_map_leaves_the_weights_where_they_are(monkeypatch):
    model = Tied()
    pointer = model.first.weight.data_ptr()

    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(huge_pages.mmap, "mmap", refuse)
    assert huge_pages.weights_on_huge_pages(model) == 0 and model.first.weight.data_ptr() == pointer
    assert getattr(model, huge_pages.MOVED_MARK, None) is None  # a later call may try again


def test_a_model_whose_weights_do_not_fill_a_huge_page_stays_where_it_is():
    model = ll.build("gpt", preset="test")  # about 0.1M parameters
    pointers = [p.data_ptr() for p in model.parameters()]
    assert huge_pages.weights_on_huge_pages(model) == 0
    assert [p.data_ptr() for p in model.parameters()] == pointers


def test_the_off_switches_say_why_and_move_nothing(monkeypatch, tmp_path):
    model = Tied()
    pointer = model.first.weight.data_ptr()
    monkeypatch.setenv(huge_pages.HUGE_PAGES_ENV, "0")
    assert huge_pages.huge_pages_status() == "turned off (LATENTLOOP_HUGE_PAGES=0)"
    assert huge_pages.weights_on_huge_pages(model) == 0 and model.first.weight.data_ptr() == pointer
    monkeypatch.delenv(huge_pages.HUGE_PAGES_ENV)
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "THP_SETTING", setting)
    assert "transparent huge pages are off" in huge_pages.huge_pages_status()
    monkeypatch.setattr(huge_pages, "THP_SETTING", tmp_path / "missing")
    assert huge_pages.huge_pages_status().startswith("cannot read")
    assert huge_pages.weights_on_huge_pages(model) == 0 and model.first.weight.data_ptr() == pointer


def wide_gpt():
    torch.manual_seed(0)  # 2 layers x d 512: each MLP weight 4 MiB, on huge pages once moved
    return ll.build("gpt", preset="test", n_embd=512, n_head=8).eval()


@needs_huge_pages
@pytest.mark.parametrize("compile", [True, False])
def test_the_compiled_decoder_moves_the_weights_before_binding_them(compile):
    """A compiled decoder on the CPU moves them when it is made (before any step binds them); an eager
    one leaves them."""
    model = wide_gpt()
    pointer = model.blocks[0].mlp.c_fc.weight.data_ptr()
    FastDecoder(model, compile=compile)
    assert (getattr(model, huge_pages.MOVED_MARK, None) is not None) is compile
    assert (model.blocks[0].mlp.c_fc.weight.data_ptr() != pointer) is compile


@pytest.mark.slow
@needs_huge_pages
def test_a_compiled_decode_over_moved_weights_gives_the_eager_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model = wide_gpt()
    prompt = [256, 5, 9, 12, 40, 41]
    eager = ll.generate(model, prompt, 16, temperature=0.0, compile=False)
    assert getattr(model, huge_pages.MOVED_MARK, None) is None
    compiled = ll.generate(model, prompt, 16, temperature=0.0, compile=True)
    assert getattr(model, huge_pages.MOVED_MARK) > 0
    assert compiled == eager
