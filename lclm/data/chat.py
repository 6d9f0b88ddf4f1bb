"""Chat templates: ShareGPT conversations -> tokens with the loss on assistant tokens only."""

from __future__ import annotations

import dataclasses

import numpy as np

ROLE_ALIASES = {
    "system": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "model": "assistant",
}


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """How turns are rendered. Every assistant reply ends with EOS (LLaMA's `</s>`)."""
    default_system: str
    system_format: str      # "{system}"
    user_format: str        # "{text}": rendered without loss
    assistant_prefix: str   # rendered without loss, before the reply
    assistant_format: str   # "{text}": rendered with loss, then EOS


TEMPLATES = {
    # Vicuna v1.1 (FastChat), as used for ShareGPT fine-tuning in seed 003.
    "vicuna": ChatTemplate(
        default_system="A chat between a curious user and an artificial intelligence "
                       "assistant. The assistant gives helpful, detailed, and polite answers "
                       "to the user's questions.",
        system_format="{system} ", user_format="USER: {text} ", assistant_prefix="ASSISTANT:",
        assistant_format=" {text}"),
    # LLaMA-2 chat: [INST] <<SYS>> ... <</SYS>> ... [/INST] reply </s>
    "llama2": ChatTemplate(
        default_system="", system_format="<<SYS>>\n{system}\n<</SYS>>\n\n",
        user_format="[INST] {text} [/INST]", assistant_prefix="", assistant_format=" {text} "),
}


def conversation_turns(record) -> list[tuple[str, str]] | None:
    """(role, text) turns of a ShareGPT record (`conversations` with from/value, or
    `messages` with role/content); None when the record is malformed."""
    if not isinstance(record, dict):
        return None
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list) or not turns:
        return None
    out = []
    for t in turns:
        if not isinstance(t, dict):
            return None
        role = ROLE_ALIASES.get(str(t.get("from", t.get("role", ""))).lower())
        text = t.get("value", t.get("content"))
        if role is None or not isinstance(text, str):
            return None
        out.append((role, text))
    if not any(r == "assistant" and t.strip() for r, t in out):
        return None
    return out


def render(turns, tokenizer, template: ChatTemplate) -> tuple[np.ndarray, np.ndarray]:
    """Token ids `[n]` and a per-token loss flag `[n]` (1 on assistant replies and their EOS).

    Layout: BOS, system, then user turns and assistant turns in order. Pieces are tokenised
    separately so the loss mask is exact at every boundary.
    """
    ids, flags = [tokenizer.bos_id], [0]

    def add(text, flag):
        if text:
            piece = tokenizer.encode(text)
            ids.extend(piece)
            flags.extend([flag] * len(piece))

    system = template.default_system
    if turns and turns[0][0] == "system":
        system, turns = turns[0][1], turns[1:]
    if system:
        add(template.system_format.format(system=system), 0)
    for role, text in turns:
        if role == "user":
            add(template.user_format.format(text=text), 0)
        elif role == "assistant":
            add(template.assistant_prefix, 0)
            add(template.assistant_format.format(text=text), 1)
            ids.append(tokenizer.eos_id)
            flags.append(1)
    return np.asarray(ids, np.int32), np.asarray(flags, np.uint8)
