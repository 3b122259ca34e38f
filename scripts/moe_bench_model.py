"""Write a random-weight mixture of experts with Qwen3-30B-A3B's layer shapes: the MoE benchmark's model.

python scripts/moe_bench_model.py OUT [--layers 2] [--dtype bfloat16]
    hidden 2048, 32 query / 4 KV heads of head_dim 128, 128 experts of width 768 with top-8 routing
    (norm_topk_prob), as Qwen3-30B-A3B's config; `--layers` of its 48 layers (so it fits in memory);
    the default model's tokenizer (vocab 49,152 instead of 151,936) and generation config; random
    weights (transformers' init, seed 0), saved in `--dtype`. Its text is noise; a step's work per
    layer is the real model's (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


def write_model(out: Path, layers: int, dtype: str) -> None:
    """The random-weight model at `out` (config, safetensors, tokenizer, generation config)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from batchgen.model.loading.loader import TOKENIZER_FILES, resolve_model

    default = resolve_model(None).path
    vocab = json.loads((default / "config.json").read_text())["vocab_size"]
    config = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        architectures=["Qwen3MoeForCausalLM"],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(out)
    for name in ("generation_config.json", *TOKENIZER_FILES):
        if (default / name).is_file():
            shutil.copy2(default / name, out / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (Qwen3-30B-A3B has 48)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = parser.parse_args()
    write_model(args.out, args.layers, args.dtype)
    print(f"random-weight Qwen3-MoE ({args.layers} layers of Qwen3-30B-A3B's shape) written to {args.out}")


if __name__ == "__main__":
    main()
