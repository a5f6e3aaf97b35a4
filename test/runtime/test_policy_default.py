"""The policy default (builtin:act-arm): trained weights over seeded ones, and it reaches."""

import json

from flashrt_ros import reach_task as task, train_policy
from flashrt_ros.runtime.models.builtin import TRAINED_DIR
from flashrt_ros.runtime.models.lerobot import read_weights
from flashrt_ros.runtime.models.policy import builtin_checkpoint
import numpy as np
import pytest
from safetensors.torch import load_file
import torch

FOLDER = TRAINED_DIR / 'act-arm'


def test_the_folder_holds_only_what_training_changed():
    trained = load_file(str(FOLDER / train_policy.TRAINED_FILE))
    assert (FOLDER / train_policy.TRAINED_FILE).stat().st_size <= 8 * 2**20
    assert not any(k.startswith(train_policy.FROZEN) and 'conv' in k for k in trained)
    report = json.loads((FOLDER / train_policy.REPORT_FILE).read_text())
    assert report['trained_parameters'] < report['parameters'] / 5
    assert (FOLDER / 'README.md').read_text() == train_policy.card(report)


def test_the_builtin_is_the_seed_with_the_trained_part_laid_over():
    weights = read_weights(builtin_checkpoint('act-arm'))
    trained = load_file(str(FOLDER / train_policy.TRAINED_FILE))
    policy = train_policy.seeded_policy(json.loads(
        (FOLDER / train_policy.REPORT_FILE).read_text())['stats'])
    seeded = {f'model.{k}': v for k, v in policy.model.state_dict().items()}
    assert set(weights) == set(seeded) and set(trained) < set(weights)
    for name, tensor in weights.items():
        assert torch.equal(tensor, trained.get(name, seeded[name])), name


def _reach(rt, target, q0, steps):
    """Drive the arm with the runtime's policy; return the tip's error after each step."""
    arm, errors = task.Arm(q0), []
    for _ in range(steps):
        image = torch.from_numpy(task.picture(arm.q, target)).permute(2, 0, 1).float() / 255
        action = rt.act({'observation.state': torch.tensor(arm.q, dtype=torch.float32),
                         'observation.images.top': image}).actions[0]
        arm.step(action.tolist())
        errors.append(arm.error(target))
    return errors


@pytest.mark.parametrize('episode', range(3))
def test_it_reaches_targets_it_was_not_trained_on(make_runtime, episode):
    rng = np.random.default_rng(1000 + episode)  # train_policy draws from SEED and SEED + 1
    target, q0 = task.sample_target(rng), task.sample_pose(rng)
    rt = make_runtime('builtin:act-arm')
    start = task.Arm(q0).error(target)
    errors = _reach(rt, target, q0, 50)
    assert errors[-1] < max(0.3, start / 4), (start, errors[::5])


def test_a_restore_replays_the_reach_exactly(make_runtime):
    rt = make_runtime('builtin:act-arm')
    target, q0 = (-0.55, 1.45), (-1.2, 0.4)
    _reach(rt, target, q0, 3)
    rt.snapshot('mid', tier='host')
    first = _reach(rt, target, q0, 5)
    rt.restore('mid')
    assert _reach(rt, target, q0, 5) == first


def test_training_is_deterministic(tmp_path):
    def run(folder):
        train_policy.train(folder, steps=2, batch=4, calibration_images=8, eval_episodes=1,
                           eval_steps=2)
        return (folder / train_policy.TRAINED_FILE).read_bytes()

    assert run(tmp_path / 'one') == run(tmp_path / 'two')
