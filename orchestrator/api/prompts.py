"""Prompt building shared by the gRPC and HTTP APIs: chat messages to token ids."""

from __future__ import annotations


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The model's chat template applied to messages ({"role", "content"}), ending with the assistant's turn.
    Without a template only one user message makes sense, as plain text (how the gRPC API reads a chat prompt
    then); several messages raise ValueError rather than a made-up transcript format."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    if len(messages) == 1 and messages[0]["role"] == "user":
        return tokenizer.encode(messages[0]["content"], add_special_tokens=True)
    raise ValueError("this model has no chat template: send a single user message, or the whole prompt to "
                     "/v1/completions")
