"""The memory plan applied in the training process: a block's forward wrapped in a
non-reentrant checkpoint and taken back, the reasons a block is not wrapped, a step's peak,
the budget of ``auto``."""

from __future__ import annotations

import types

import pytest
import torch

from collectors.memory.plan.apply import StepPeak, auto_budget, known_tensors, parse_spec, why_not_wrap, wrap


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 32)
        self.down = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + scale * self.down(torch.nn.functional.gelu(self.up(x)))


def test_wrap_recomputes_the_same_gradients_and_undo_puts_the_forward_back():
    # GIVEN a block, a copy of it, and an input
    torch.manual_seed(0)
    a, b = Block(), Block()
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, 8)

    # WHEN one is wrapped and both run forward and backward, with a keyword argument
    w = wrap("b", b)
    a(x, scale=0.5).sum().backward()
    out = b(x, scale=0.5)
    out.sum().backward()

    # THEN the wrapped one went through torch.utils.checkpoint and got the same gradients, bit for bit
    assert "CheckpointFunction" in str(out.grad_fn) or out.grad_fn is not None
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))
    assert why_not_wrap("b", b) == "block b is already checkpointed by dynprof"
    # AND undo puts the class's forward back; a second undo does nothing
    assert w.undo() is True and "forward" not in b.__dict__ and w.undo() is False


def test_undo_restores_a_framework_s_own_forward_attribute():
    block = Block()
    own = block.forward
    block.forward = own  # an instance attribute, as accelerate's hooks put there
    w = wrap("b", block)
    assert block.forward is not own
    assert w.undo() and block.__dict__["forward"] is own


def test_without_grad_the_original_forward_runs():
    block = Block()
    wrap("b", block)
    with torch.no_grad():
        out = block(torch.randn(2, 8))
    assert out.grad_fn is None


def test_why_a_block_is_not_wrapped():
    import torch.utils.checkpoint as cp

    # GIVEN blocks checkpointed in each form, compiled, and a model keeping a cache
    recipe = Block()
    fwd = recipe.forward
    recipe.forward = lambda *a, _f=fwd, **k: cp.checkpoint(_f, *a, use_reentrant=False, **k)
    hf = Block()
    hf.gradient_checkpointing = True

    class CheckpointWrapper(Block):
        pass

    compiled = Block()
    compiled.compile(backend="eager")
    cached = types.SimpleNamespace(config=types.SimpleNamespace(use_cache=True), training=True)

    # THEN each is refused in words; a plain block is not
    assert "its forward calls a checkpoint" in why_not_wrap("r", recipe)
    assert "gradient_checkpointing is on" in why_not_wrap("h", hf)
    assert "CheckpointWrapper" in why_not_wrap("c", CheckpointWrapper())
    assert "torch.compile" in why_not_wrap("x", compiled)
    assert "use_cache=False" in why_not_wrap("p", Block(), cached)
    assert why_not_wrap("p", Block()) == ""


def test_step_peak_is_the_live_bytes_of_the_step():
    # GIVEN a block with its optimizer
    block = Block()
    opt = torch.optim.SGD(block.parameters(), lr=0.1)
    x = torch.randn(64, 8)

    # WHEN one step's peak is read
    peak = StepPeak(known_tensors([block], [opt]), "cpu")
    peak.start()
    block(x).sum().backward()
    opt.step()
    peak.stop()

    # THEN it holds at least the parameters, their gradients and the 64x32 activations
    params = sum(p.numel() * 4 for p in block.parameters())
    assert peak.bytes >= 2 * params + 64 * 32 * 4 and peak.source == "live tensor bytes"


def test_parse_spec_and_auto_on_the_cpu():
    assert parse_spec(" auto ") == "auto" and parse_spec("40G") == "40G" and parse_spec("60%") == "60%"
    for bad in ("", "lots", "150%", "x" * 100):
        with pytest.raises(ValueError):
            parse_spec(bad)
    budget, where = auto_budget("cpu", lambda: 1000)
    assert budget == 900 and "host memory" in where
