"""A VLA-shaped policy's instruction through the session: kept for home, applied, refused."""

import sys
import time

from flashrt_ros.runtime import Runtime, RuntimeConfig
from flashrt_ros.runtime.models import ModulePolicyAdapter
from flashrt_ros.session import Session
import pytest
from session_harness import HOME, Recorder, SETTINGS
import torch

sys.path.insert(0, str(__import__('pathlib').Path(__file__).parents[1] / 'runtime'))
from test_policy_prefix import _obs, _spec, PrefixPolicy  # noqa: E402,I100 (a test module)


@pytest.fixture
def session(tmp_path):
    config = RuntimeConfig(model='user:prefix', device='cpu', max_seq_len=64, rollback_depth=4,
                           capsule_dir=str(tmp_path / 'capsules'))
    made = Session(Runtime(config, adapter=ModulePolicyAdapter(PrefixPolicy(), _spec(), 64)),
                   'policy', SETTINGS.get, Recorder())
    made.turns.start()
    yield made
    made.close()


def test_an_instruction_before_activation_is_in_the_home_capsule(session):
    out = session._out
    session.mode.instruct('pick the cup', active=False)
    assert out.events[-1]['success'] and 'home capsule' in out.events[-1]['message']
    session.warm_up(HOME, '')
    session.turns.set_active(True)
    session.mode.observe(_obs(), time.time())
    chunk = out.actions_out[-1][1]
    session.mode.instruct('open the door')
    assert out.events[-1]['success'] and 'queue dropped' in out.events[-1]['message']
    assert len(session.runtime.pending_actions()) == 0
    session.mode.observe(_obs(), time.time())
    assert out.actions_out[-1][1] != chunk, 'the new instruction must change the chunk'
    session.restore(HOME)  # holds 'pick the cup' and the RNG as it was at activation
    session.mode.observe(_obs(), time.time())
    assert out.actions_out[-1][1] == chunk


def test_a_refused_instruction_keeps_the_one_in_force(session):
    out = session._out
    session.warm_up(HOME, '')
    session.turns.set_active(True)
    session.mode.instruct('pick the cup')
    digest = session.runtime.state_digest()
    session.mode.instruct('pick the red cup and put it on the tray')
    event = out.events[-1]
    assert not event['success'] and 'holds 16' in event['message']
    assert 'the instruction in force is unchanged' in event['message']
    assert session.runtime.state_digest() == digest
    assert torch.equal(session.runtime.adapter.module.ids[:3], torch.tensor(list(b'pic')))
