"""
Train the policy default (builtin:act-arm): `python -m flashrt_ros.train_policy [--out DIR]`.

Behaviour cloning of reach_task's scripted expert by the ACT that `builtin:act-arm` names
(one 3x96x128 top camera, the two joint angles, 20-step chunks of joint targets): each
sample is a random target and a random pose (some near the goal, so that the policy learns
to stay), the camera's picture of both, and the expert's chunk. The image trunk's last two
stages (layer3, layer4) keep their seeded weights and are not trained, so what training
changes fits in a small file: the rest of the network, and the statistics of every frozen
batch norm, measured once on the task's pictures. Nothing is downloaded; everything is
seeded. At the end the policy drives the arm in closed loop (temporal ensembling, as the
node runs it) toward targets and start poses no training sample used, and the final error
is recorded. The result, `trained.safetensors` and `training.json` in DIR, is what
`builtin:act-arm` lays over its seeded weights when it writes its LeRobot folder.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
import sys
import time

import numpy as np
import torch

from . import reach_task as task
from .train_default import learning_rate  # warm-up, then cosine decay to min_lr

SEED = 23
DEFAULT_OUT = Path(__file__).parent / 'models' / 'act-arm'
TRAINED_FILE = 'trained.safetensors'
REPORT_FILE = 'training.json'
FROZEN = ('model.backbone.layer3.', 'model.backbone.layer4.')  # weights seeded, not trained
HPARAMS = {
    'steps': 700, 'batch': 32, 'lr': 1e-3, 'min_lr': 1e-5, 'warmup': 30,
    'weight_decay': 1e-4, 'grad_clip': 1.0, 'near_goal': 0.3, 'near_goal_std': 0.15,
    'calibration_images': 256, 'eval_episodes': 100, 'eval_steps': 60, 'threads': 1,
}
REACHED = 0.1  # link lengths: an episode counts as reached below this final error


# ---- data -----------------------------------------------------------------------------------

class Samples:
    """Endless seeded batches: normalized-later (state, image, chunk) of random scenes."""

    def __init__(self, seed: int, hp: dict):
        self.rng, self.hp = np.random.default_rng(seed), hp

    def scene(self):
        target = task.sample_target(self.rng)
        goal = task.inverse_kinematics(target)
        if self.rng.random() < self.hp['near_goal']:
            q = goal + self.rng.normal(0.0, self.hp['near_goal_std'], 2)
        else:
            q = task.sample_pose(self.rng)
        return q, target, task.expert_chunk(q, goal)

    def batch(self, n: int):
        """Return float32 tensors: states [n, 2], images [n, 3, H, W] in [0, 1], chunks."""
        qs, images, chunks = zip(*((q, task.picture(q, t), a)
                                   for q, t, a in (self.scene() for _ in range(n))))
        images = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 255.0
        return (torch.tensor(np.array(qs), dtype=torch.float32), images,
                torch.tensor(np.array(chunks), dtype=torch.float32))


# ---- model ----------------------------------------------------------------------------------

def seeded_policy(stats: dict):
    """Build the ACT of builtin:act-arm with its seeded weights and normalizers of `stats`."""
    from .runtime.models.act import ACTPolicy
    from .runtime.models.builtin import LEROBOT_BUILTINS, SEED as BUILTIN_SEED
    from .runtime.models.lerobot import ACTConfig, seeded_weights

    recipe = LEROBOT_BUILTINS['act-arm']
    config = ACTConfig.from_json({'type': 'act', **recipe['config']}, 'builtin:act-arm')
    policy = ACTPolicy(config, stats)
    policy.load_state_dict(seeded_weights(policy, BUILTIN_SEED))
    return policy


def calibrate(backbone, images: torch.Tensor) -> None:
    """Set each frozen batch norm's statistics to those of its input on `images`."""
    from .runtime.models.act import FrozenBatchNorm2d

    def measure(module, args):
        x = args[0]
        module.running_mean.copy_(x.mean((0, 2, 3)))
        module.running_var.copy_(x.var((0, 2, 3)))
        module.weight.fill_(1.0)
        module.bias.zero_()
        module._refresh()

    hooks = [m.register_forward_pre_hook(measure) for m in backbone.modules()
             if isinstance(m, FrozenBatchNorm2d)]
    with torch.no_grad():
        backbone(images)
    for hook in hooks:
        hook.remove()


def task_stats(samples: Samples, n: int = 4096) -> dict:
    """Mean and std of the joint angles and of the expert's targets, as LeRobot stores them."""
    qs = np.array([samples.scene()[0] for _ in range(n)])
    chunks = np.concatenate([samples.scene()[2] for _ in range(n // 8)])
    imagenet = {'mean': [0.485, 0.456, 0.406], 'std': [0.229, 0.224, 0.225]}
    return {'observation.state': {'mean': qs.mean(0).tolist(), 'std': qs.std(0).tolist()},
            'observation.images.top': imagenet,
            'action': {'mean': chunks.mean(0).tolist(), 'std': chunks.std(0).tolist()}}


def is_trained(name: str) -> bool:
    """Whether a LeRobot weight name is trained here (and shipped in trained.safetensors)."""
    if not name.startswith(FROZEN):
        return True
    return '.bn' in name or 'downsample.1.' in name  # the frozen stages' norms are measured


# ---- closed loop ------------------------------------------------------------------------------

def rollout(policy, target, q0, steps: int) -> list[float]:
    """Drive the arm from q0 toward target with the policy, as the node does; return errors."""
    from .runtime.models.act import ENSEMBLE, ENSEMBLE_COUNT

    c = policy.config
    policy.bind({ENSEMBLE: torch.zeros(c.chunk_size, c.action_dim),
                 ENSEMBLE_COUNT: torch.zeros(c.chunk_size, dtype=torch.int64)})
    arm, errors = task.Arm(q0), []
    for _ in range(steps):
        image = torch.from_numpy(task.picture(arm.q, target)).permute(2, 0, 1).float() / 255.0
        action = policy({'observation.state': torch.tensor(arm.q, dtype=torch.float32),
                         'observation.images.top': image})
        arm.step(action[0].tolist())
        errors.append(arm.error(target))
    return errors


def closed_loop(policy, hp: dict, seed: int) -> dict:
    """Measure final tip errors over held-out episodes (and the scripted expert's)."""
    rng = np.random.default_rng(seed)
    finals, starts, expert = [], [], []
    for _ in range(hp['eval_episodes']):
        target, q0 = task.sample_target(rng), task.sample_pose(rng)
        errors = rollout(policy, target, q0, hp['eval_steps'])
        finals.append(errors[-1])
        starts.append(task.Arm(q0).error(target))
        arm, goal = task.Arm(q0), task.inverse_kinematics(target)
        for _ in range(hp['eval_steps']):
            arm.step(task.expert_chunk(arm.q, goal)[0])
        expert.append(arm.error(target))
    finals = np.array(finals)
    return {'episodes': len(finals), 'start_error_median': round(float(np.median(starts)), 4),
            'final_error_median': round(float(np.median(finals)), 4),
            'final_error_p90': round(float(np.percentile(finals, 90)), 4),
            'final_error_max': round(float(finals.max()), 4),
            'reached': round(float((finals < REACHED).mean()), 4),
            'expert_final_error_median': round(float(np.median(expert)), 6)}


def card(r: dict) -> str:
    """Return the README of the trained folder, written from its training report."""
    loop, hp = r['closed_loop'], r['hparams']
    return f"""# builtin:act-arm (the policy default)

An ACT policy (LeRobot 0.4's format and arithmetic) trained here by behaviour cloning to move
a simulated planar two-link arm's tip onto a target it sees. `make demo-policy` runs it over
ROS 2. It is a demonstration of a camera policy whose execution state can be snapshotted,
restored and replayed exactly; it knows this one simulated arm and nothing else.

- Inputs: `observation.state` (the two joint angles, rad) and `observation.images.top`
  (3x96x128, the arm and a green target disc from above, as `reach_task.picture` draws them).
- Output: 20-step chunks of joint targets (rad) for the arm's servos, blended by temporal
  ensembling (coefficient 0.01); one control step every {task.DT * 1e3:.0f} ms.
- Network: ResNet-18 trunk, a 2-layer encoder and a 1-layer decoder of width 64,
  {r['parameters']:,} parameters. The trunk's layer3 and layer4 keep their seeded weights
  (not trained); every frozen batch norm's statistics were measured on the task's pictures.
  This folder holds what training changed ({r['trained_parameters']:,} parameters and those
  statistics, `{TRAINED_FILE}`); `builtin:act-arm` lays it over the seeded weights and writes
  a complete LeRobot checkpoint folder to the cache, loaded by the code that loads a user's.
- Data: scenes drawn at random by `flashrt_ros.reach_task` (target anywhere in the reachable
  sector, start pose anywhere in the joint ranges, {hp['near_goal']:.0%} near the goal),
  labelled by the scripted expert (inverse kinematics, each joint walked toward the
  goal); nothing is downloaded.
- Training: {hp['steps']} steps of {hp['batch']} scenes, L1 loss on normalized chunks,
  seed {r['seed']}, {r['train_seconds'] / 60:.0f} minutes on one shared CPU thread;
  `python -m flashrt_ros.train_policy` rebuilds this folder.
- Closed loop on {loop['episodes']} held-out episodes ({hp['eval_steps']} control steps each,
  targets and start poses no training scene used): the tip's distance to the target falls from a
  median of {loop['start_error_median']:.2f} link lengths to {loop['final_error_median']:.3f}
  (p90 {loop['final_error_p90']:.3f}, max {loop['final_error_max']:.2f});
  {loop['reached']:.0%} of the episodes end within {REACHED} (the scripted expert:
  {loop['expert_final_error_median']:.4f}).
"""


# ---- main -------------------------------------------------------------------------------------

def train(out: Path, **overrides) -> dict:
    from safetensors.torch import save_file

    hp = dict(HPARAMS)
    hp.update({k: v for k, v in overrides.items() if v is not None})
    torch.set_num_threads(hp['threads'])
    torch.manual_seed(SEED)
    samples = Samples(SEED, hp)
    stats = task_stats(samples)
    policy = seeded_policy(stats)
    model, normalize = policy.model, policy.normalize
    _, images, _ = samples.batch(hp['calibration_images'])
    calibrate(model.backbone, normalize('observation.images.top', images))
    names = {f'model.{k}': p for k, p in model.named_parameters()}
    for name, p in names.items():
        p.requires_grad_(is_trained(name))
    params = [p for p in names.values() if p.requires_grad]
    print(f'model: {sum(p.numel() for p in names.values()) / 1e6:.2f}M parameters, '
          f'{sum(p.numel() for p in params) / 1e6:.2f}M trained; python '
          f'{sys.version.split()[0]}, torch {torch.__version__}', flush=True)
    opt = torch.optim.AdamW(params, lr=hp['lr'], weight_decay=hp['weight_decay'])
    model.train()
    start = time.time()
    for step in range(hp['steps']):
        for group in opt.param_groups:
            group['lr'] = learning_rate(step, hp)
        state, images, chunk = samples.batch(hp['batch'])
        predicted = model(normalize('observation.state', state),
                          None, [normalize('observation.images.top', images)])
        loss = (predicted - normalize('action', chunk)).abs().mean()  # ACT's L1 loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, hp['grad_clip'])
        opt.step()
        if step % 50 == 0 or step + 1 == hp['steps']:
            print(f'step {step}/{hp["steps"]} L1 {loss.item():.4f} '
                  f'{time.time() - start:.0f}s', flush=True)
    wall = time.time() - start
    model.eval()
    result = closed_loop(policy, hp, SEED + 1)
    report = {'seed': SEED, 'hparams': hp, 'frozen': list(FROZEN), 'stats': stats,
              'python': sys.version.split()[0], 'torch': torch.__version__,
              'parameters': sum(p.numel() for p in names.values()),
              'trained_parameters': sum(p.numel() for p in params),
              'train_seconds': round(wall, 1), 'final_l1': round(loss.item(), 4),
              'closed_loop': result}
    print(json.dumps(report, indent=1), flush=True)
    trained = {f'model.{k}': v.detach().contiguous() for k, v in model.state_dict().items()
               if is_trained(f'model.{k}')}
    out.mkdir(parents=True, exist_ok=True)
    save_file(trained, str(out / TRAINED_FILE))
    (out / REPORT_FILE).write_text(json.dumps(report, indent=1) + '\n')
    (out / 'README.md').write_text(card(report))
    print(f'saved {out}', flush=True)
    return report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[1])
    parser.add_argument('--out', type=Path, default=DEFAULT_OUT, help='output folder')
    parser.add_argument('--steps', type=int, help=f'default {HPARAMS["steps"]}')
    parser.add_argument('--threads', type=int, help=f'CPU threads, default {HPARAMS["threads"]}')
    args = parser.parse_args(argv)
    train(args.out, steps=args.steps, threads=args.threads)


if __name__ == '__main__':
    main()
