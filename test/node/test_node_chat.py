"""
A local instruct-style checkpoint served by the node: conversation turns over ROS.

The checkpoint (a tokenizers-made tokenizer with a Qwen-style chat template, a tiny random
hybrid saved in bf16) is built by the runtime tests' harness; the node loads it by path
with every setting at its default (dtype auto, prompt_format auto).
"""

import importlib.util
from pathlib import Path
import threading
import time

from node_harness import HOME, node_in_process
import pytest

NAME = 'flashrt_chat'
_SPEC = importlib.util.spec_from_file_location(
    'checkpoint_harness', Path(__file__).parent.parent / 'runtime' / 'checkpoint_harness.py')
checkpoint_harness = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(checkpoint_harness)


class DiagnosticsLog:
    """Collect NAME's /diagnostics statuses from a node of its own (own context and thread)."""

    def __init__(self):
        import rclpy
        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.executors import SingleThreadedExecutor
        self.statuses = []
        self._context = rclpy.Context()
        rclpy.init(context=self._context)
        self.node = rclpy.create_node('chat_diagnostics_log', context=self._context)
        self.node.create_subscription(DiagnosticArray, '/diagnostics', self._take, 10)
        self._executor = SingleThreadedExecutor(context=self._context)
        self._executor.add_node(self.node)
        self._thread = threading.Thread(target=self._executor.spin, daemon=True)
        self._thread.start()

    def _take(self, message):
        # Another test's node may still be publishing on /diagnostics.
        self.statuses.extend(s for s in message.status if s.name.startswith(f'/{NAME}:'))

    def close(self):
        import rclpy
        self._executor.shutdown(timeout_sec=2.0)
        self.node.destroy_node()
        rclpy.try_shutdown(context=self._context)


@pytest.fixture(scope='module')
def chat_node(tmp_path_factory):
    """Yield (client, node, tokenizer, diagnostics seen) of an in-process node."""
    path, tok = checkpoint_harness.build_checkpoint(tmp_path_factory.mktemp('ckpt') / 'qwen')
    params = {'model': str(path), 'max_seq_len': 512, 'max_new_tokens': 6,
              'capsule_dir': str(tmp_path_factory.mktemp('chat_capsules')),
              'system_prompt': 'You are a careful robot arm.', 'diagnostics_period': 0.5}
    log = DiagnosticsLog()

    def prepare(node):
        # Configure publishes its stages at once: wait until a status sent on the node's
        # publisher reaches the log. Discovery runs both ways, not at once, and a match
        # count can count another test's endpoint not yet gone.
        from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
        probe = DiagnosticArray(status=[DiagnosticStatus(name=f'/{NAME}: probe')])
        deadline = time.monotonic() + 10.0
        while not log.statuses and time.monotonic() < deadline:
            node._diag_pub.publish(probe)
            time.sleep(0.05)

    try:
        with node_in_process(NAME, params, prepare) as (client, node):
            yield client, node, tok, log.statuses
    finally:
        log.close()


def _capsule(client, name):
    listing = client.list_capsules()
    assert listing.success, listing.message
    return next(c for c in listing.capsules if c.name == name)


def test_configure_and_activate_report_their_stages(chat_node):
    client, node, tok, statuses = chat_node
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and not any(s.message == 'active' for s in statuses):
        time.sleep(0.05)
    messages = [s.message for s in statuses]
    for stage in ('configuring: loading', 'configuring: binding', 'inactive: warm-up',
                  'inactive: home prefill'):
        assert any(m.startswith(stage) for m in messages), (stage, messages)
    active = next(s for s in statuses if s.message == 'active')
    values = {kv.key: kv.value for kv in active.values}
    assert values['dtype'] == 'bfloat16'  # dtype auto: the checkpoint's own
    assert node.session.runtime.chat is not None


def test_goals_are_conversation_turns_and_capsules_count_them(chat_node):
    client, node, tok, _ = chat_node
    assert client.restore(HOME).success
    home = _capsule(client, HOME)
    assert (list(home.roles), home.turns) == (['system'], 0)
    first = client.generate('Pick up the red cup.', save_as='one')
    assert first.result.success, first.result.message
    one = _capsule(client, 'one')
    assert (list(one.roles), one.turns) == (['system', 'user', 'assistant'], 1)
    second = client.generate('Now put it on the shelf.', save_as='two')
    assert _capsule(client, 'two').turns == 2
    # Restore and continue: the same reply, token for token, over ROS.
    assert client.restore('one').success
    again = client.generate('Now put it on the shelf.')
    assert list(again.result.token_ids) == list(second.result.token_ids)
    ids = node.session.runtime.arena.views['tokens'][:again.result.position].tolist()
    assert ids[-2:] == tok.encode('<|im_end|>\n', add_special_tokens=False)  # whole turns


def test_a_raw_goal_bypasses_the_template(chat_node):
    client, node, tok, _ = chat_node
    assert client.restore(HOME).success
    outcome = client.generate('<|im_start|>user\nHi<|im_end|>\n', raw=True, save_as='raw')
    assert outcome.result.success, outcome.result.message
    assert list(_capsule(client, 'raw').roles) == ['system', 'raw']


def test_ids_outside_the_tokenizer_are_refused(chat_node):
    client, node, tok, _ = chat_node
    digest = client.state_digest()
    outcome = client.generate(token_ids=[5, len(tok)], max_new_tokens=2)
    assert not outcome.result.success
    assert 'outside the vocabulary' in outcome.result.message
    assert client.state_digest() == digest
