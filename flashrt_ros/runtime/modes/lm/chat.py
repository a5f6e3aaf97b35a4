r"""
Conversations: a tokenizer's chat template rendered one turn at a time over the live state.

With a template the context is a conversation of messages (role, content): the system
message, user turns, the assistant's replies, and 'raw' segments (text or token ids fed as
they are, recorded by role only). Each new turn prefills only its own tokens: the
conversation is rendered without and with the new message and the difference is tokenized.
That needs a template whose rendering of the earlier turns stays the same when one is added
(prefix-stable); for a template that re-renders earlier turns (one that drops the reasoning
of earlier replies) the new turn is rendered after the system message alone, and a
template that fails both is refused. A reply always ends with the template's end-of-turn
text (e.g. `<|im_end|>\n`), fed through the model whatever stopped it, so every committed
boundary holds whole turns. docs/semantics.md has the rules.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError, InvalidRequestError

RAW = ('raw', '')  # a raw segment as the conversation records it
_MARK = 'flashrt-reply-mark'  # probe content that finds the end-of-turn text


@dataclass(frozen=True)
class TurnPlan:
    """What a prefill or turn adds to the conversation once its tokens are in the state."""

    messages: tuple  # the conversation with the new message: ((role, content), ...)
    closing: tuple[int, ...] | None = None  # a reply's end-of-turn ids (None: no reply turn)
    end_ids: frozenset[int] = frozenset()  # extra ids that end the reply (end-of-turn token)


def turn_count(roles) -> int:
    """Return how many assistant turns (replies) a conversation's roles hold."""
    return sum(role == 'assistant' for role in roles)


class ChatTemplate:
    """Incremental rendering of one tokenizer's chat template."""

    def __init__(self, tokenizer):
        """Probe the template's end-of-turn text; ConfigError if it cannot render a reply."""
        self.tokenizer = tokenizer
        try:
            probe = self.render((('user', 'x'), ('assistant', _MARK)), False)
        except InvalidRequestError as exc:
            raise ConfigError(f'{exc}; set prompt_format to raw') from exc
        at = probe.find(_MARK)
        if at < 0:
            raise ConfigError('the chat template does not show an assistant reply as given; '
                              'set prompt_format to raw and format prompts yourself')
        self.closing_ids = tuple(tokenizer.encode(probe[at + len(_MARK):]))
        special = getattr(tokenizer, 'special_ids', frozenset())
        self.end_ids = frozenset(self.closing_ids[:1]) & special

    def reply_text(self, ids: list[int]) -> str:
        """Return a reply's content as the conversation records it: its specials kept."""
        return self.tokenizer.decode_verbatim(ids)

    def render(self, messages, generation_prompt: bool) -> str:
        """Render (role, content) pairs, raw segments left out; InvalidRequestError if refused."""
        chat = [{'role': r, 'content': c} for r, c in messages if r != 'raw']
        try:
            return self.tokenizer.render(chat, generation_prompt)
        except Exception as exc:  # a template's raise_exception(), or a jinja error
            raise InvalidRequestError(
                f'the chat template cannot render this conversation ({exc}); send the text '
                'raw (raw=True) formatted yourself') from exc

    def plan(self, history: tuple, role: str, content: str,
             reply: bool) -> tuple[list[int], TurnPlan]:
        """Return the ids of a new message (and, with `reply`, the assistant's start)."""
        new = ((role, content),)
        chat = tuple(m for m in history if m[0] != 'raw')
        # The whole conversation first; then, for a template that re-renders earlier turns,
        # the system message alone (or nothing) as what the new turn follows.
        bases = [chat] + ([chat[:1] if chat[0][0] == 'system' else ()] if chat else [])
        for i, base in enumerate(bases):
            after = self.render(base + new, reply)
            before = self._render_base(base) if i else (self.render(base, False) if base else '')
            if after.startswith(before):
                ids = self.tokenizer.encode(after[len(before):])
                return ids, TurnPlan(history + new, self.closing_ids if reply else None,
                                     self.end_ids)
        raise InvalidRequestError(
            'the chat template is not prefix-stable: rendering the conversation with the new '
            'turn changes the text of the earlier ones, so the new turn cannot be prefilled '
            'alone; send it raw (raw=True, prompt_format raw) formatted yourself')

    def _render_base(self, base: tuple) -> str:
        try:
            return self.render(base, False)
        except InvalidRequestError:  # a template that needs a message: nothing before
            return ''


def chat_template(tokenizer, prompt_format: str) -> ChatTemplate | None:
    """Return the conversation renderer prompt_format asks for (None: raw text)."""
    if prompt_format == 'raw':
        return None
    if not getattr(tokenizer, 'chat_template', None):
        if prompt_format == 'chat':
            raise ConfigError('prompt_format is chat but the tokenizer has no chat template; '
                              'use prompt_format auto or raw, or save a tokenizer with one')
        return None
    try:
        return ChatTemplate(tokenizer)
    except ConfigError:
        if prompt_format == 'chat':
            raise
        return None  # auto: a template that cannot render a reply is not used
