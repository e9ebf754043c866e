"""A checkpoint keeps its block's inputs until the block's backward: the memory plan's
prediction counts them where the step without the checkpoint lets them go.

The model is tests/gpu/test_memory_plan_gpu.py's (a Linear embedding, 12 blocks of
LayerNorm -> Linear(d, 4d) -> GELU -> Linear(4d, d) with a residual, a Linear head; the loss
``model(x).float().square().mean()`` under bf16 autocast; AdamW), smaller. On an H200 its
plan's real peak was 6.5 % over its prediction (and over the budget), every block's 21 %: CUDA
autocast runs ``layer_norm`` in float32 (its fp32 list), so each block's LayerNorm saves a
float32 copy of the block's bf16 input and nothing saves the input itself, which dies when the
block's forward ends; checkpointed, the block keeps it (16 MiB a block there) until its
backward. CPU autocast runs ``layer_norm`` in bf16 on the input itself, which LayerNorm then
saves, so it has no such input: a forward pre-hook on each LayerNorm does on the CPU what CUDA
autocast does (``input.float()``, the ``_to_copy`` autocast's cast runs), in the forward and in
a checkpoint's recompute alike.

"Real" is the step's live tensor bytes after every operator (:class:`LiveTensorBytes`), as in
test_collectors_memory_plan_predict.py; memory on the CPU does not depend on timing. No test here
looks at a clock.
"""

from __future__ import annotations

import gc

import pytest
import torch

from collectors.memory.plan.capture import measure_step
from collectors.memory.plan.measurement import from_json
from collectors.memory.plan.predict import predict
from collectors.memory.plan.solve import make_plan
from tests.support.plan_models import Model, adamw_step, real_peak

pytestmark = pytest.mark.usefixtures("eager_process")

D, DEPTH, BATCH, SEQ = 32, 12, 4, 256
BF16 = 2
TOLERANCE = 0.01


def _cuda_autocast_layer_norm(module, args):
    """CUDA autocast's policy for layer_norm (float32), on the CPU."""
    if torch.is_autocast_enabled("cpu") and args[0].dtype != torch.float32:
        return (args[0].float(), *args[1:])
    return None


def setup(cuda_layer_norm: bool):
    torch.manual_seed(0)
    model = Model(D, DEPTH, layer_norm=True)
    if cuda_layer_norm:
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.register_forward_pre_hook(_cuda_autocast_layer_norm)
    x = torch.randn(BATCH, SEQ, D)

    def loss():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x).float().square().mean()

    opt, step = adamw_step(model, loss, lr=1e-4)
    return model, opt, step


def test_a_block_whose_input_nothing_saves_is_predicted_with_that_input_kept_by_its_checkpoint():
    # GIVEN the GPU test's model with CUDA autocast's float32 LayerNorm: no block saves its
    # bf16 input, and a plan for 60 % of the measured peak
    model, opt, step = setup(cuda_layer_norm=True)
    gc.collect()  # the garbage of earlier tests is not this step's
    m = from_json(measure_step(model, opt, step))
    budget = int(m.peak_bytes * 0.6)
    plan = make_plan(m, budget=budget)
    assert plan["status"] == "fits", plan["floor_bytes"] / m.peak_bytes
    every = {b.name for b in m.blocks}

    # WHEN the plan, every block and every other block are checkpointed in real steps
    cases = {"plan": set(plan["plan"]["modules"]), "every": every, "alternate": {b.name for b in m.blocks[::2]}}
    figures = {
        label: (predict(m, names)["predicted_peak_bytes"], real_peak(model, step, names))
        for label, names in cases.items()
    }

    # THEN each real peak is its prediction, within the bound, and the plan's is under the budget
    for label, (predicted, real) in figures.items():
        assert abs(real - predicted) <= TOLERANCE * real, (
            label,
            predicted,
            real,
            (real - predicted) / (BATCH * SEQ * D * BF16),
        )
    assert figures["plan"][1] <= budget, figures


@pytest.mark.parametrize("cuda_layer_norm", [True, False], ids=["cuda-layer-norm", "cpu-layer-norm"])
def test_the_measurement_says_which_inputs_a_checkpoint_would_keep(cuda_layer_norm):
    # GIVEN the model with CUDA autocast's float32 LayerNorm (no block saves its input), or
    # with the CPU's (each block's LayerNorm saves its bf16 input)
    model, opt, step = setup(cuda_layer_norm=cuda_layer_norm)

    # WHEN one step is measured
    gc.collect()  # the garbage of earlier tests is not this step's
    doc = measure_step(model, opt, step)

    # THEN with the float32 LayerNorm each block's checkpoint would keep its bf16 input, one
    # storage of its own, from a segment after its forward end to its backward start; with the
    # CPU's, none (the step keeps them anyway)
    blocks = doc["blocks"]
    assert [b["name"] for b in blocks] == [f"blocks.{i}" for i in range(DEPTH)]
    if not cuda_layer_norm:
        assert all(b["kept_inputs"] == [] for b in blocks)
        return
    assert all(len(b["kept_inputs"]) == 1 for b in blocks)
    assert all(b["kept_inputs"][0][1] == BATCH * SEQ * D * BF16 for b in blocks)
    assert len({b["kept_inputs"][0][2] for b in blocks}) == DEPTH
    assert all(b["forward_end"] < b["kept_inputs"][0][0] < b["backward_start"] for b in blocks)
    # AND the inputs are not among the bytes its checkpoint frees (a LayerNorm's float32 copy is)
    assert all(b["freeable_bytes"] == blocks[0]["freeable_bytes"] for b in blocks)
    assert blocks[0]["freeable_bytes"] >= BATCH * SEQ * D * 4
