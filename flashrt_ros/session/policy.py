"""
Policy mode: observations in, action chunks out.

stepping 'observation': each observation is one control step (Runtime.act, a committed
boundary) and its whole chunk is published. stepping 'timer': tick() steps on the newest
observation (if one arrived) and publishes one queued action, so the runtime's action queue
is what the robot executes. `_gate` makes taking an observation in (the staleness check
and the step, or the store for the next tick) and a tick each one step against
forget_inputs and against an interrupt (quiet()), which run on other threads: nothing from
before them is folded in, and no queued action goes out between an interrupt's restore
and its dropping the queue.
"""

import threading
import time

from flashrt_ros.runtime import FlashRTError, InvalidRequestError

from .modes import Mode

STEPPINGS = ('observation', 'timer')


class PolicyMode(Mode):
    """A robot policy: the observation gate and the stepping rules."""

    name = 'policy'
    kind = 'a robot policy'
    accepts_observations = True

    def __init__(self, runtime, param, outputs):
        super().__init__(runtime, param, outputs)
        self._timer_stepping = param('stepping') == 'timer'
        self._gate = threading.RLock()  # guards the two fields below and taking one in
        self._latest = None             # newest valid observation (timer stepping)
        self._interrupted_at = 0.0      # wall time before which observations are stale

    @staticmethod
    def serves(runtime):
        return runtime.is_policy

    def turn_refusal(self, source):
        return (f'{source} rejected: the node runs a robot policy (mode policy); '
                'publish observations on ~/observation instead')

    @property
    def observation_names(self):
        """'<joint>/position|velocity|effort' of each observation entry (may be empty)."""
        return self.runtime.policy_spec.observation_names

    def tick_period(self):
        return 1.0 / self._param('control_rate') if self._timer_stepping else None

    def observe(self, values, received):
        """Take an observation vector that the middleware received at wall time `received`."""
        with self._gate:
            if received <= self._interrupted_at:
                return  # sent before the last interrupt/reset: it belongs to the stopped episode
            if not self._timer_stepping:
                self._step(values)
                return
            try:
                self.runtime.check_observation(values)
            except FlashRTError as exc:
                self.reject_observation(str(exc))
                return
            self._latest = values

    def tick(self):
        rt = self.runtime
        with self._gate:
            values, self._latest = self._latest, None
            if values is not None:
                self._step(values)
            try:
                action = rt.next_action()
            except FlashRTError as exc:
                self._out.log('warning', f'control tick: {exc}', throttle_s=5.0)
                return
            if action is not None:
                self._out.actions(rt.position, [action.tolist()], rt.policy_spec.joint_names)

    def forget_inputs(self, before=None):
        with self._gate:
            self._interrupted_at = max(self._interrupted_at, before or time.time())
            self._latest = None

    def quiet(self):
        return self._gate

    def after_interrupt(self):
        # After the restore: a restored capsule may hold an older chunk's queue.
        self.runtime.drop_actions()
        return '; action queue dropped'

    def diagnostics(self, stats):
        return {'control_step_ms': f'{stats.control_step_s * 1e3:.3f}'}

    def reject_observation(self, reason):
        message = (f'observation rejected: {reason}; state unchanged at step '
                   f'{self.runtime.position}')
        self._out.log('warning', message, throttle_s=1.0)
        self._out.event('observation', '', '', 0, 0.0, False, message)

    def _step(self, values):
        """Fold one observation in (a committed boundary); observation stepping publishes."""
        try:
            chunk = self.runtime.act(values)
        except InvalidRequestError as exc:  # bad input, refused before the state was touched
            self.reject_observation(str(exc))
            return
        except Exception as exc:  # the model failed mid-step: report it and keep serving
            message = f'control step failed: {exc!r}'
            self._out.log('error', message)
            self._out.event('observation', '', '', 0, 0.0, False, message)
            return
        if not self._timer_stepping:
            self._out.actions(chunk.step, chunk.actions.tolist(), chunk.names)
