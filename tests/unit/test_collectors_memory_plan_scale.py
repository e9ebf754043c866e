"""The memory plan at other micro-batch sizes: one measured step scaled by its tokens, checked
against a real step of twice the batch on the CPU's meter."""

from __future__ import annotations

import pytest
import torch

from collectors.memory.plan.capture import measure_step
from collectors.memory.plan.measurement import from_json
from collectors.memory.plan.meter import LiveTensorBytes
from collectors.memory.plan.predict import predict
from collectors.memory.plan.scale import blocks_text as _blocks
from collectors.memory.plan.scale import describe, micro_batches, predicted_peak, scale, tokens_factor
from tests.support.oom import activations_oom
from tests.support.plan_models import Block, checkpoint_modules

pytestmark = pytest.mark.usefixtures("eager_process")


class Decoder(torch.nn.Module):
    """Token embedding, blocks, a vocabulary head and a cross-entropy loss: a small decoder."""

    def __init__(self, vocab: int = 256, width: int = 32, depth: int = 6) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList([Block(width) for _ in range(depth)])
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def setup(batch: int, seq: int = 64):
    torch.manual_seed(0)
    model = Decoder()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (batch, seq))

    def step() -> None:
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()

    step()  # the optimizer state exists, as in a steady step
    return model, opt, step


def real_peak(model, opt, step, checkpointed: set[str] = frozenset()) -> int:
    checkpoint_modules(model, checkpointed)
    known = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    for per in opt.state.values():
        known += [v for v in per.values() if isinstance(v, torch.Tensor)]
    with LiveTensorBytes(known) as live:
        step()
    live.close()
    return live.peak


def test_the_peak_at_twice_the_batch_is_within_10_percent_of_a_real_step():
    # GIVEN a step measured at batch 8, and a real step at batch 16
    doc = measure_step(*setup(8))
    m = from_json(doc)
    real = real_peak(*setup(16))

    # WHEN its peak at twice the tokens is predicted
    got = predicted_peak(m, 2.0)

    # THEN it is within 10 % of the real one, and well above the measured step's
    assert abs(got - real) <= 0.10 * real, (got, real, m.peak_bytes)
    assert got > m.peak_bytes * 1.3
    # AND the measurement recorded the first block's input shape, the micro-batch's
    assert doc["input_shape"] == [8, 64, 32]


def test_the_plan_at_twice_the_batch_predicts_a_real_checkpointed_step():
    # GIVEN a step measured at batch 8, scaled to 16, and half its blocks chosen
    m2 = scale(from_json(measure_step(*setup(8))), 2.0)
    chosen = {"blocks.1", "blocks.3", "blocks.5"}

    # WHEN the scaled plan's peak is compared with a real step at 16 with those blocks checkpointed
    got = predict(m2, chosen)["predicted_peak_bytes"]
    real = real_peak(*setup(16), checkpointed=chosen)

    # THEN they agree within 10 %
    assert abs(got - real) <= 0.10 * real, (got, real)


def test_micro_batches_names_the_largest_sizes_and_the_plan_at_twice():
    # GIVEN a measured step at batch 8 and a budget 1.5x its peak
    doc = measure_step(*setup(8))
    m = from_json(doc)
    budget = int(m.peak_bytes * 1.5)

    # WHEN the sizes are asked
    got = micro_batches(doc, budget)

    # THEN the largest without a plan is above 8 and its predicted peak fits; with a plan it is larger
    plain, planned = got["largest_without_plan"], got["largest_with_plan"]
    assert got["unit"] == "micro-batch" and got["measured_size"] == 8
    assert plain["size"] > 8 and plain["predicted_peak_bytes"] <= budget
    assert predicted_peak(m, (plain["size"] + 1) / 8) > budget - 0  # the next size does not fit (with margin)
    assert planned["size"] >= plain["size"] and planned["plan"]["predicted_peak_bytes"] <= budget
    assert got["at_twice"]["size"] == 16
    # AND the text says it in the user's terms
    text = "\n".join(describe(got))
    assert f"a micro-batch of {plain['size']} fits without recomputation" in text, text
    assert "a micro-batch of 16" in text


def test_tokens_factor_reads_the_failing_step_s_shapes():
    held = [{"shape": [16, 2048, 1536]}, {"shape": [32000, 1536]}, {"shape": [8, 2048, 1536]}, {"shape": "x"}]
    assert tokens_factor([8, 2048, 1536], held) == 2.0
    assert tokens_factor([8, 2048, 1536], [{"shape": [1536]}]) is None
    assert tokens_factor([], held) is None


def test_block_ranges_are_named_as_ranges():
    assert _blocks([f"layers.{i}" for i in range(2, 20)]) == "layers 2-19"
    assert _blocks(["a.1", "a.3"]) == "a.1, a.3"


def test_an_oom_at_twice_the_batch_gets_the_plan_for_the_failing_size():
    from collectors.memory.advice import advise

    # GIVEN a step measured at batch 8, and an OOM whose frames hold hidden states of batch 16
    doc = measure_step(*setup(8))
    m2 = scale(from_json(doc), 2.0)
    limit = int(m2.peak_bytes * 0.85 * 10 / 9)  # 90 % of the device: 85 % of the larger step's peak
    frames = [{"name": "x", "frame": "forward", "bytes": 1, "tensors": 1, "shape": [16, 64, 32]}]
    s = activations_oom(doc, limit, frames)

    # WHEN the advice is made
    advice = {a["rule"]: a for a in advise(s)}["activations"]["advice"]

    # THEN it scales the measured step to the failing one and gives the plan for that size
    assert "2x the tokens of the last measured step (16 x 64 against 8 x 64)" in advice, advice
    assert "recomputed (predicted" in advice and "dynprof run --checkpoint auto" in advice, advice
