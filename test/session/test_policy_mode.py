"""Policy mode: the observation gate, observation and timer stepping, interrupts."""

import threading
import time

from flashrt_ros.runtime import FlashRTError
from flashrt_ros.runtime.preemption import ARMED
from flashrt_ros.session import InterruptMode, Session
import pytest

POLICY = 'builtin:tiny-policy'


def _obs(session, value=0.1):
    return [value] * session.runtime.policy_spec.obs_dim


def test_observation_stepping_publishes_each_chunk(make_session):
    session, out = make_session(POLICY, 'policy')
    session.mode.observe(_obs(session), time.time())
    step, rows, names = out.actions_out[-1]
    assert step == session.runtime.position == 1
    assert len(rows) == session.runtime.policy_spec.horizon
    assert names == list(session.runtime.policy_spec.joint_names)


def test_bad_observations_leave_the_state_and_say_why(make_session):
    session, out = make_session(POLICY, 'policy')
    digest = session.runtime.state_digest()
    session.mode.observe([0.0], time.time())
    session.mode.observe([float('nan')] * session.runtime.policy_spec.obs_dim, time.time())
    assert session.runtime.state_digest() == digest and not out.actions_out
    rejected = [e for e in out.events if e['operation'] == 'observation']
    assert len(rejected) == 2 and not any(e['success'] for e in rejected)
    assert all('state unchanged at step 0' in e['message'] for e in rejected)


def test_observations_sent_before_an_interrupt_are_dropped(make_session):
    session, out = make_session(POLICY, 'policy')
    sent = time.time()
    session.interrupts.apply('interrupt', InterruptMode.STOP, 1, '', '', time.time())
    assert out.events[-1]['message'].endswith('; action queue dropped')
    session.mode.observe(_obs(session), sent)
    assert not out.actions_out and session.runtime.position == 0
    session.mode.observe(_obs(session), time.time())
    assert len(out.actions_out) == 1


def test_restore_and_rollback_forget_older_observations(make_session):
    session, out = make_session(POLICY, 'policy')
    session.mode.observe(_obs(session), time.time())
    sent = time.time()
    session.rollback(1)
    session.mode.observe(_obs(session), sent)
    assert len(out.actions_out) == 1 and session.runtime.position == 0


def test_an_observation_taken_in_during_a_forget_is_not_folded_in(make_session, settings):
    """A deactivate's forget_inputs in the middle of taking an observation in comes after it."""
    settings['stepping'] = 'timer'
    session, _ = make_session(POLICY, 'policy')
    checking, go_on = threading.Event(), threading.Event()
    check = session.runtime.check_observation

    def slow_check(values):  # the observation passed the staleness check, not yet stored
        checking.set()
        go_on.wait(5.0)
        return check(values)

    session.runtime.check_observation = slow_check
    taking = threading.Thread(target=session.mode.observe, args=(_obs(session), time.time()))
    taking.start()
    assert checking.wait(5.0)
    forgetting = threading.Thread(target=session.mode.forget_inputs)
    forgetting.start()
    time.sleep(0.1)  # without the gate, the forget is over before the observation is stored
    go_on.set()
    taking.join(5.0)
    forgetting.join(5.0)
    session.mode.tick()
    assert session.runtime.position == 0, 'an observation from before the forget was folded in'


def test_timer_stepping_steps_on_the_newest_and_sends_one_action_a_tick(make_session, settings):
    settings['stepping'] = 'timer'
    session, out = make_session(POLICY, 'policy')
    assert session.mode.tick_period() == pytest.approx(1 / 50.0)
    session.mode.observe(_obs(session, 0.1), time.time())
    session.mode.observe(_obs(session, 0.2), time.time())
    assert session.runtime.position == 0, 'timer stepping acts only on a tick'
    session.mode.tick()
    assert session.runtime.position == 1 and len(out.actions_out) == 1
    assert len(out.actions_out[0][1]) == 1, 'a tick publishes one action'
    queued = session.runtime.pending_actions()
    session.mode.tick()  # no new observation: the next queued action
    assert session.runtime.position == 1
    assert out.actions_out[1][1] == [queued[0].tolist()]


def test_a_policy_session_runs_no_turns_and_a_wrong_mode_is_refused(make_session, tmp_path):
    session, _ = make_session(POLICY, 'policy')
    assert 'publish observations on ~/observation' in session.reserve_turn('goal')
    with pytest.raises(FlashRTError, match='is a robot policy; set mode to policy'):
        Session(session.runtime, 'lm', {}.get, session._out)
    assert session.mode.diagnostics(session.runtime.stats()).keys() == {'control_step_ms'}


@pytest.mark.parametrize('stepping', ['observation', 'timer'])
def test_an_interrupt_abandons_a_running_control_step(make_session, settings, stepping,
                                                      hold_in_forward):
    """A RESTORE abandons the step in flight; none of its actions go out; the queue is dropped."""
    settings['stepping'] = stepping
    session, out = make_session(POLICY, 'policy')
    rt, mode = session.runtime, session.mode
    mode.observe(_obs(session, 0.1), time.time())
    mode.tick()
    rt.snapshot('mark')
    digest, published = rt.state_digest(), len(out.actions_out)
    inside = hold_in_forward(rt.adapter.module.backbone.layers[0])
    if stepping == 'timer':
        mode.observe(_obs(session, 0.2), time.time())  # taken in; the tick steps on it
    step = threading.Thread(target=mode.tick if stepping == 'timer' else
                            lambda: mode.observe(_obs(session, 0.2), time.time()))
    step.start()
    assert inside.wait(10.0)
    assert ARMED.value == 0  # the step waits for a preemption, which only the interrupt arms
    session.interrupts.apply('interrupt', InterruptMode.RESTORE, 1, 'mark', '', time.time())
    step.join(10.0)
    assert not step.is_alive()
    event = out.events[-1]
    assert event['operation'] == 'interrupt' and event['success'], event
    assert event['message'].endswith('; action queue dropped')
    assert len(out.actions_out) == published, 'a chunk or action went out after the interrupt'
    assert rt.position == 1 and len(rt.pending_actions()) == 0
    rt.restore('mark')
    assert rt.state_digest() == digest  # (the restore put it in place; the drop came after)
    mode.tick()
    assert len(out.actions_out) == published + 1  # stepping goes on
