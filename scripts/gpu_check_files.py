"""The small files scripts/gpu_check.sh needs on a machine that cannot hold the default model's weights.

python scripts/gpu_check_files.py DIR
    copies the default model's tokenizer and config files (a few MB, no weights) into DIR.
python scripts/gpu_check_files.py --random-model OUT --from DIR
    writes a model with DIR's config (the default model's shape) and random weights (seed 0) to OUT,
    with DIR's tokenizer: the GPU bench's model. Its text is noise; its speed is the real model's.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

CONFIG_FILES = ("config.json", "generation_config.json")


def copy_files(source: Path, target: Path) -> list[str]:
    """Copy the tokenizer and config files present in `source` to `target`; returns their names."""
    from batchgen.model.loading.loader import TOKENIZER_FILES

    target.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in (*CONFIG_FILES, *TOKENIZER_FILES):
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
            copied.append(name)
    return copied


def write_random_model(files: Path, out: Path) -> None:
    """A model of `files`' config with random weights (float32, seed 0) and `files`' tokenizer at `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(files)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    copy_files(files, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", nargs="?", type=Path, help="copy the default model's small files here")
    parser.add_argument("--random-model", type=Path, help="write a random-weight model here")
    parser.add_argument("--from", dest="source", type=Path, help="the files DIR for --random-model")
    args = parser.parse_args()
    if args.random_model is not None:
        if args.source is None:
            parser.error("--random-model needs --from DIR")
        write_random_model(args.source, args.random_model)
        print(f"random-weight model written to {args.random_model}")
    elif args.dir is not None:
        from batchgen.model.loading.loader import resolve_model

        names = copy_files(resolve_model(None).path, args.dir)
        print(f"copied {', '.join(names)} to {args.dir}")
    else:
        parser.error("give DIR or --random-model OUT --from DIR")


if __name__ == "__main__":
    main()
