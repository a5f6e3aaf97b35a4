"""The default model's training data: seeded, held-out pairs kept out, plans checked."""

import random

from flashrt_ros import robot_corpus


def _conversations(seed, n=400, training=True):
    rng = random.Random(seed)
    return [robot_corpus.conversation(rng, training) for _ in range(n)]


def test_the_corpus_is_reproducible_from_its_seed():
    assert _conversations(3, 50) == _conversations(3, 50)
    assert _conversations(3, 50) != _conversations(4, 50)


def test_conversations_are_a_system_prompt_and_exchanges():
    for messages in _conversations(5):
        roles = [role for role, _ in messages]
        assert roles[0] == 'system' and len(roles) % 2 == 1
        assert roles[1:] == ['user', 'assistant'] * (len(roles) // 2)


def test_no_training_plan_moves_a_held_out_pair():
    plans = 0
    for messages in _conversations(6, 1000):
        for role, text in messages:
            if role == 'assistant' and '\n1. Reach the ' in text:
                first = text.split('\n')[0]  # 'OK: the red cup to the left tray.'
                obj, place = first.split(': the ', 1)[1].rstrip('.').split(' to the ')
                assert not robot_corpus.is_heldout(obj, place), text
                plans += 1
    assert plans > 500


def test_held_out_tasks_are_held_out_pairs_in_their_scene():
    tasks = robot_corpus.heldout_tasks(30, seed=1)
    for messages, obj, place in tasks:
        assert robot_corpus.is_heldout(obj, place)
        assert f'{obj} (' in messages[0][1] and obj in messages[-1][1]


def test_plan_is_right_wants_the_object_then_the_place():
    plan = robot_corpus.plan('red cup', 'left tray')
    assert robot_corpus.plan_is_right(plan, 'red cup', 'left tray')
    assert not robot_corpus.plan_is_right(plan, 'red cup', 'right tray')
    assert not robot_corpus.plan_is_right(plan, 'blue cup', 'left tray')
    assert not robot_corpus.plan_is_right('Move to the left tray with the red cup.',
                                          'red cup', 'left tray')
