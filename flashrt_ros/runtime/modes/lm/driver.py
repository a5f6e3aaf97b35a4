"""
The language model's driver: prompts in, streamed token turns out (generation.py).

Its arena state adds the engine's last logits and token history; with speculation on, the
MTP head's state joins through the adapter (speculation.attach). With a chat template a
text prompt is a conversation turn and the messages are part of the live state (chat.py).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .chat import chat_template, RAW, TurnPlan
from .generation import check_fits, check_vocab, Generation, prefill_ids, prompt_ids, Sampling
from .speculation import attach, Speculator
from ..base import Driver
from ...engine import Engine
from ...errors import InvalidRequestError
from ...models.hf import GenerationDefaults, resolve_model
from ...models.speculative import MTPAdapter
from ...state.arena import StateSpec

MIN_TEMPERATURE = 1e-4  # below it the scaled logits overflow: use 0 (greedy) instead
# The same bound as a float32 rounds it (a ROS message's temperature is a float32).
_MIN_TEMPERATURE_F32 = float(torch.tensor(MIN_TEMPERATURE, dtype=torch.float32))


class LMDriver(Driver):
    """Prefill, generate and speculative rounds of a causal language model."""

    name = 'lm'
    kind = 'a language model'
    calls = 'call prefill(prompt) and generate(prompt)'

    def __init__(self, rt, adapter):
        super().__init__(rt, adapter)
        # ConfigError if asked for and the tokenizer has no usable template (before the
        # arena is allocated).
        self.chat = chat_template(adapter.tokenizer, rt.config.prompt_format)
        self.decode_tps = 0.0  # of the last turn that decoded more than one token

    @staticmethod
    def serves(adapter) -> bool:
        return True  # a CausalLMAdapter, or any adapter no other mode takes

    def attach(self, adapter):
        """Wrap the adapter with its MTP head when speculation is on (or say why not)."""
        if not self.rt.config.speculation:
            return adapter, 'off'
        self.adapter, note = attach(adapter, resolve_model(self.rt.config.model))
        return self.adapter, note

    def state_specs(self) -> list[StateSpec]:
        return Engine.state_specs(self.adapter.vocab_size, self.rt.config.max_seq_len)

    def bind(self, views: dict) -> Engine:
        rt = self.rt
        self.engine = Engine(self.adapter, views['logits'], views['tokens'], rt.config.cuda_graphs)
        # Never sample an id the tokenizer has no token for.
        self.engine.limit_vocab(min(self.adapter.vocab_size, rt.tokenizer.vocab_size))
        return self.engine

    def speculator(self) -> Speculator | None:
        config = self.rt.config
        if not isinstance(self.adapter, MTPAdapter):
            return None
        return Speculator(self.rt, config.speculative_tokens, config.speculative_verify)

    def warm(self) -> None:
        """Prefill and decode a token; on CUDA capture the decode step (and the round's)."""
        rt = self.rt
        self.engine.prefill([0], 0)
        self.engine.decode(0, 1)
        if rt.config.cuda_graphs and rt.device.type == 'cuda':
            rt.arena.zero_()
            if self.engine.capture(rt.arena.views) and rt.speculator is not None:
                rt.speculator.capture(rt.arena.views)

    def close(self) -> None:
        self.engine.drop_graph()
        if self.rt.speculator is not None:
            self.rt.speculator.close()
        super().close()

    def stats(self) -> dict:
        speculator = self.rt.speculator
        return dict(super().stats(), decode_tokens_per_s=self.decode_tps,
                    speculation=(dict(speculator.stats(), enabled=True) if speculator
                                 else {'enabled': False, 'note': self.rt.speculation_note}))

    # ---- calls -------------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        return self.rt.tokenizer.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.rt.tokenizer.decode(list(ids))

    def _segment(self, prompt: str | Sequence[int], raw: bool, role: str,
                 reply: bool) -> tuple[list[int], TurnPlan | None]:
        """
        Return a prompt's ids and what it adds to the conversation (lock held).

        Text is a `role` message rendered by the chat template, unless raw or the runtime
        has none; token ids are always raw. A raw segment in a conversation is recorded by
        its role only ('raw'); outside one, nothing is recorded.
        """
        rt, cursor = self.rt, self.rt.cursor
        if self.chat is not None and not raw and isinstance(prompt, str):
            ids, plan = self.chat.plan(cursor.messages, role, prompt, reply)
            return check_vocab(rt.tokenizer, self.adapter.vocab_size, ids), plan
        first = cursor.position == 0 and cursor.pending is None
        ids = prompt_ids(rt.tokenizer, self.adapter.vocab_size, prompt, first)
        return ids, (TurnPlan(cursor.messages + (RAW,)) if self.chat is not None else None)

    def prefill(self, prompt: str | Sequence[int], raw: bool, role: str) -> int:
        rt = self.rt
        with rt.writer.lock:
            rt._check_idle()
            ids, plan = self._segment(prompt, raw, role, reply=False)
            prefill_ids(rt, ids)
            if plan is not None:
                rt.cursor.messages = plan.messages
            rt.writer.commit()
            return rt.cursor.position

    def sampling(self, max_new_tokens, temperature, top_k, top_p, seed, stop,
                 eos) -> Sampling:
        defaults = getattr(self.adapter, 'generation', None) or GenerationDefaults()
        temperature = defaults.temperature if temperature is None else temperature
        top_k = defaults.top_k if top_k is None else top_k
        top_p = defaults.top_p if top_p is None else top_p
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)
                and (temperature == 0 or temperature >= _MIN_TEMPERATURE_F32)):
            raise InvalidRequestError(
                f'temperature {temperature!r} is not valid: use 0 (greedy) or a finite '
                f'number >= {MIN_TEMPERATURE:g}')
        sampling = Sampling.checked(max_new_tokens, temperature, top_k, top_p, seed, stop, eos)
        if temperature > 0 and self.rt.speculator is not None:
            raise InvalidRequestError(
                'speculative decoding is greedy only: use temperature 0, or a runtime with '
                'speculation off for sampled turns')
        return sampling

    def generate(self, prompt: str | Sequence[int] | None, raw: bool, *limits) -> Generation:
        rt, cursor = self.rt, self.rt.cursor
        sampling = self.sampling(*limits)
        with rt.writer.lock:
            rt._check_idle()
            ids, plan = None, None
            if prompt is not None:
                ids, plan = self._segment(prompt, raw, 'user', reply=True)
            elif self.chat is not None and not raw:
                raise InvalidRequestError(
                    'a conversation turn needs a user message: pass a prompt, or raw=True to '
                    'continue the context as it is')
            elif self.chat is not None:
                plan = TurnPlan(cursor.messages + (RAW,))
            if ids is not None:  # refused now, not reported as a turn that ended
                check_fits(rt, ids, 1 + len(plan.closing) if plan and plan.closing else 0)
            if ids is None and cursor.position == 0 and cursor.pending is None:
                raise InvalidRequestError(
                    'nothing to continue from: the state is empty; pass a prompt'
                )
            gen = Generation(rt, ids, sampling, plan)
            rt.writer.claim(gen)
            return gen
