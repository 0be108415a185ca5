"""Owns the fields this server refuses by name: what peers (OpenAI, vLLM, SGLang, llama.cpp) honour
and we do not (yet), each with the sentence the 400 carries. protocol.py checks every body against
it before validation; errors.py turns a RefusedField into a 400 whose `param` is the field.
"""

from __future__ import annotations

# Fields peers honour that this server does not (yet): refused with a 400 that names them.
REFUSED: dict[str, str] = {
    "functions": "the legacy functions field is not supported: send the functions as tools "
                 "([{'type': 'function', 'function': {...}}])",
    "function_call": "the legacy function_call field is not supported: send tools and tool_choice",
    "guided_grammar": "grammars are not supported: use guided_json, guided_regex or guided_choice",
    "grammar": "GBNF grammars are not supported: use json_schema, guided_regex or guided_choice",
    "chat_template": "a per-request chat template is not supported: start the server with --chat-template FILE",
    "prompt_logprobs": "use echo=true with logprobs on completions for prompt logprobs",
    "use_beam_search": "beam search is not supported",
    "length_penalty": "beam search is not supported",
    "typical_p": "typical sampling is not supported",
    "tfs_z": "tail-free sampling is not supported",
    "mirostat": "mirostat sampling is not supported",
    "mirostat_tau": "mirostat sampling is not supported",
    "mirostat_eta": "mirostat sampling is not supported",
    "include_stop_str_in_output": "stop strings and stop_token_ids tokens are always cut from the output",
    "skip_special_tokens": "special tokens are always skipped",
    "truncate_prompt_tokens": "prompts are never truncated: a long prompt is refused",
    "add_generation_prompt": "the chat template always adds the generation prompt",
    "continue_final_message": "continuing the final message is not supported",
    "audio": "audio is not supported",
    "modalities": "only text is supported",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "this model has no reasoning mode",
    "web_search_options": "web search is not supported",
}


class RefusedField(ValueError):
    """A field a peer honours and this server does not (or a value no part of it can take, with its own
    message): the error handler answers 400 naming it."""

    def __init__(self, name: str, why: str, *, message: str | None = None) -> None:
        super().__init__(message or f"{name} is not supported by this server: {why}")
        self.name = name
