"""One training job of the model zoo (scripts/zoo_checkpoint.py): a tiny random-init Hugging Face
model of one architecture, trained on synthetic data in a plain loop on the CPU.

    python scripts/_zoo_job.py --arch llama --steps 30

It prints ``READY <pid>`` after its first optimizer step, ``LOSS <step> <repr>`` for every step
(bit-exact), and ``DONE <steps>``. Dropout stays on (a recompute must restore the RNG), the
config's ``use_cache`` is off (a recompute must not fill a key/value cache twice), one torch
thread, seeded: two runs print the same losses.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

# architecture: (config class, model class, config overrides, the batch's kind)
SMALL = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 128}
ZOO: dict[str, tuple[str, str, dict[str, Any], str]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_embd": 64, "n_layer": 4, "n_head": 4, "n_positions": 256}, "lm"),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {**SMALL, "num_key_value_heads": 2}, "lm"),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**SMALL, "num_key_value_heads": 2}, "lm"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {**SMALL, "num_key_value_heads": 2}, "lm"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {**SMALL, "num_key_value_heads": 1, "head_dim": 16}, "lm"),
    "phi": ("PhiConfig", "PhiForCausalLM", SMALL, "lm"),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        {
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "ffn_dim": 128,
            "word_embed_proj_dim": 64,
        },
        "lm",
    ),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", SMALL, "lm"),
    "bloom": ("BloomConfig", "BloomForCausalLM", {"hidden_size": 64, "n_layer": 4, "n_head": 4}, "lm"),
    "bert": ("BertConfig", "BertForMaskedLM", SMALL, "mlm"),
    # one layer's weights shared by every layer: the same module runs four times a step
    "albert": ("AlbertConfig", "AlbertForMaskedLM", {**SMALL, "embedding_size": 32}, "mlm"),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", {**SMALL, "max_position_embeddings": 300}, "mlm"),
    "t5": (
        "T5Config",
        "T5ForConditionalGeneration",
        {
            "d_model": 64,
            "d_ff": 128,
            "num_layers": 3,
            "num_decoder_layers": 3,
            "num_heads": 4,
            "d_kv": 16,
            "decoder_start_token_id": 0,
            "pad_token_id": 0,
        },
        "seq2seq",
    ),
    "bart": (
        "BartConfig",
        "BartForConditionalGeneration",
        {
            "d_model": 64,
            "encoder_layers": 3,
            "decoder_layers": 3,
            "encoder_attention_heads": 4,
            "decoder_attention_heads": 4,
            "encoder_ffn_dim": 128,
            "decoder_ffn_dim": 128,
        },
        "seq2seq",
    ),
    "vit": (
        "ViTConfig",
        "ViTForImageClassification",
        {**SMALL, "image_size": 64, "patch_size": 8, "num_labels": 10},
        "image",
    ),
}
VOCAB = 1000
# plain torch models beside the zoo (no config class): skip connections, routed experts
PLAIN = {"unet": "image", "moe": "lm"}


def plain_model(arch: str) -> Any:
    import torch
    from torch import nn

    class Down(nn.Module):
        def __init__(self, cin: int, cout: int) -> None:
            super().__init__()
            self.conv = nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(4, cout), nn.SiLU())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(x)

    class UNet(nn.Module):
        """Encoder outputs kept for the decoder: a block's input lives until a later block."""

        def __init__(self) -> None:
            super().__init__()
            self.downs = nn.ModuleList([Down(3, 16), Down(16, 32), Down(32, 64)])
            self.ups = nn.ModuleList([Down(64 + 32, 32), Down(32 + 16, 16)])
            self.head = nn.Linear(16, 10)

        def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> Any:
            skips, x = [], pixel_values
            for i, d in enumerate(self.downs):
                x = d(x)
                if i < 2:
                    skips.append(x)
                    x = nn.functional.max_pool2d(x, 2)
            for u in self.ups:
                x = nn.functional.interpolate(x, scale_factor=2.0)
                x = u(torch.cat([x, skips.pop()], 1))
            loss = nn.functional.cross_entropy(self.head(x.mean((2, 3))), labels)
            return type("Out", (), {"loss": loss})()

    class Expert(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(nn.functional.gelu(self.up(x)))

    class MoE(nn.Module):
        """Top-1 routing over 4 experts: data-dependent shapes, experts a token batch may skip."""

        def __init__(self, d: int) -> None:
            super().__init__()
            self.router = nn.Linear(d, 4)
            self.experts = nn.ModuleList(Expert(d) for _ in range(4))
            self.norm = nn.LayerNorm(d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.norm(x)
            choice = self.router(h).argmax(-1)
            out = torch.zeros_like(h)
            for i, e in enumerate(self.experts):
                sel = choice == i
                if sel.any():
                    out[sel] = e(h[sel])
            return x + out

    class MoELM(nn.Module):
        def __init__(self, d: int = 64, layers: int = 4) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, d)
            self.layers = nn.ModuleList(MoE(d) for _ in range(layers))
            self.head = nn.Linear(d, VOCAB)

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
            x = self.embed(input_ids)
            for layer in self.layers:
                x = layer(x)
            logits = self.head(x)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
            return type("Out", (), {"loss": loss})()

    return UNet() if arch == "unet" else MoELM()


def build(arch: str) -> Any:
    if arch in PLAIN:
        return plain_model(arch), PLAIN[arch]
    import transformers

    config_name, model_name, over, kind = ZOO[arch]
    config_cls = getattr(transformers, config_name)
    extra: dict[str, Any] = {} if kind == "image" else {"vocab_size": VOCAB}
    if kind == "lm":
        extra["tie_word_embeddings"] = True  # tied weights: one parameter, two modules
    config = config_cls(**over, **extra)
    if hasattr(config, "use_cache"):
        config.use_cache = False
    return getattr(transformers, model_name)(config), kind


def batch_of(kind: str, batch: int, seq: int, gen: Any) -> dict[str, Any]:
    import torch

    if kind == "image":
        return {
            "pixel_values": torch.randn(batch, 3, 64, 64, generator=gen),
            "labels": torch.randint(0, 10, (batch,), generator=gen),
        }
    ids = torch.randint(5, VOCAB, (batch, seq), generator=gen)
    if kind == "lm":
        return {"input_ids": ids, "labels": ids}
    if kind == "mlm":
        labels = ids.clone()
        labels[:, ::2] = -100
        return {"input_ids": ids, "labels": labels}
    target = torch.randint(5, VOCAB, (batch, seq // 2), generator=gen)
    return {"input_ids": ids, "labels": target}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--arch", choices=sorted([*ZOO, *PLAIN]), required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    args = p.parse_args()
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model, kind = build(args.arch)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        for _ in range(args.accumulate):
            loss = model(**batch_of(kind, args.batch, args.seq, gen)).loss / args.accumulate
            loss.backward()
            os.write(1, f"LOSS {step} {loss.item()!r}\n".encode())
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 0:
            os.write(1, f"READY {os.getpid()}\n".encode())
    os.write(1, f"DONE {args.steps}\n".encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
