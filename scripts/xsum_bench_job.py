#!/usr/bin/env python
"""Write a summarization bench workload from XSum: one chat row per article, each with the number of
tokens the model generates for it before its end-of-sequence token (`max_tokens`).

`batchgen bench --dist file:PATH` ignores EOS (every run does the same work) and reads each row's
`max_tokens`; with the model's own output lengths the bench generates exactly the tokens a real
summarization job produces (greedy), so its long tail and the phrases it copies from each article
are the job's, not text generated past the end of a summary. The lengths come from one greedy run
of the model with EOS on, in the dtype given (the bench's dtype: outputs in bf16 and float32 may
differ).

The cap (`--max-tokens`, default 1,024) sets the job's tail: the default model ends most summaries
within 20-360 tokens and loops on a few articles until the cap. At 1,024 those few rows run on
alone at the end, as in a real job with a generous `max_tokens`; at 256, eight rows were cut at the
cap within a few steps of each other and the job had hardly a tail (docs/benchmarks.md).

Usage (the issue 27 workload, about 2 minutes on two CPU cores)::

    python scripts/xsum_bench_job.py --rows 64 --output /tmp/xsum64.jsonl
    batchgen bench --dist file:/tmp/xsum64.jsonl --num-prompts 0 --mode continuous \\
        --speculative-method none,ngram --repeat 3
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from batchgen import LLM, SamplingParams  # noqa: E402

DEFAULT_XSUM = Path(__file__).resolve().parents[2] / "shared" / "data" / "xsum" / "test.jsonl"
TEMPLATE = "Summarize the following article in one sentence.\n\n{document}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--xsum", type=Path, default=DEFAULT_XSUM, help="XSum test.jsonl (id, document, summary)"
    )
    parser.add_argument("--rows", type=int, default=64, help="articles, from the first")
    parser.add_argument("--max-tokens", type=int, default=1024, help="most tokens per summary")
    parser.add_argument("--template", default=TEMPLATE, help="prompt with a {document} placeholder")
    parser.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto", help="the dtype the bench will run in")
    parser.add_argument("--output", type=Path, required=True, help="the bench job file (.jsonl)")
    args = parser.parse_args()

    rows = []
    with args.xsum.open() as f:
        for line in f:
            row = json.loads(line)
            if row.get("document", "").strip():
                rows.append(row)
            if len(rows) == args.rows:
                break
    messages = [[{"role": "user", "content": args.template.format(document=r["document"])}] for r in rows]
    llm = LLM(args.model, dtype=args.dtype)
    outputs = llm.generate(messages, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    with args.output.open("w") as f:
        for row, m, out in zip(rows, messages, outputs, strict=True):
            n = max(len(out.outputs[0].token_ids), 1)
            f.write(json.dumps({"id": row["id"], "messages": m, "max_tokens": n}) + "\n")
    lengths = sorted(max(len(o.outputs[0].token_ids), 1) for o in outputs)
    print(
        f"wrote {len(rows)} rows to {args.output}: output tokens min {lengths[0]}, median "
        f"{lengths[len(lengths) // 2]}, max {lengths[-1]}, total {sum(lengths)}"
    )


if __name__ == "__main__":
    main()
