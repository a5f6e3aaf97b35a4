"""Self-contained byte-level tokenizer for the built-in models (no files, no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

MARKER_FILE = 'flashrt_byte_tokenizer.json'  # saved next to a checkpoint that uses this tokenizer


class ByteTokenizer:
    """Token i < 256 is byte i; a few specials follow. Any text round-trips exactly."""

    BOS, EOS, PAD = 256, 257, 258
    specials = {'<bos>': BOS, '<eos>': EOS, '<pad>': PAD}
    vocab_size = 259
    chat_template = None  # raw text only

    def encode_first(self, text: str) -> list[int]:
        return self.encode(text)  # no BOS: the built-ins were never given one

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.EOS,)

    def encode(self, text: str) -> list[int]:
        return list(text.encode('utf-8'))

    def decode(self, ids: list[int]) -> str:
        # Specials carry no text; a cut multi-byte character shows as U+FFFD until completed.
        return bytes(i for i in ids if 0 <= i < 256).decode('utf-8', errors='replace')

    def save(self, directory: str | Path) -> None:
        path = Path(directory) / MARKER_FILE
        path.write_text(json.dumps({'type': 'byte', 'specials': self.specials}, indent=1))

    @staticmethod
    def saved_in(directory: str | Path) -> bool:
        return (Path(directory) / MARKER_FILE).is_file()


class HFTokenizer:
    """Adapts a transformers tokenizer to the same small interface."""

    def __init__(self, tok, eos_ids: tuple[int, ...]):
        self._tok = tok
        self.vocab_size = len(tok)
        ids = set(eos_ids)
        if tok.eos_token_id is not None:
            ids.add(int(tok.eos_token_id))
        self._eos = tuple(sorted(ids))
        self.chat_template = tok.chat_template if isinstance(tok.chat_template, str) else None
        self.special_ids = frozenset(tok.all_special_ids) | frozenset(
            i for i, t in tok.added_tokens_decoder.items() if t.special)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    def encode(self, text: str) -> list[int]:
        # No automatic BOS/template: the caller's text is fed as given, so that a prompt
        # split over several turns tokenizes the same as when sent at once (where possible).
        return list(self._tok.encode(text, add_special_tokens=False))

    def encode_first(self, text: str) -> list[int]:
        """Encode the context's first segment, with the leading specials (BOS) it expects."""
        plain = self.encode(text)
        full = list(self._tok.encode(text, add_special_tokens=True))
        # Only what goes before the text: a trailing EOS some tokenizers add is no prefix.
        for start in range(len(full) - len(plain) + 1):
            if full[start:start + len(plain)] == plain:
                return full[:start] + plain
        return plain

    def decode_verbatim(self, ids: list[int]) -> str:
        """Decode with the special tokens as text (a reply as the conversation records it)."""
        return self._tok.decode(ids, skip_special_tokens=False)

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        """Render messages with the chat template (text; its own specials, BOS included)."""
        return self._tok.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=generation_prompt)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)
