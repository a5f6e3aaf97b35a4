"""
Policy mode: observations in, action chunks out.

stepping 'observation': each observation is one control step (Runtime.act, a committed
boundary) and its whole chunk is published. stepping 'timer': tick() steps on the newest
observation (if one arrived) and publishes one queued action, so the runtime's action queue
is what the robot executes. `_gate` makes taking an observation in (the staleness check
and the step, or the store for the next tick) and a tick each one step against
forget_inputs, a restore service call and a STOP (quiet()), which run on other threads:
nothing from before them is folded in.

An interrupt or reset that restores or rolls back does not wait for the step in flight: it
counts an epoch, and its restore abandons a running act() (PreemptedError there). A step
asks, under the runtime's step lock, whether the epoch moved before it starts, and a chunk
or an action goes out only under `_queue_lock` with the epoch unchanged; the interrupt
holds that lock from before its restore until the queue is dropped, so no action of the
stopped episode or of the restored queue goes out after it.
"""

import contextlib
import threading
import time

from flashrt_ros.runtime import ConfigError, FlashRTError, InvalidRequestError, PreemptedError
from flashrt_ros.runtime.modes.policy import STATE_KEY

from .modes import Mode
from .sync import ObservationSync

STEPPINGS = ('observation', 'timer')


class PolicyMode(Mode):
    """A robot policy: the observation gate and the stepping rules."""

    name = 'policy'
    kind = 'a robot policy'
    accepts_observations = True

    def __init__(self, runtime, param, outputs):
        super().__init__(runtime, param, outputs)
        self._timer_stepping = param('stepping') == 'timer'
        self._gate = threading.RLock()  # guards the fields below and taking one in
        self._queue_lock = threading.Lock()  # a chunk or an action going out; _epoch
        self._epoch = 0                 # interrupts begun that replace the state
        self._seen = 0                  # the epoch whose inputs _sync and _latest hold
        self._latest = None             # newest valid observation (timer stepping)
        self._interrupted_at = 0.0      # wall time before which observations are stale
        self._stamp = None              # stamp of the observation of the last chunk
        spec = runtime.policy_spec
        # A checkpoint without joint names (LeRobot's) is given them by the joint_names
        # parameter: the actions' names and, as positions, the state's.
        self._joints = tuple(param('joint_names') or ())
        if self._joints and not spec.joint_names and (
                len(self._joints) != spec.action_dim or (
                    not spec.observation_names and len(self._joints) != spec.obs_dim)):
            raise ConfigError(
                f'joint_names has {len(self._joints)} names; this policy has {spec.action_dim} '
                f'action dimensions and a state of {spec.obs_dim} (its positions)')
        self._sync = ObservationSync([STATE_KEY] * bool(spec.obs_dim) +
                                     [key for key, _ in spec.images], _ns(param('sync_slop')))
        self._missing_said = {}         # input -> wall time its absence was last reported
        self._instruction = None        # the newest instruction text (a VLA's)

    @staticmethod
    def serves(runtime):
        return runtime.is_policy

    def turn_refusal(self, source):
        return (f'{source} rejected: the node runs a robot policy (mode policy); '
                'publish observations on ~/observation instead')

    @property
    def observation_names(self):
        """'<joint>/position|velocity|effort' of each observation entry (may be empty)."""
        spec = self.runtime.policy_spec
        return spec.observation_names or tuple(f'{joint}/position' for joint in self._joints)

    @property
    def joint_names(self):
        """Return the name of each action dimension (may be empty)."""
        return self.runtime.policy_spec.joint_names or self._joints

    def tick_period(self):
        return 1.0 / self._param('control_rate') if self._timer_stepping else None

    @property
    def image_keys(self):
        """'observation.images.<camera>' of each camera the policy takes."""
        return [key for key, _ in self.runtime.policy_spec.images]

    def observe_input(self, key, value, stamp, received, now):
        """
        Take one input (the state vector or one camera's image) stamped `stamp`.

        Inputs are matched by stamp (sync.py, sync_slop); a complete match is observed.
        stamp and now are integer nanoseconds on the node's clock, received is wall time (s)
        at the middleware. A stale stamp (older than max_observation_age) is refused on
        ~/events, and so are inputs that waited that long for another one (a silent camera).
        """
        if key not in self._sync.keys:
            self.reject_observation(f'this policy takes no {key} (it takes '
                                    f'{list(self._sync.keys)})', key=key)
            return
        age_limit = self._param('max_observation_age')
        if age_limit > 0 and now - stamp > _ns(age_limit):
            self.reject_observation(f'{key} is stamped {(now - stamp) * 1e-9:.3f} s ago, more '
                                    f'than max_observation_age ({age_limit:g} s)', key=key)
            return
        with self._gate:
            if received <= self._interrupted_at:
                return  # sent before the last interrupt/reset: it belongs to the stopped episode
            self._catch_up()
            observation, stamp = self._sync.put(key, value, stamp)
            if observation is not None:
                self.observe(observation, received, stamp)
                return
            missing = self._sync.expire(now - _ns(age_limit)) if age_limit > 0 else ''
            if missing:
                self.reject_observation(
                    f'no {missing} came within sync_slop ({self._param("sync_slop"):g} s) of '
                    f'the other inputs for max_observation_age ({age_limit:g} s): is its topic '
                    'publishing?', key=missing)

    def observe(self, values, received, stamp=None):
        """Take an observation (vector or dict) the middleware received at wall time `received`."""
        with self._gate:
            if received <= self._interrupted_at:
                return  # sent before the last interrupt/reset: it belongs to the stopped episode
            self._catch_up()
            if not self._timer_stepping:
                self._step(values, stamp)
                return
            try:
                self.runtime.check_observation(values)
            except FlashRTError as exc:
                self.reject_observation(str(exc))
                return
            self._latest = values, stamp

    def tick(self):
        rt = self.runtime
        with self._gate:
            self._catch_up()
            epoch = self._epoch
            if self._latest is not None and (rt.policy_spec.replan == 'every_step'
                                             or not len(rt.pending_actions())):
                (values, stamp), self._latest = self._latest, None
                self._step(values, stamp)
            with self._queue_lock:
                if self._epoch != epoch:
                    return  # an interrupt came: the queue is the restored one, to be dropped
                try:
                    action = rt.next_action()
                except FlashRTError as exc:
                    self._out.log('warning', f'control tick: {exc}', throttle_s=5.0)
                    return
                if action is not None:
                    self._out.actions(rt.position, [action.tolist()], self.joint_names,
                                      self._stamp)

    @property
    def takes_instruction(self):
        """Whether the policy keeps an instruction (a VLA): ~/instruction feeds it."""
        return self.runtime.adapter.takes_instruction

    def prepare_home(self, system_prompt):
        # The home capsule holds the instruction in force at activation (none if none came).
        if self._instruction is not None:
            self.runtime.instruct(self._instruction)

    def instruct(self, text, active=True):
        """
        Make `text` the policy's instruction (a committed boundary; the queue is dropped).

        While the node is not active it is kept, and the home capsule taken at activation
        holds it. Said on ~/events either way.
        """
        with self._gate:
            if not active:
                self._instruction = text
                self._out.event('instruction', '', '', len(text), 0.0, True,
                                'instruction kept: the home capsule taken at activation '
                                'holds it')
                return
            t0 = time.perf_counter()
            try:
                self.runtime.instruct(text)
            except FlashRTError as exc:
                self._out.event('instruction', '', '', len(text), 0.0, False,
                                f'{exc}; the instruction in force is unchanged')
                return
            self._instruction = text
            self._out.event('instruction', '', '', len(text),
                            (time.perf_counter() - t0) * 1e3, True,
                            f'instruction in force from step {self.runtime.position}; action '
                            'queue dropped')

    def forget_inputs(self, before=None):
        with self._gate, self._queue_lock:
            self._interrupted_at = max(self._interrupted_at, before or time.time())
            self._seen = self._epoch
            self._latest = None
            self._sync.clear()

    def quiet(self):
        return self._gate

    @contextlib.contextmanager
    def interrupting(self, received, replaces):
        if not replaces:  # a STOP waits for the step in flight: the gate, as a restore call
            with super().interrupting(received, replaces):
                yield
            return
        with self._queue_lock:  # held until the queue is dropped (after_interrupt)
            self._epoch += 1
            self._interrupted_at = max(self._interrupted_at, received)
            yield

    def _catch_up(self):
        """Drop the inputs held from before an interrupt that replaced the state (gate held)."""
        if self._seen != self._epoch:
            self._seen = self._epoch
            self._latest = None
            self._sync.clear()

    def after_interrupt(self):
        # After the restore: a restored capsule may hold an older chunk's queue.
        self.runtime.drop_actions()
        return '; action queue dropped'

    def diagnostics(self, stats):
        values = {'control_step_ms': f'{stats.control_step_s * 1e3:.3f}'}
        if self.runtime.policy_spec.note:
            values['policy'] = self.runtime.policy_spec.note
        return values

    def reject_observation(self, reason, key=None):
        """Say why an observation was refused (log and ~/events; once a second per `key`)."""
        if key is not None:
            now = time.monotonic()
            if now - self._missing_said.get(key, -1.0) < 1.0:
                return
            self._missing_said[key] = now
        message = (f'observation rejected: {reason}; state unchanged at step '
                   f'{self.runtime.position}')
        self._out.log('warning', message, throttle_s=1.0)
        self._out.event('observation', '', '', 0, 0.0, False, message)

    def _step(self, values, stamp):
        """Fold one observation in (a committed boundary); observation stepping publishes."""
        epoch = self._epoch
        try:
            chunk = self.runtime.act(values, should_stop=lambda: self._epoch != epoch)
        except PreemptedError:  # an interrupt replaced the state: its event says so
            return
        except InvalidRequestError as exc:  # bad input, refused before the state was touched
            self.reject_observation(str(exc))
            return
        except Exception as exc:  # the model failed mid-step: report it and keep serving
            message = f'control step failed: {exc!r}'
            self._out.log('error', message)
            self._out.event('observation', '', '', 0, 0.0, False, message)
            return
        with self._queue_lock:
            if self._epoch != epoch:
                return  # an interrupt came as it ended: the chunk is the stopped episode's
            self._stamp = stamp
            if not self._timer_stepping:
                self._out.actions(chunk.step, chunk.actions.tolist(), self.joint_names, stamp)


def _ns(seconds):
    return int(round(seconds * 1e9))
