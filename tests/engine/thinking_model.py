"""A scripted reasoning model for tests: a real (tiny) Llama whose greedy output is fixed, so the
engine runs a thinking-then-answer row through its real step loop.

The tokenizer is the default model's with `<think>` and `</think>` added as single tokens (not
special, as in Qwen3's tokenizer) and Qwen3's real chat template (tests/data). The model's
attention and MLP outputs are zero (o_proj and down_proj), so each position's logits depend on its
own token only: a bigram table. Its rows send each token of `SCRIPT` to the next one, so after a
prompt that ends with a newline the model writes, greedily,
`<think>I, maybe</think>\\n\\nyes.<|im_end|>`; after `</think>\\n\\n` (Qwen3's template with
`enable_thinking` false) it writes `yes.<|im_end|>`.
"""

from __future__ import annotations

from pathlib import Path

import torch

DATA = Path(__file__).resolve().parent.parent / "data"
# Each token's text, in the order the model writes them (the first is the prompt's last token).
SCRIPT = ["\n", "<think>", "I", ",", " maybe", "</think>", "\n\n", "yes", ".", "<|im_end|>"]
REASONING, ANSWER = "I, maybe", "\n\nyes."
HIDDEN = 64


def script_ids(tokenizer) -> list[int]:
    """The token id of each `SCRIPT` entry (each must be one token)."""
    ids = []
    for text in SCRIPT:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        assert len(encoded) == 1, f"{text!r} is {encoded}, not one token"
        ids.append(encoded[0])
    return ids


def build_thinking_model(path: Path, tokenizer_dir: Path) -> Path:
    """Write the scripted model (float32 safetensors, tokenizer, Qwen3 chat template) to `path`."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = (DATA / "qwen3_chat_template.jinja").read_text()
    ids = script_ids(tokenizer)
    eos = ids[-1]
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos,
        pad_token_id=eos,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        embed.normal_(0.0, 0.02)
        head.normal_(0.0, 0.02)
        for i, (token, after) in enumerate(zip(ids, ids[1:], strict=False)):
            embed[token] = 0.0
            embed[token, i] = 1.0  # its own direction: after the norm, only column i of lm_head counts
            head[after, i] = 10.0
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=eos
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
