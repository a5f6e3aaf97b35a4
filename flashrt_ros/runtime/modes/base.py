"""
The seam between the Runtime facade and the kind of model it runs (session/modes.py's twin).

The facade holds what every mode shares (the arena, the codec, the store, the ring, the
writer slot) and hands each mode's own calls to its driver. A driver owns its extra arena
state, its warm-up, its calls and its entries in stats(); the calls of the other modes are
refused here, with one message per mode.
"""

from __future__ import annotations

from ..errors import InvalidRequestError
from ..state.arena import StateSpec

# Who takes a refused call, said in the refusal.
LM = "a language model (e.g. 'default')"
POLICY = 'a robot policy (e.g. builtin:tiny-policy)'
SPEECH = 'a speech model (e.g. builtin:tiny-stt)'


class Driver:
    """What differs between kinds of model; the defaults are those of a mode that has none."""

    name = ''
    kind = ''  # what the model is, for the refusal ('a language model')
    calls = ''  # what to call instead, for the refusal
    abortable_steps = True  # a preemption may abandon a step in flight (writer.py)
    chat = None  # the conversation renderer (a language model's; None: raw text)
    engine = None  # what runs the model's forward over the arena (set by bind)

    def __init__(self, rt, adapter):
        self.rt, self.adapter = rt, adapter

    @staticmethod
    def serves(adapter) -> bool:
        """Whether this driver runs `adapter`'s kind of model."""
        raise NotImplementedError

    def refused(self, call: str, needs: str) -> InvalidRequestError:
        """Return the error for `call`, a call of another mode that `needs` another model."""
        return InvalidRequestError(f'model {self.rt.config.model!r} is {self.kind}: '
                                   f'{self.calls}; {call} needs {needs}')

    # ---- building the runtime (Runtime.__init__, in this order) -----------------------

    def attach(self, adapter):
        """Return (adapter, speculation note): only a language model's may draft."""
        note = 'off' if not self.rt.config.speculation else (
            f'off: a {type(adapter).__name__} has no MTP head')
        return adapter, note

    def state_specs(self) -> list[StateSpec]:
        """Return the arena state the mode adds to the adapter's."""
        return []

    def bind(self, views: dict):
        """Build what steps the model over the bound arena views; return the engine."""
        return None

    def speculator(self):
        """Return what runs speculative rounds (None: turns decode plainly)."""
        return None

    @property
    def vocab_size(self) -> int | None:
        """Return the ids a pending token may take (None: the mode has no tokens)."""
        return self.adapter.vocab_size

    # ---- lifecycle ---------------------------------------------------------------------

    def warm(self) -> None:
        """Run throwaway steps from the zeroed state (the facade puts the live one back)."""

    def interrupted(self) -> None:
        """Do what an interrupt() does for this mode beyond stopping a turn."""

    def close(self) -> None:
        """Drop the mode's graphs and its views of the arena."""
        self.adapter = self.engine = None

    def stats(self) -> dict:
        """Return this mode's entries of RuntimeStats (the facade adds the shared ones)."""
        engine = self.engine  # None once closed
        return {'decode_tokens_per_s': 0.0,
                'cuda_graph': engine is not None and engine.graph is not None,
                'cuda_graph_note': None if engine is None else engine.graph_error,
                'cuda_graph_replays': 0 if engine is None else engine.replays,
                'speculation': {'enabled': False, 'note': self.rt.speculation_note}}

    # ---- a language model's calls (modes/lm/) ------------------------------------------

    def tokenize(self, text):
        raise self.refused('tokenize()', LM)

    def detokenize(self, ids):
        raise self.refused('detokenize()', LM)

    def prefill(self, prompt, raw, role):
        raise self.refused('prefill()', LM)

    def sampling(self, *limits):
        raise self.refused('sampling()', LM)

    def generate(self, prompt, raw, *limits):
        raise self.refused('generate()', LM)

    # ---- a robot policy's calls (modes/policy.py) --------------------------------------

    policy_spec = None

    def act(self, observation, should_stop=None):
        raise self.refused('act()', POLICY)

    def check_observation(self, observation):
        raise self.refused('act()', POLICY)

    def next_action(self):
        raise self.refused('the action queue', POLICY)

    def pending_actions(self):
        raise self.refused('the action queue', POLICY)

    def drop_actions(self):
        raise self.refused('the action queue', POLICY)

    def instruct(self, text):
        raise self.refused('instruct()', POLICY)

    def encode(self, observation):
        raise self.refused('encode()', POLICY)

    def sample(self):
        raise self.refused('sample()', POLICY)

    # ---- a speech model's calls (modes/speech.py) --------------------------------------

    speech_spec = None

    def check_audio(self, samples, sample_rate):
        raise self.refused('feed_audio()', SPEECH)

    def feed_audio(self, samples, sample_rate, should_stop):
        raise self.refused('feed_audio()', SPEECH)

    def flush(self, should_stop):
        raise self.refused('flush()', SPEECH)
