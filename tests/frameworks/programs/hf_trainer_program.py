"""Hugging Face ``Trainer`` on a tiny random-init GPT-2 built from a config, synthetic tokens.

Options: gradient checkpointing, gradient accumulation, and a second ``Trainer`` (a new
optimizer and scheduler) on the same model after the first one's ``--stage-steps`` steps."""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from typing import Any

import torch
from _job import Pacer, emit, parser, seed_everything


def main() -> int:
    p = parser(__doc__ or "")
    p.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing")
    p.add_argument("--accum", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--trainers", type=int, choices=[1, 2], default=1, help="2: a second Trainer after stage 1")
    p.add_argument("--stage-steps", type=int, default=120, help="optimizer steps of the first Trainer (with 2)")
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    seed_everything(0, args.threads)

    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    config = GPT2Config(
        vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0, use_cache=False
    )
    model = GPT2LMHeadModel(config)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (256, 32), generator=gen)

    class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __len__(self) -> int:
            return tokens.shape[0]

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": tokens[i], "labels": tokens[i]}

    pacer = Pacer(args)

    class Paced(TrainerCallback):  # type: ignore[misc]
        def __init__(self, stage_limit: int) -> None:
            self.stage_limit = stage_limit

        def on_step_end(self, targs: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if pacer.step_done() or (self.stage_limit and state.global_step >= self.stage_limit):
                control.should_training_stop = True
            return control

    class LossTrainer(Trainer):  # type: ignore[misc]
        stage = 1

        def training_step(self, *a: Any, **kw: Any) -> torch.Tensor:
            loss: torch.Tensor = super().training_step(*a, **kw)
            pacer.loss(f"{self.stage}:{self.state.global_step + 1}", loss.item())
            return loss

    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    ckpt_field = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    out = tempfile.mkdtemp(prefix="hf-job-")
    stages = [1, 2] if args.trainers == 2 else [1]
    for stage in stages:
        targs = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=args.accum,
            **{ckpt_field: args.grad_ckpt},
            max_steps=args.max_steps,
            learning_rate=5e-4 if stage == 1 else 1e-4,
            lr_scheduler_type="linear",
            warmup_steps=5,
            logging_strategy="no",
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            use_cpu=True,
            seed=stage,
            dataloader_num_workers=0,
        )
        trainer = LossTrainer(
            model=model,
            args=targs,
            train_dataset=Tokens(),
            callbacks=[Paced(args.stage_steps if stage < len(stages) else 0)],
        )
        trainer.stage = stage
        if stage == 2:
            emit("STAGE 2")
        trainer.train()
        if pacer.should_stop():
            break
    pacer.done()
    return 0


if __name__ == "__main__":
    sys.exit(main())
