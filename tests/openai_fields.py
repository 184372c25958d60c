"""Every request field of vLLM's completion, chat and responses request models, with what the
gateway does with it: a sample value it forwards (the answer must be the one a colocated
engine gives), or :data:`REFUSED` (a 400 naming the field).

``tests/test_openai_fields.py`` fails when vLLM has a field this table does not name, and
``tests/e2e_tiny/test_e2e_openai.py`` sends every sample through the gateway and straight
to an engine and compares the answers.
"""

from __future__ import annotations

from typing import Any

REFUSED = object()
"""The gateway answers 400 naming the field (it owns it, or P/D cannot serve it)."""

TOOL = {"type": "function", "function": {"name": "f", "description": "a function",
                                         "parameters": {"type": "object", "properties": {}}}}

# Fields the three endpoints share, with one sample each.
COMMON: dict[str, Any] = {
    "model": "tiny",
    "stream": False,
    "temperature": 0.0,
    "top_p": 0.9,
    "top_k": 5,
    "min_p": 0.1,
    "seed": 3,
    "frequency_penalty": 0.5,
    "presence_penalty": 0.5,
    "repetition_penalty": 1.2,
    "stop": ["\n\n\n"],
    "stop_token_ids": [2],
    "ignore_eos": True,
    "logit_bias": {"100": 5.0},
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "user": "conformance",
    "cache_salt": "client-salt",  # the tenant's salt replaces it: no effect on the text
    "structured_outputs": {"choice": ["yes", "no"]},
    "priority": 0,
    "session_id": "s-1",
    "vllm_xargs": {"x": 1},
    "watermarking": False,
    "mm_payload": "none",
    "return_mm_kwargs": False,
    "media_io_kwargs": None,
    "mm_processor_kwargs": None,
    "kv_transfer_params": REFUSED,
    "ec_transfer_params": REFUSED,
    "request_id": REFUSED,
}

COMPLETION: dict[str, Any] = {
    **COMMON,
    "max_tokens": 3,
    "n": 2,
    "echo": True,
    "logprobs": 2,
    "prompt_logprobs": 1,
    "suffix": " # end",
    "min_tokens": 2,
    "add_special_tokens": False,
    "spaces_between_special_tokens": False,
    "response_format": {"type": "json_object"},
    "stream_options": {"include_usage": True},
    "allowed_token_ids": [100, 200, 300, 400],
    "bad_words": ["the"],
    "length_penalty": 1.0,
    "logprob_token_ids": [100],
    "return_token_ids": True,
    "return_tokens_as_token_ids": True,
    "return_token_offsets": True,
    "routed_experts_prompt_start": 0,
    "stream_interval": 1,
    "thinking_token_budget": 10,
    "truncate_prompt_tokens": 20,
    "truncation_side": "left",
    "repetition_detection": None,
    "use_beam_search": REFUSED,
    "prompt_embeds": REFUSED,
}

CHAT: dict[str, Any] = {
    **{k: v for k, v in COMPLETION.items()
       if k not in ("prompt_embeds", "suffix", "logprobs")},
    "logprobs": True,
    "top_logprobs": 2,
    "max_completion_tokens": 3,
    "add_generation_prompt": True,
    "continue_final_message": False,
    "chat_template": REFUSED,
    "chat_template_kwargs": {"enable_thinking": False},
    "documents": None,
    "tools": [TOOL],
    "tool_choice": "none",
    "parallel_tool_calls": False,
    "reasoning_effort": None,
    "include_reasoning": True,
    "return_prompt_text": True,
}

RESPONSES: dict[str, Any] = {
    **COMMON,
    "max_output_tokens": 3,
    "instructions": "Answer in code.",
    "tools": [],
    "tool_choice": "none",
    "parallel_tool_calls": False,
    "text": {"format": {"type": "text"}},
    "reasoning": None,
    "metadata": {"k": "v"},
    "include": None,
    "store": False,
    "background": REFUSED,
    # No stored response has it: the gateway and the engine both answer 404.
    "previous_response_id": "resp_unknown",
    "previous_input_messages": None,
    "enable_response_messages": False,
    "include_reasoning": True,
    "max_tool_calls": 1,
    "prompt": None,
    "prompt_cache_key": "k",
    "service_tier": "auto",
    "truncation": "disabled",
    "top_logprobs": 0,
    "chat_template_kwargs": {"enable_thinking": False},
}

# The field that carries the input: every request has it, so it has no sample here.
INPUT = {"completions": "prompt", "chat": "messages", "responses": "input"}
TABLES = {"completions": COMPLETION, "chat": CHAT, "responses": RESPONSES}


def vllm_models() -> dict[str, Any]:
    """vLLM's request model of each endpoint (imports vLLM: slow, so on demand)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    return {"completions": CompletionRequest, "chat": ChatCompletionRequest,
            "responses": ResponsesRequest}


def unclassified(endpoint: str, model: Any) -> list[str]:
    """vLLM's fields of ``endpoint`` that the table does not name."""
    known = set(TABLES[endpoint]) | {INPUT[endpoint]}
    return sorted(set(model.model_fields) - known)
