"""
Helpers of the session tests: recording outputs that can hold a call at a gate.

No ROS here: the session layer is driven directly, and each race is made certain by
holding one output call (a chunk, an event, a goal start) on a threading.Event.
"""

import threading
import time

from flashrt_ros.session import Outputs

HOME = 'home'
SYSTEM_PROMPT = 'You are a helpful robot.'
LONG_PROMPT = 'Describe the room.'  # runs to max_new_tokens from home (no early eos)
SETTINGS = {
    'goal_policy': 'reject', 'interrupt_policy': 'stop', 'home_capsule': HOME,
    'interrupt_timeout': 5.0, 'max_new_tokens': 16, 'token_chunk': 1, 'stop_strings': [],
    'stepping': 'observation', 'control_rate': 50.0, 'protect_home': True,
    'sync_slop': 0.05, 'max_observation_age': 1.0, 'joint_names': [],
    'end_of_utterance_s': 0.8, 'end_of_utterance_db': -45.0,
}


class Gate:
    """A place where an output call waits until the test opens it."""

    def __init__(self):
        self.reached = threading.Event()
        self.opened = threading.Event()

    def wait_here(self):
        self.reached.set()
        assert self.opened.wait(10.0), 'the test never opened the gate'


class Recorder(Outputs):
    """Outputs that record everything and can hold a call at a Gate."""

    def __init__(self):
        self.events, self.chunks, self.actions_out, self.logs = [], [], [], []
        self.action_stamps = []
        self.transcripts, self.ends = [], []
        self.started = []
        self.gates = {}  # 'chunk:<index>', 'final', 'start', 'event:<operation>' -> Gate

    def hold(self, where):
        gate = self.gates[where] = Gate()
        return gate

    def _gate(self, where):
        gate = self.gates.get(where)
        if gate is not None and not gate.opened.is_set():
            gate.wait_here()

    def event(self, operation, name, tier, size_bytes, latency_ms, success, message,
              stamp=None, stages=()):
        self._gate(f'event:{operation}')
        self.events.append({'operation': operation, 'name': name, 'tier': tier,
                            'size_bytes': size_bytes, 'latency_ms': latency_ms,
                            'success': success, 'message': message, 'stamp': stamp,
                            'stages': list(stages), 'at': time.time()})

    def chunk(self, turn, index, ids, text, stop_reason, final=False):
        self.chunks.append({'turn': turn, 'index': index, 'ids': list(ids), 'text': text,
                            'stop_reason': stop_reason, 'final': final, 'state': turn.state})
        self._gate('final' if final else f'chunk:{index}')

    def actions(self, step, rows, names, stamp=None):
        self.actions_out.append((step, rows, list(names)))
        self.action_stamps.append(stamp)

    def transcript(self, utterance, index, ids, text, final, words=(), stamp=None):
        self.transcripts.append({'utterance': utterance, 'index': index, 'ids': list(ids),
                                 'text': text, 'final': final, 'words': list(words),
                                 'stamp': stamp})

    def end_of_utterance(self, utterance, index, end, stamp=None):
        self.ends.append({'utterance': utterance, 'index': index, 'end': end, 'stamp': stamp})

    def start_goal(self, turn):
        self.started.append(turn)
        self._gate('start')

    def not_active_message(self):
        return 'the session is not active'

    def now(self):
        return time.time()

    def log(self, level, message, throttle_s=None):
        self.logs.append((level, message))

    def finals(self):
        return [c for c in self.chunks if c['final']]


def wait_until(predicate, timeout=10.0):
    """Poll predicate every 5 ms; return whether it came true within timeout seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True
