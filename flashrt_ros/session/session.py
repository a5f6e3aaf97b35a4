"""The session of one configured runtime: its mode, its turns and its interrupts."""

from flashrt_ros.runtime import FlashRTError, InvalidRequestError

from .interrupts import Interrupts
from .lm import BUSY_MESSAGE, LMMode
from .policy import PolicyMode
from .speech import SpeechMode
from .turns import TurnScheduler

MODES = {mode.name: mode for mode in (LMMode, PolicyMode, SpeechMode)}


class Session:
    """Who may touch one runtime's state, and when; the node only maps ROS onto it."""

    def __init__(self, runtime, mode, param, outputs):
        """
        Serve `runtime` in mode `mode` (a MODES key).

        param(name) reads a live setting (the node's parameters); outputs is where the
        session publishes and logs (see outputs.Outputs).
        """
        cls = MODES[mode]
        if not cls.serves(runtime):
            fit = next((m for m in MODES.values() if m.serves(runtime)), None)
            kind = fit.kind if fit else 'not a model any mode serves'
            hint = f'; set mode to {fit.name}' if fit else ''
            raise FlashRTError(f'model {runtime.config.model!r} is {kind}{hint}')
        self.runtime = runtime
        self.mode = cls(runtime, param, outputs)
        self._out = outputs
        self._param = param
        self.turns = TurnScheduler(runtime, param, outputs, self.mode.run_turn,
                                   lambda turn: self.interrupts.after_cancel(turn),
                                   self.mode.check_turn)
        self.interrupts = Interrupts(runtime, self.turns, self.mode, param, outputs)
        self.home_ready = False

    @property
    def active(self):
        return self.turns.active

    def warm_up(self, home, system_prompt, progress=None):
        """
        Warm up and, the first time, take the home capsule; return its info (or None).

        The session is not active yet: turns.set_active(True) admits requests.

        The home capsule is the reset state with what the mode puts before every episode
        (a language model's system prompt), pinned in the device tier. progress(stage) is
        told each stage (warm-up, home prefill).
        """
        progress = progress or (lambda stage: None)
        rt = self.runtime
        progress('warm-up (throwaway steps; CUDA graph capture on CUDA)')
        rt.warmup()
        info = None
        if not self.home_ready:
            rt.reset()
            progress(f"home prefill (the {self.mode.name} mode's context), then the "
                     f'{home!r} snapshot')
            self.mode.prepare_home(system_prompt)
            info = rt.snapshot(home, 'device', pinned=True)
            self.home_ready = True
        return info

    def deactivate(self, message):
        """Stop admitting, drop queued turns, stop the running one; return if it ended."""
        self.turns.set_active(False)
        self.mode.forget_inputs()  # an observation pending now is stale after activate
        self.turns.drop_queued(message)
        with self.turns.stopped() as stopped:
            return stopped

    def close(self):
        """End queued turns and the generation thread; free the runtime (disk capsules stay)."""
        self.turns.set_active(False)
        self.turns.drop_queued('the node is closing')
        self.turns.stop()
        self.runtime.close()

    def reserve_turn(self, source):
        """Count a generation request in, or return why it is refused ('' if admitted)."""
        return self.turns.reserve(source, self.mode.turn_refusal(source))

    def snapshot(self, name, tier='device', pinned=False):
        """Snapshot the live state as `name` (refused for a protected home capsule)."""
        self._check_not_home(name, 'replace')
        return self.runtime.snapshot(name, tier, pinned)

    def fork(self, source, target, tier=None):
        """Copy capsule `source` to `target` (refused onto a protected home capsule)."""
        if source != target:  # the runtime says why a copy onto itself is refused
            self._check_not_home(target, 'replace')
        return self.runtime.fork(source, target, tier)

    def check_import(self, name):
        """Refuse an import as `name` onto a protected home capsule (before any bytes move)."""
        self._check_not_home(name, 'replace')

    def delete(self, name):
        """Delete capsule `name` (refused for a protected home capsule)."""
        self._check_not_home(name, 'delete')
        return self.runtime.delete_capsule(name)

    def _check_not_home(self, name, what):
        home = self._param('home_capsule')
        if name == home and self._param('protect_home'):
            raise InvalidRequestError(
                f'capsule {home!r} is the home capsule, which ~/reset and the restore_home '
                f'policy restore; it cannot be {what}d while protect_home is true (set it '
                'false to allow that, or use another name)')

    def restore(self, name, mode='full'):
        """Restore between turns (BusyError while one runs); inputs before it are dropped."""
        with self.turns.exclusive(BUSY_MESSAGE), self.mode.quiet():
            info = self.runtime.restore(name, mode)
            self.mode.forget_inputs()
        return info

    def rollback(self, boundaries):
        """Roll back between turns (BusyError while one runs); inputs before it are dropped."""
        with self.turns.exclusive(BUSY_MESSAGE), self.mode.quiet():
            info = self.runtime.rollback(boundaries)
            self.mode.forget_inputs()
        return info
