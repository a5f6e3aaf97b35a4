"""Observation inputs matched by stamp: one joint state and one image per camera."""

from flashrt_ros.session.sync import ObservationSync

KEYS = ('observation.state', 'observation.images.top', 'observation.images.wrist')


def test_inputs_within_the_slop_make_one_observation_stamped_with_the_newest():
    sync = ObservationSync(KEYS, slop=0.02)
    assert sync.put(KEYS[0], 's1', 10.000) == (None, KEYS[1])
    assert sync.put(KEYS[1], 't1', 10.010) == (None, KEYS[2])
    observation, stamp = sync.put(KEYS[2], 'w1', 10.015)
    assert observation == dict(zip(KEYS, ('s1', 't1', 'w1'))) and stamp == 10.015


def test_each_message_is_folded_in_once_and_the_nearest_one_is_chosen():
    sync = ObservationSync(KEYS[:2], slop=0.02)
    for i, t in enumerate((10.00, 10.01, 10.02, 10.03)):  # joint states at 100 Hz
        assert sync.put(KEYS[0], f's{i}', t) == (None, KEYS[1])
    observation, stamp = sync.put(KEYS[1], 'top', 10.024)
    assert observation == {KEYS[0]: 's2', KEYS[1]: 'top'} and stamp == 10.024
    matched = ({KEYS[0]: 's3', KEYS[1]: 'top again'}, 10.03)
    assert sync.put(KEYS[1], 'top again', 10.025) == matched
    assert sync.put(KEYS[1], 'late', 10.026) == (None, KEYS[0])  # s0..s3 are used up


def test_messages_that_waited_too_long_expire_naming_the_missing_input():
    sync = ObservationSync(KEYS[:2], slop=5)
    for t in (100, 110, 120):
        assert sync.put(KEYS[0], 's', t) == (None, KEYS[1])
    assert sync.expire(before=105) == KEYS[1] and sync.newest(KEYS[0]) == 120
    assert sync.expire(before=105) == ''
    assert sync.put(KEYS[1], 't', 119) == ({KEYS[0]: 's', KEYS[1]: 't'}, 120)


def test_stamps_farther_apart_than_the_slop_wait_and_clear_forgets():
    sync = ObservationSync(KEYS[:2], slop=0.005)
    assert sync.put(KEYS[0], 's', 1.00) == (None, KEYS[1])
    assert sync.put(KEYS[1], 't', 1.01) == (None, KEYS[0])
    assert sync.newest(KEYS[1]) == 1.01
    sync.clear()
    assert sync.newest(KEYS[0]) is None and sync.put(KEYS[1], 't', 1.0) == (None, KEYS[0])


def test_a_single_input_is_an_observation_at_once():
    assert ObservationSync(KEYS[:1], 0.0).put(KEYS[0], 'v', 3.0) == ({KEYS[0]: 'v'}, 3.0)
