"""Turn workload requests into prompt token ids, keeping each peer's conversations.

Every peer gets token ids, not text, so all peers see exactly the same prompt tokens. A
conversation's next prompt is its previous prompt, the tokens the peer generated, and the chat
template's text for the new user turn: generated tokens enter the next prompt as they were
generated (no detokenize/retokenize round trip that could break a prefix match).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .workloads import Request

_MARK = "\x00ANSWER\x00"


@dataclass
class Conversation:
    messages: list[dict] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # last prompt + its generated tokens


class PromptBuilder:
    """One per peer (conversations diverge with what each peer generates)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.conversations: dict[str, Conversation] = {}

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def prompt_ids(self, req: Request) -> list[int]:
        if req.text is not None:
            return self.encode(req.text)
        conv = self.conversations.get(req.conversation) if req.conversation else None
        if conv is None or not conv.token_ids:
            ids = self.encode(self.render(list(req.messages)))
            if req.conversation:
                self.conversations[req.conversation] = Conversation(list(req.messages), ids)
            return ids
        follow = self.render(conv.messages + [{"role": "assistant", "content": _MARK}, *req.messages])
        ids = conv.token_ids + self.encode(follow[follow.rindex(_MARK) + len(_MARK):])
        conv.messages += [{"role": "assistant", "content": _MARK}, *req.messages]
        conv.token_ids = ids
        return ids

    def record_answer(self, req: Request, generated: list[int]) -> None:
        """Append what the peer generated to its conversation (no-op outside conversations)."""
        if req.conversation and req.conversation in self.conversations:
            self.conversations[req.conversation].token_ids += list(generated)
