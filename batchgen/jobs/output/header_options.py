"""The run header's options in one form per meaning, so a resumed run that words an option another
way (`--top-k -1` for `0`, `--quantization none` where "auto" runs float weights anyway) still
resumes, and one whose option means something else is still refused.

The forms: `top_k` -1 as 0 (both are off: `canonical_top_k`); `chat_template_kwargs` {} as none;
`max_model_len` equal to the model's own limit as the default (a given `max_model_len` starts only
where the KV cache holds it, and there the default is that limit too); `quantization` where it runs
what "auto" runs for the model as "auto", which the header leaves out. The last two read the
model's files (`batchgen.model.loading.model_defaults`); where those do not tell, the option is
kept as given.
"""

from __future__ import annotations

from typing import Any

from batchgen.sampling_params import canonical_top_k


def canonical_options(options: dict[str, Any], model: str | None) -> dict[str, Any]:
    """`options` (the run header's, `batchgen.jobs.runner`) in their one form for the model
    labelled `model` (the header's `model`: a local model's absolute path, a hub id, or "default");
    a new dict, `options` unchanged. Applying it twice changes nothing."""
    out = dict(options)
    if out.get("chat_template_kwargs") == {}:
        out["chat_template_kwargs"] = None
    sampling = out.get("sampling")
    if isinstance(sampling, dict) and "top_k" in sampling:
        out["sampling"] = {**sampling, "top_k": canonical_top_k(sampling["top_k"])}
    given_len = out.get("max_model_len")
    quantization = out.get("quantization")
    if given_len is None and quantization != "none":  # nothing the model's defaults could resolve
        return out
    from batchgen.model.loading.model_defaults import model_defaults

    defaults = model_defaults(None if model in (None, "default") else model)
    if given_len is not None and given_len == defaults.max_len:
        out["max_model_len"] = None
    if quantization is not None and quantization == defaults.auto_quantization:
        del out["quantization"]
    return out
