"""
Figure fig5modes: interrupts through ROS during a control step, an audio chunk and a prompt.

Three node processes with the robot settings (through_ros.RT). Policy: `builtin:act-arm`
(a camera and two joints, one control step per observation); every round publishes one
observation and, a random time into its control step, an Interrupt(RESTORE home). Speech:
`builtin:tiny-stt`; every round publishes one AudioChunk of AUDIO_S seconds and, AUDIO_AT_S
after it, an Interrupt(RESTORE home), which cuts the chunk at its next frame. The node's
event gives received -> restored and its stages; the bounds are those of an interrupt
during decoding plus one control step or frame (its median on /diagnostics). A policy's
step is abandoned at its next module call, so its wait is the longest single operation
(a convolution); a speech chunk stops at its next frame. Prompt: the default model; every
round publishes a prompt of PROMPT_CHARS characters (one token each) on ~/prompt and, a
random time into its prefill, an Interrupt(RESTORE home); the prefill stops within a piece
of its longest operations (models/pieces.py). No bound is set for it: "step" is the time to
the first token (client side), shown beside it.
"""

import os
import random
import time

import numpy as np

from .common import stamp_s
from .through_ros import _dist, _Inbox, _isolate, CALL_TIMEOUT_S, HOME, RT
from ..node_process import NodeProcess

AUDIO_S = 300.0  # the long chunk: five minutes
AUDIO_AT_S = 1.5  # the interrupt follows the chunk's publication by this long
PROMPT_CHARS = 3000  # the long prompt: 3,000 tokens of the default model's byte vocabulary
PROMPT_TEXT = 'Move the red cup onto the blue tray, then wait by the door. '
STEP_KEYS = {'policy': 'control_step_ms', 'speech': 'frame_step_ms'}  # on /diagnostics
DIAGNOSTICS_WAIT_S = 5.0  # for one /diagnostics message with the step time (a few periods)
MODES = {
    'policy': {'model': 'builtin:act-arm', 'mode': 'policy', 'joint_names': ['shoulder', 'elbow']},
    'speech': {'model': 'builtin:tiny-stt', 'mode': 'speech'},
    'prompt': {'model': 'default', 'mode': 'lm', 'max_new_tokens': 4},
}
INPUTS = {'policy': 'observation', 'speech': 'audio', 'prompt': ''}
FIRST_CHUNK_S = 0.5  # the policy node's first chunk, before its first observation is sent again


def _params(mode, device, capsule_dir):
    return dict(MODES[mode], **RT, device=device, home_capsule=HOME, capsule_dir=capsule_dir,
                interrupt_policy='restore_home', diagnostics_period=0.5)


class _Node:
    """One node under test: its client, ~/events, ~/actions, and its step time."""

    def __init__(self, mode, client):
        from diagnostic_msgs.msg import DiagnosticArray
        from flashrt_ros.qos import DIAGNOSTICS_QOS

        self.mode, self.client = mode, client
        self.events, self.actions, self.tokens = _Inbox(), _Inbox(), _Inbox()
        self.step_ms = []  # what /diagnostics says, once a period (prompt: time to a token)
        self.subs = (client.subscribe_events(self.events.put),) + {
            'policy': (client.subscribe_actions(self.actions.put),),
            'prompt': (client.subscribe_tokens(self.tokens.put),)}.get(mode, ())
        client.node.create_subscription(DiagnosticArray, '/diagnostics', self._diagnostics,
                                        DIAGNOSTICS_QOS)
        self.samples = {}
        self.rounds = self.missed = self.abandoned = 0

    def _diagnostics(self, msg):
        if self.mode not in STEP_KEYS:
            return
        for status in msg.status:
            if self.client.base.strip('/') in status.name:
                value = float({v.key: v.value for v in status.values}.get(
                    STEP_KEYS[self.mode], 0.0))
                if value > 0.0:  # 0 until the first step
                    self.step_ms.append(value)

    def interrupt_after(self, delay_s):
        """Publish RESTORE home delay_s from now; return the event (None: none came)."""
        from flashrt_ros.msg import Interrupt

        mark = len(self.events.items)
        time.sleep(delay_s)
        published = time.time()
        self.client.interrupt(Interrupt.RESTORE, capsule=HOME, reason='bench')
        found = self.events.wait(lambda m: m.operation == 'interrupt', mark, CALL_TIMEOUT_S)
        if found is None:
            self.missed += 1
            return None
        msg = found[1]
        restored = stamp_s(msg.header)
        out = self.samples
        out.setdefault('received_to_restored', []).append(msg.latency_ms)
        out.setdefault('published_to_restored', []).append((restored - published) * 1e3)
        for name, ms in zip(msg.stage_names, msg.stage_ms):
            out.setdefault(name, []).append(ms)
        return msg

    def result(self):
        """Return the stages' distributions, the step time, the bound and whether it holds."""
        out = {key: _dist(v) for key, v in self.samples.items()}
        step = _dist(self.step_ms)
        # The decoding bounds (received -> restored median 0.5, p99 1.0, max 3 ms) plus one
        # control step or frame.
        extra = step['median'] or 0.0
        got = out.get('received_to_restored', _dist([]))
        bounds = ({'median': 0.5 + extra, 'p99': 1.0 + extra, 'max': 3.0 + extra}
                  if self.mode in STEP_KEYS else {})
        out.update({'mode': self.mode, 'rounds': self.rounds, 'step_ms': step,
                    'missed': self.missed,
                    'cut_or_abandoned': self.abandoned, 'bounds_ms': bounds,
                    'holds': {q: got[q] is not None and got[q] <= limit
                              for q, limit in bounds.items()},
                    'received_to_restored_samples_ms':
                        self.samples.get('received_to_restored', [])})
        return out


def _policy_rounds(node, rounds, log):
    """Observation, then RESTORE home a random time into its control step; count the cut ones."""
    from flashrt_ros import reach_task as task

    client = node.client
    q, dq = (-1.2, 0.4), (0.0, 0.0)

    def observe():
        stamp = client.now()
        client.publish_image('top', task.picture(q).tobytes(), *task.CAMERA, stamp=stamp)
        client.publish_joint_state(task.JOINTS, q, dq, stamp=stamp)

    # Images go best effort: one sent before the node's reader has matched the new publisher
    # is lost. A robot streams them; here the first observation is sent until a chunk comes.
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while True:
        mark = len(node.actions.items)
        observe()
        if node.actions.wait(lambda m: True, mark, FIRST_CHUNK_S) is not None:
            break
        if time.monotonic() > deadline:
            raise RuntimeError('the policy node sent no ActionChunk for an observation')
    time.sleep(FIRST_CHUNK_S)  # a chunk of an observation sent twice is not a round trip's
    trips = []
    for _ in range(5):  # the round trip of a step, where the interrupt is to land
        mark, t0 = len(node.actions.items), time.perf_counter()
        observe()
        if node.actions.wait(lambda m: True, mark, CALL_TIMEOUT_S) is None:
            raise RuntimeError('the policy node sent no ActionChunk for an observation')
        trips.append(time.perf_counter() - t0)
    trip = float(np.median(trips))
    node.samples.clear()
    node.rounds = rounds
    for i in range(rounds):
        mark = len(node.actions.items)
        observe()
        msg = node.interrupt_after(random.uniform(0.2, 0.8) * trip)
        time.sleep(trip)  # a chunk of the observation would be out by now
        node.abandoned += msg is not None and len(node.actions.items) == mark
        if i % 50 == 49:
            log(f'fig5modes policy {i + 1}/{rounds}')
    return trip


def _speech_rounds(node, rounds, seconds, at, log):
    """Publish `seconds` of audio, then RESTORE home `at` s later (it cuts the chunk)."""
    client = node.client
    rate = 24000
    t = np.arange(int(seconds * rate)) / rate
    audio = (3000 * np.sin(2 * np.pi * 220 * t)).astype(np.int16)
    cut = []
    node.rounds = rounds
    for i in range(rounds):
        mark = len(node.events.items)
        client.publish_audio(audio, rate)
        node.interrupt_after(at)
        said = node.events.wait(lambda m: m.operation == 'audio', mark, 0.5)
        cut.append(said is not None and 'cut by an interrupt' in said[1].message)
        if i % 10 == 9:
            log(f'fig5modes speech {i + 1}/{rounds}')
    node.abandoned = sum(cut)


def _prompt_rounds(node, rounds, log):
    """Publish a long prompt, then RESTORE home a random time into its prefill."""
    client = node.client
    text = (PROMPT_TEXT * (PROMPT_CHARS // len(PROMPT_TEXT) + 1))[:PROMPT_CHARS]
    trips = []
    for _ in range(3):  # the time to the first token, where the prefill ends
        mark, t0 = len(node.tokens.items), time.perf_counter()
        client.publish_prompt(text)
        if node.tokens.wait(lambda m: True, mark, CALL_TIMEOUT_S) is None:
            raise RuntimeError('the prompt node sent no token for a prompt')
        trips.append(time.perf_counter() - t0)
        node.interrupt_after(0.0)  # ends the turn: home again
    trip = float(np.median(trips))
    node.samples.clear()
    node.step_ms = [t * 1e3 for t in trips]
    node.rounds = rounds
    for i in range(rounds):
        mark = len(node.tokens.items)
        client.publish_prompt(text)
        msg = node.interrupt_after(random.uniform(0.2, 0.8) * trip)
        final = node.tokens.wait(lambda m: m.final, mark, CALL_TIMEOUT_S)
        chunks = [m for _, m in node.tokens.items[mark:]]
        # Cut in its prefill: the turn ended without a token.
        node.abandoned += (msg is not None and final is not None
                           and not any(m.token_ids for m in chunks))
        if i % 50 == 49:
            log(f'fig5modes prompt {i + 1}/{rounds}')
    return trip


def fig5_mode_interrupts(plan, device, log):
    """Interrupt -> restored during a control step, a long audio chunk and a long prompt."""
    from .through_ros import ros_missing

    missing = ros_missing()
    if missing:
        return {'title': 'Interrupts in policy and speech mode and during a prompt',
                'skipped': [missing]}
    from flashrt_ros.client import FlashRTClient, poll

    domain = _isolate(log)
    workdir = os.path.join(plan.workdir, 'ros-modes')
    rounds = max(2, plan.interrupts // 10)
    seconds, at = (AUDIO_S, AUDIO_AT_S) if plan.interrupts >= 100 else (20.0, 0.3)
    result = {'title': 'Interrupts in policy and speech mode and during a prompt (robot '
                       'settings)',
              'ros_domain_id': domain, 'audio_s': seconds,
              'interrupt_after_audio_s': at, 'rows': []}
    for mode in MODES:
        name = f'flashrt_{mode}'
        proc = NodeProcess(workdir, _params(mode, device, os.path.join(workdir, name)),
                           name=name)
        client = None
        try:
            client = FlashRTClient(name, timeout=30.0)
            log(f'fig5modes waiting for the {mode} node ({MODES[mode]["model"]})')
            if not client.wait_until_active(timeout=180.0):
                raise RuntimeError(f'the {mode} node did not become active; log:\n'
                                   f'{proc.log()[-2000:]}')
            if not client.wait_for_subscribers(10.0, INPUTS[mode]):
                raise RuntimeError(f'the {mode} node did not subscribe to its command and '
                                   f'{INPUTS[mode] or "other"} topics within 10 s')
            node = _Node(mode, client)
            if not client.wait_for_publishers(*node.subs):
                raise RuntimeError(f'~/events, ~/actions or ~/tokens of the {mode} node did '
                                   'not match')
            if mode == 'policy':
                result['policy_round_trip_ms'] = _policy_rounds(node, rounds, log) * 1e3
            elif mode == 'prompt':
                result['prompt_first_token_ms'] = _prompt_rounds(node, rounds, log) * 1e3
            else:
                _speech_rounds(node, max(2, rounds // 4), seconds, at, log)  # 2 s each
            poll(lambda: node.step_ms, DIAGNOSTICS_WAIT_S)  # a short run may end before one
            result['rows'].append(node.result())
        finally:
            if client is not None:
                client.close()
            result.setdefault('exit_codes', {})[mode] = proc.stop()
    return result
