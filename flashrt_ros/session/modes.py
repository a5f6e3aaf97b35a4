"""
The seam between the session and the kind of model it serves.

A mode is one module (lm.py, policy.py, speech.py) with one Mode subclass.
The node and the session call only the methods below; whatever a kind of model needs
beyond them (its inputs, its outputs) stays inside its module.
"""

import contextlib


class Mode:
    """What differs between kinds of model; the defaults are those of a mode that has none."""

    name = ''
    kind = ''  # the kind of model, for messages ('a language model')
    accepts_observations = False  # whether ~/observation* feed it (observe, reject_observation)
    accepts_audio = False  # whether ~/audio* feed it (audio, reject_audio, flush)

    def __init__(self, runtime, param, outputs):
        self.runtime = runtime
        self._param = param
        self._out = outputs

    @staticmethod
    def serves(runtime):
        """Whether this mode can drive `runtime`'s model."""
        raise NotImplementedError

    def turn_refusal(self, source):
        """Why a generation request (~/generate goal, ~/prompt) is refused; '' if it runs."""
        return f'{source} rejected: the node runs mode {self.name}, which runs no turns'

    def check_turn(self, request):
        """Why a turn's own parameters are refused before it changes anything; '' if fine."""
        return ''

    def run_turn(self, turn, should_stop):
        """Run a turn's generation (generation thread); return its result or None if failed."""
        raise NotImplementedError(f'mode {self.name} runs no turns')

    def prepare_home(self, system_prompt):
        """Bring a freshly reset state to what the home capsule holds."""

    def tick(self):
        """One period of the stepping timer (see tick_period)."""

    def tick_period(self):
        """Seconds between tick() calls, or None for no timer."""
        return None

    def forget_inputs(self, before=None):
        """Drop inputs received before `before` (default now): they belong to a past episode."""

    def quiet(self):
        """Return a context in which the mode takes no input in (around a restore)."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def interrupting(self, received, replaces):
        """
        Hold inputs back around an interrupt or reset received at wall time `received`.

        Inputs received before it are dropped, and none is taken in until the state is
        where the interrupt puts it. replaces: the state is restored or rolled back (a
        mode may then let the restore abandon its step in flight instead of waiting).
        """
        with self.quiet():
            self.forget_inputs(received)
            yield

    def after_interrupt(self):
        """Finish an interrupt or reset for this mode; return a note for its event."""
        return ''

    def diagnostics(self, stats):
        """Mode-specific diagnostic values {key: value} from the runtime's stats."""
        return {}
