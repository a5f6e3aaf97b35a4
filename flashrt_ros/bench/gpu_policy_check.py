"""
CUDA check of the LeRobot policies: ACT and SmolVLA capsules replay exactly on a GPU.

    PYTHONPATH=. python3 flashrt_ros/bench/gpu_policy_check.py   # no ROS needed

Tiny random-weight checkpoints in LeRobot's format; on each tier a restore must replay the
next chunks bit for bit. ACT's first chunk is also compared with the CPU's (cuDNN may run
the convolutions in TF32); SmolVLA's is not: its noise comes from each device's generator.
"""

import json
import sys
import tempfile

from flashrt_ros.runtime import Runtime, RuntimeConfig
from flashrt_ros.runtime.models.lerobot import save_act_checkpoint
from flashrt_ros.runtime.models.smolvla import save_smolvla_checkpoint, save_tiny_vlm
import torch


def _obs(seed):
    g = torch.Generator().manual_seed(seed)
    return {'observation.state': torch.randn(6, generator=g),
            'observation.images.top': torch.rand(3, 48, 64, generator=g)}


def check(folder, device, tmp, instruct=False):
    """Replay after a restore on each tier; return the results and the first chunk."""
    out = {}
    rt = Runtime(RuntimeConfig(model=str(folder), device=device,
                               capsule_dir=f'{folder}-caps-{device}'))
    rt.warmup()
    if instruct:
        rt.instruct('pick up the cube')
    first = rt.act(_obs(1)).actions
    for tier in ('device', 'host', 'disk'):
        rt.snapshot(f's-{tier}', tier=tier)
        later = [rt.act(_obs(2 + i)).actions for i in range(3)]
        rt.restore(f's-{tier}')
        again = [rt.act(_obs(2 + i)).actions for i in range(3)]
        out[tier] = all(torch.equal(a, b) for a, b in zip(later, again))
    rt.close()
    return out, first


def main():
    tmp = tempfile.mkdtemp()
    act = save_act_checkpoint(f'{tmp}/act', seed=1, n_action_steps=1,
                              temporal_ensemble_coeff=0.01)
    vla = save_smolvla_checkpoint(f'{tmp}/vla', vlm_folder=save_tiny_vlm(f'{tmp}/vlm'), seed=2)
    report = {'torch': torch.__version__, 'cuda': torch.cuda.is_available()}
    for name, folder, instruct in (('act', act, False), ('smolvla', vla, True)):
        cuda, first_cuda = check(folder, 'cuda', tmp, instruct)
        _, first_cpu = check(folder, 'cpu', tmp, instruct) if not instruct else (None, None)
        report[name] = {'replay_exact_by_tier': cuda}
        if not instruct:  # the same noise-free computation on both devices
            report[name]['cuda_vs_cpu_max_abs'] = float((first_cuda - first_cpu).abs().max())
    print(json.dumps(report, indent=1))
    ok = all(all(report[n]['replay_exact_by_tier'].values()) for n in ('act', 'smolvla'))
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
