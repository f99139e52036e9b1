"""Chat turns rendered into one prompt string the way the model was trained to read them."""
from __future__ import annotations


def chat_prompt(tokenizer, messages: list[dict]) -> str:
    """The tokenizer's chat template (with the assistant's turn opened) when it has one, else plain
    "role: content" lines ending in "assistant:"."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(f"{m.get('role', 'user')}: {m['content']}\n" for m in messages) + "assistant:"
