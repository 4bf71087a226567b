"""torch's private interfaces are called from one module, on tested torch versions only; elsewhere every
caller takes a public path and decodes the same tokens."""

import re
from pathlib import Path

import pytest
import torch

import latentloop as ll
from latentloop.inference import aot, products, torch_internals

PACKAGE = Path(ll.__file__).resolve().parent
# torch's private namespaces: `torch._C`, underscore-named ops and torch's underscore modules
PRIVATE = re.compile(r"torch\._C\b|torch\.ops\.mkldnn\._|torch\.utils\._|prims\.inductor_force_stride_order"
                     r"|_inductor\.compile_fx|torch\._C\._aoti")


def test_no_private_torch_call_outside_the_one_module():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "torch_internals.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            code = line.split("#", 1)[0]
            if PRIVATE.search(code) and not code.strip().startswith(('"', "'")):
                offenders.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert not offenders, "private torch calls belong in inference/torch_internals.py:\n" + "\n".join(offenders)


def test_the_version_check_reads_torchs_major_and_minor(monkeypatch):
    monkeypatch.delenv(torch_internals.INTERNALS_ENV, raising=False)
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    assert torch_internals.torch_version() == (2, 13) and torch_internals.tested()
    monkeypatch.setattr(torch, "__version__", "2.14.1")
    assert not torch_internals.tested() and "2.14.1" in torch_internals.untested_reason()
    monkeypatch.setenv(torch_internals.INTERNALS_ENV, "1")
    assert torch_internals.tested()
    monkeypatch.setattr(torch, "__version__", "2.13.0")
    monkeypatch.setenv(torch_internals.INTERNALS_ENV, "0")
    assert not torch_internals.tested() and "turned off" in torch_internals.untested_reason()


def test_on_an_untested_torch_every_caller_takes_the_public_path(monkeypatch):
    """The internals off (as on an untested torch): oneDNN and the stride prim are not called, the
    ahead-of-time step refuses with the reason, and the compiled decode (dynamo with stock inductor)
    still gives the eager tokens."""
    monkeypatch.setenv(torch_internals.INTERNALS_ENV, "0")
    assert torch_internals.onednn_linear(torch.ones(8, 4), torch.ones(3, 4), None) is None
    stored = torch.randn(3, 4)
    assert torch_internals.force_stride_order(stored) is stored
    torch.manual_seed(0)
    model = ll.build("gpt", preset="test").eval()
    assert "turned off" in aot.AotDecodeStep.refuses(model)
    x = torch.randn(200, 64)
    with torch.no_grad():
        torch.testing.assert_close(products.accelerated_linear(x, model.lm_head.weight),
                                   torch.nn.functional.linear(x, model.lm_head.weight), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_on_an_untested_torch_compiled_decoding_gives_the_eager_tokens(monkeypatch, tmp_path):
    monkeypatch.setenv(torch_internals.INTERNALS_ENV, "0")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch.manual_seed(0)
    model = ll.build("gpt", preset="test").eval()
    prompt = torch.randint(0, 256, (1, 8))
    eager = ll.generate(model, prompt, 12, temperature=0.0, compile=False)
    assert ll.generate(model, prompt, 12, temperature=0.0, compile=True) == eager
