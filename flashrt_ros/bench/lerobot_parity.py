"""
ACT and SmolVLA parity against LeRobot itself: the same checkpoints and inputs, both timed.

    make bench-lerobot     (builds build/lerobot-venv, then runs this from build/bench-results)
    python -m flashrt_ros.bench.lerobot_parity --out DIR --lerobot-python PY [--threads N]

LeRobot (0.4.4, in its own environment, scripts/lerobot_env.sh) runs in a worker process
(lerobot_worker.py): it builds random-weight ACT policies with its own code and saves them
with their processors as its training script does, then runs preprocessor ->
predict_action_chunk / select_action -> postprocessor on seeded observations. This side
loads the same folders with `load_act` and computes the same chunks and select_action
sequences on the same thread count; the two sides are timed in alternating rounds. Last,
checkpoints written by `save_act_checkpoint` are loaded by LeRobot's `from_pretrained` and
processor factory, to check our writer's format. SmolVLA cases: LeRobot builds random
weights over a small SmolVLM folder written here (config and tokenizer, no VLM weights); both
sides get the same instruction and the SAME explicit noise, so chunks compare to rounding.
Results: lerobot_parity.json and lerobot_parity.md in the output folder.
"""

import argparse
import json
import os
from pathlib import Path
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from .common import Log, ratio, summarize
from .plots import lerobot_parity as lerobot_plot

LEROBOT_ENV = 'FLASHRT_LEROBOT_PYTHON'
WORKER = Path(__file__).with_name('lerobot_worker.py')
TOLERANCE = 1e-5  # max abs difference, float32 actions
IMAGE = [3, 240, 320]

# name, cameras, normalizer stats, ACTConfig overrides, select_action steps compared
CASES = (
    ('1cam', ('top',), False, {'n_action_steps': 10}, 20),
    ('1cam_stats', ('top',), True, {'n_action_steps': 10}, 20),
    ('2cam_stats', ('top', 'wrist'), True, {'n_action_steps': 10}, 20),
    ('2cam_ensemble', ('top', 'wrist'), True,
     {'n_action_steps': 1, 'temporal_ensemble_coeff': 0.01}, 8),
)
# name, cameras (name, [3, H, W]), SmolVLAConfig overrides, save_tiny_vlm overrides, steps
SMOLVLA_CASES = (
    ('smolvla_tiny', (('top', [3, 48, 64]),),
     {'chunk_size': 10, 'n_action_steps': 5, 'max_state_dim': 16, 'max_action_dim': 16,
      'resize_imgs_with_padding': (64, 64), 'num_steps': 3,
      'num_vlm_layers': 4}, {}, 10),
    # SmolVLA's own layout, scaled down: 2 cameras padded to 256x256, 16 tokens each (pixel
    # shuffle 4), 8 VLM layers alternating self- and cross-attention, 50-step chunks, 10 steps
    ('smolvla_small_2cam', (('top', [3, 240, 320]), ('wrist', [3, 240, 320])),
     {'resize_imgs_with_padding': (256, 256), 'num_vlm_layers': 8},
     {'scale_factor': 4,
      'vision_config': {'hidden_size': 192, 'intermediate_size': 768, 'num_hidden_layers': 4,
                        'num_attention_heads': 3, 'image_size': 256, 'patch_size': 16},
      'text_config': {'hidden_size': 384, 'intermediate_size': 1024, 'num_hidden_layers': 8,
                      'num_attention_heads': 6, 'num_key_value_heads': 2, 'head_dim': 64}}, 50),
)
TASK = 'pick up the cube and place it in the bowl'
STATE_DIM = ACTION_DIM = 14  # a bimanual arm (ALOHA); ACT's other defaults (chunk 100) kept
PER_ROUND = 2  # timed runs per side per round; the sides alternate round by round


class LeRobotProcess:
    """The LeRobot worker: one JSON request per line, one reply per line."""

    def __init__(self, python):
        self.proc = subprocess.Popen([python, str(WORKER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def __call__(self, op, **kwargs):
        self.proc.stdin.write(json.dumps({'op': op, **kwargs}) + '\n')
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f'the LeRobot worker exited during {op!r} (its stderr is above)')
        reply = json.loads(line)
        if 'error' in reply:
            raise RuntimeError(f'LeRobot {op}: {reply["error"]}')
        return reply

    def close(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def write_observations(path, config, steps, seed, stats=None):
    """Seeded observations for the features in a checkpoint's config.json (uint8 images)."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for key, feature in config['input_features'].items():
        shape = [steps, *feature['shape']]
        if feature['type'] == 'VISUAL':
            arrays[key] = rng.integers(0, 256, shape, dtype=np.uint8)
        else:
            x = rng.standard_normal(shape).astype(np.float32)
            if stats is not None and f'{key}/mean' in stats:
                x = x * stats[f'{key}/std'] + stats[f'{key}/mean']
            arrays[key] = x.astype(np.float32)
    np.savez(path, **arrays)


def make_stats(cameras, seed):
    """MEAN_STD stats as a dataset's: per-dimension state/action, per-channel images."""
    rng = np.random.default_rng(seed)
    stats = {}
    for key in ('observation.state', 'action'):
        stats[f'{key}/mean'] = rng.standard_normal(STATE_DIM).astype(np.float32)
        stats[f'{key}/std'] = rng.uniform(0.2, 2.0, STATE_DIM).astype(np.float32)
    for cam in cameras:
        key = f'observation.images.{cam}'
        stats[f'{key}/mean'] = rng.uniform(0.3, 0.6, (3, 1, 1)).astype(np.float32)
        stats[f'{key}/std'] = rng.uniform(0.15, 0.3, (3, 1, 1)).astype(np.float32)
    return stats


def _observations(path, steps):
    """Observations as the runtime takes them: float32 [state_dim], [3, H, W] in [0, 1]."""
    with np.load(path) as f:
        arrays = {k: f[k][:steps] for k in f.files}
    # the worker's conversion: uint8 -> float32, then / 255 in float32
    arrays = {k: v.astype(np.float32) / 255.0 if v.dtype == np.uint8 else v.astype(np.float32)
              for k, v in arrays.items()}
    return [{k: torch.from_numpy(v[t]) for k, v in arrays.items()} for t in range(steps)]


def samples_s(fn, repeats, warmup=0):
    """Wall seconds of `repeats` calls of fn after `warmup` untimed ones (as the worker's)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return samples


class Ours:
    """The same checkpoint through `load_act`: chunk, select_action sequence, timing."""

    def __init__(self, directory, obs_path, steps):
        from flashrt_ros.runtime.models.act import load_act

        self.module, self.spec = load_act(directory, torch.device('cpu'), torch.float32)
        # the temporal ensemble's state, as the arena would hold it (zero: a fresh episode)
        self.state = {s.name: torch.zeros(s.shape, dtype=s.dtype)
                      for s in self.module.state_specs(steps)}
        self.module.bind(self.state)
        self.observations = _observations(obs_path, steps)
        self.generator = torch.Generator().manual_seed(0)
        self.steps = steps

    def reset(self):
        """Start a fresh episode, as LeRobot's reset does: the ensemble zeroed."""
        for t in self.state.values():
            t.zero_()

    def run(self):
        """Return {'chunk': [chunk_size, action_dim], 'actions': [steps, action_dim]}."""
        obs = self.observations
        self.reset()
        with torch.inference_mode():
            chunk = self.module.predict_chunk(obs[0]).float().numpy()
            actions, t = [], 0
            while t < self.steps:  # each call covers its select_action calls from position t
                out = self.module(obs[t], t, self.generator)  # [n, action_dim]
                actions.append(out.float().numpy())
                t += len(out)
        return {'chunk': chunk, 'actions': np.concatenate(actions)[:self.steps]}

    def time(self, what, repeats, warmup=0):
        """Time predict_chunk, or a call at position 0 of a fresh episode (computes a chunk)."""
        obs = self.observations[0]
        if what == 'select':
            def fn():
                self.reset()
                return self.module(obs, 0, self.generator)
        else:
            def fn():
                return self.module.predict_chunk(obs)
        with torch.inference_mode():
            return samples_s(fn, repeats, warmup)


def interleaved_ms(worker, mine, what, rounds, per_round, warmup=2):
    """Time both sides in alternating rounds, so both see the same machine; ms summaries."""
    worker('time', what=what, repeats=0, warmup=warmup)
    mine.time(what, 0, warmup)
    theirs, ours = [], []
    for r in range(rounds):  # who goes first alternates too, against drift within a round
        for side in (0, 1) if r % 2 == 0 else (1, 0):
            if side == 0:
                theirs += worker('time', what=what, repeats=per_round)['samples_s']
            else:
                ours += mine.time(what, per_round)
    return summarize(theirs, scale=1e3), summarize(ours, scale=1e3)


def _max_abs(a, b):
    if a.shape != b.shape:
        raise ValueError(f'shapes differ: {a.shape} vs {b.shape}')
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


def compare(out_path, mine):
    """Max abs differences of the chunk and the select_action sequence."""
    with np.load(out_path) as f:
        theirs = {k: f[k] for k in f.files}
    return {'chunk_max_abs': _max_abs(theirs['chunk'], mine['chunk']),
            'select_max_abs': _max_abs(theirs['actions'], mine['actions']),
            'chunk_abs_max': float(np.abs(theirs['chunk']).max())}


def both(worker, folder, obs_path, out_path, steps):
    """Load folder on both sides and run the same observations; (ours, differences)."""
    loaded = worker('load', path=str(folder))
    worker('run', obs=str(obs_path), out=str(out_path), steps=steps)
    mine = Ours(folder, obs_path, steps)
    diffs = compare(out_path, mine.run())
    diffs['within_tolerance'] = max(diffs['chunk_max_abs'], diffs['select_max_abs']) <= TOLERANCE
    return mine, {'parameters': loaded['parameters'], **diffs}


def run_case(worker, work, case, index, rounds, log):
    """Build one case with LeRobot, run and time both sides, return its row."""
    name, cameras, with_stats, overrides, steps = case
    folder = work / name
    stats = stats_path = None
    if with_stats:
        stats = make_stats(cameras, seed=100 + index)
        stats_path = work / f'{name}-stats.npz'
        np.savez(stats_path, **stats)
    config = {'cameras': {cam: IMAGE for cam in cameras}, 'state_dim': STATE_DIM,
              'action_dim': ACTION_DIM, **overrides}
    worker('build', path=str(folder), config=config, seed=index,
           stats=stats_path and str(stats_path))
    checkpoint = json.loads((folder / 'config.json').read_text())
    obs_path = work / f'{name}-obs.npz'
    write_observations(obs_path, checkpoint, steps, seed=200 + index, stats=stats)
    mine, diffs = both(worker, folder, obs_path, work / f'{name}-lerobot.npz', steps)
    row = {'case': name, 'cameras': len(cameras), 'stats': with_stats, **overrides,
           'chunk_size': checkpoint['chunk_size'], 'steps': steps, **diffs}
    for what in ('chunk', 'select'):
        row[f'lerobot_{what}_ms'], row[f'ours_{what}_ms'] = interleaved_ms(
            worker, mine, what, rounds, PER_ROUND)
        theirs, mine_ms = row[f'lerobot_{what}_ms'], row[f'ours_{what}_ms']
        row[f'{what}_speedup'] = ratio(theirs['median'], mine_ms['median'])
        # the fast tail: less skewed by other load on a shared machine than the median
        row[f'{what}_speedup_p10'] = ratio(theirs['p10'], mine_ms['p10'])
    log(f"{name}: max |diff| chunk {row['chunk_max_abs']:.2e}, select "
        f"{row['select_max_abs']:.2e}; chunk {row['lerobot_chunk_ms']['median']:.1f} ms "
        f"(LeRobot) vs {row['ours_chunk_ms']['median']:.1f} ms (ours), "
        f"x{row['chunk_speedup']:.2f}")
    return row


class OursSmolVLA(Ours):
    """The same SmolVLA folder through `load_smolvla`, with the task and the noise LeRobot got."""

    def __init__(self, directory, obs_path, steps, vlm, noise):
        from flashrt_ros.runtime.models.smolvla import load_smolvla

        self.module, self.spec = load_smolvla(directory, 'cpu', torch.float32, vlm_path=vlm)
        self.state = {s.name: torch.zeros(s.shape, dtype=s.dtype)
                      for s in self.module.state_specs(steps)}
        self.module.bind(self.state)
        self.module.instruct(TASK)
        self.observations = _observations(obs_path, steps)
        self.noise = noise
        self.steps = steps

    def run(self):
        """Chunk on observation 0; select_action's sequence: a chunk whenever the queue empties."""
        obs = self.observations
        with torch.inference_mode():
            chunk = self.module.predict_chunk(obs[0], self.noise).numpy()
            actions, t = [], 0
            while t < self.steps:
                self.module.prefix(obs[t])
                out = self.module.sample(None, self.noise)  # [n_action_steps, action_dim]
                actions.append(out.numpy())
                t += len(out)
        return {'chunk': chunk, 'actions': np.concatenate(actions)[:self.steps]}

    def time(self, what, repeats, warmup=0):
        """Time a chunk (prefix and denoising), or one more draw over the kept prefix."""
        obs = self.observations[0]
        if what == 'sample':
            self.module.prefix(obs)

            def fn():
                return self.module.sample(None, self.noise)
        else:
            def fn():
                return self.module.predict_chunk(obs, self.noise)
        with torch.inference_mode():
            return samples_s(fn, repeats, warmup)


def run_smolvla_case(worker, work, case, index, rounds, log):
    """Build one SmolVLA with LeRobot over a small VLM folder, run and time both sides."""
    from flashrt_ros.runtime.models.smolvla import save_tiny_vlm

    name, cameras, overrides, vlm_overrides, steps = case
    vlm = save_tiny_vlm(work / f'{name}-vlm', **vlm_overrides)
    folder = work / name
    stats = make_stats([cam for cam, _ in cameras], seed=500 + index)
    stats_path = work / f'{name}-stats.npz'
    np.savez(stats_path, **stats)
    config = {'cameras': dict(cameras), 'state_dim': STATE_DIM, 'action_dim': ACTION_DIM,
              'vlm_model_name': str(vlm), **overrides}
    loaded = worker('build_smolvla', path=str(folder), config=config, seed=index,
                    stats=str(stats_path))
    checkpoint = json.loads((folder / 'config.json').read_text())
    obs_path, noise_path = work / f'{name}-obs.npz', work / f'{name}-noise.npz'
    write_observations(obs_path, checkpoint, steps, seed=600 + index, stats=stats)
    noise = torch.randn(1, checkpoint['chunk_size'], checkpoint['max_action_dim'],
                        generator=torch.Generator().manual_seed(700 + index))
    np.savez(noise_path, noise=noise.numpy())
    worker('load', path=str(folder))
    out_path = work / f'{name}-lerobot.npz'
    worker('run', obs=str(obs_path), out=str(out_path), steps=steps, task=TASK,
           noise=str(noise_path))
    mine = OursSmolVLA(folder, obs_path, steps, vlm, noise[0])
    diffs = compare(out_path, mine.run())
    diffs['within_tolerance'] = max(diffs['chunk_max_abs'], diffs['select_max_abs']) <= TOLERANCE
    row = {'case': name, 'cameras': len(cameras), 'stats': True, **loaded,
           'chunk_size': checkpoint['chunk_size'], 'n_action_steps': checkpoint['n_action_steps'],
           'prefix_tokens': mine.spec['prefix_tokens'], 'steps': steps, **diffs}
    timed = interleaved_ms(worker, mine, 'chunk', rounds, PER_ROUND)
    row['lerobot_chunk_ms'], row['ours_chunk_ms'] = timed
    row['chunk_speedup'] = ratio(row['lerobot_chunk_ms']['median'],
                                 row['ours_chunk_ms']['median'])
    row['chunk_speedup_p10'] = ratio(row['lerobot_chunk_ms']['p10'], row['ours_chunk_ms']['p10'])
    # a further draw from the kept prefix (best-of-n): LeRobot has no such step
    row['ours_sample_ms'] = summarize(mine.time('sample', rounds * PER_ROUND, 2), scale=1e3)
    log(f"{name}: max |diff| chunk {row['chunk_max_abs']:.2e}, select "
        f"{row['select_max_abs']:.2e}; chunk {row['lerobot_chunk_ms']['median']:.1f} ms "
        f"(LeRobot) vs {row['ours_chunk_ms']['median']:.1f} ms (ours), "
        f"x{row['chunk_speedup']:.2f}; a further draw {row['ours_sample_ms']['median']:.1f} ms")
    return row


def writer_stats(config, seed):
    """MEAN_STD stats for a config.json's features, image stats per channel ([C])."""
    rng = np.random.default_rng(seed)
    stats = {}
    for key, f in {**config['input_features'], **config['output_features']}.items():
        n = f['shape'][0]
        if f['type'] == 'VISUAL':
            stats[key] = {'mean': rng.uniform(0.3, 0.6, n), 'std': rng.uniform(0.15, 0.3, n)}
        else:
            stats[key] = {'mean': rng.standard_normal(n), 'std': rng.uniform(0.2, 2.0, n)}
    return stats


# name, save_act_checkpoint stats ('random' or {}: no normalization), config overrides
WRITER_CASES = (
    ('writer_tiny', {}, {}),
    ('writer_2cam_stats_ensemble', 'random', {
        'input_features': {'observation.state': {'type': 'STATE', 'shape': [6]},
                           'observation.images.top': {'type': 'VISUAL', 'shape': [3, 48, 64]},
                           'observation.images.wrist': {'type': 'VISUAL',
                                                        'shape': [3, 48, 64]}},
        'n_action_steps': 1, 'temporal_ensemble_coeff': 0.01}),
)


def writer_check(worker, work, case, index, log):
    """Load a `save_act_checkpoint` folder with LeRobot and compare it with `load_act`."""
    from flashrt_ros.runtime.models.lerobot import save_act_checkpoint, TINY_ACT

    name, stats, overrides = case
    steps = 4
    config = {**TINY_ACT, **overrides}
    if stats == 'random':
        stats = writer_stats(config, seed=400 + index)
    folder = Path(save_act_checkpoint(work / name, seed=index, stats=stats, **overrides))
    config = json.loads((folder / 'config.json').read_text())
    obs_path = work / f'{name}-obs.npz'
    write_observations(obs_path, config, steps, seed=300 + index)
    cameras = sum(f['type'] == 'VISUAL' for f in config['input_features'].values())
    row = {'case': name, 'cameras': cameras, 'stats': bool(stats),
           'chunk_size': config['chunk_size'], 'steps': steps}
    try:
        _, diffs = both(worker, folder, obs_path, work / f'{name}-lerobot.npz', steps)
    except RuntimeError as exc:  # LeRobot refused the folder
        log(f'{name}: LeRobot cannot load it: {exc}')
        return {**row, 'error': str(exc)[:500], 'within_tolerance': False}
    log(f"{name}: LeRobot loads it; max |diff| chunk {diffs['chunk_max_abs']:.2e}, select "
        f"{diffs['select_max_abs']:.2e}")
    return {**row, **diffs}


def _cell(value, spec):
    if isinstance(value, dict):  # a summarize() of milliseconds
        value = value['median']
    return '-' if value is None else format(value, spec)


def markdown(result):
    """Return the result as a small markdown table."""
    lines = [f"# ACT and SmolVLA: flashrt_ros vs LeRobot {result['lerobot']} "
             f"({result['threads']} threads, CPU)", '',
             f"torch {result['torch_ours']} (ours), {result['torch_lerobot']} (LeRobot); "
             f'tolerance {TOLERANCE:g}; load average before/after '
             f"{result['load_average_before'][0]:.1f}/{result['load_average_after'][0]:.1f} "
             f'(a load well above {result["threads"]} means other work shared the cores)', '',
             '| case | max abs diff chunk | select_action seq | LeRobot ms/chunk | ours ms/chunk '
             '| speedup | speedup (p10) | LeRobot ms/select | ours ms/select |',
             '|---|---|---|---|---|---|---|---|---|']
    columns = (('chunk_max_abs', '.2e'), ('select_max_abs', '.2e'), ('lerobot_chunk_ms', '.1f'),
               ('ours_chunk_ms', '.1f'), ('chunk_speedup', '.2f'), ('chunk_speedup_p10', '.2f'),
               ('lerobot_select_ms', '.1f'), ('ours_select_ms', '.1f'))
    for r in result['rows']:
        if r['case'].startswith('smolvla'):
            continue
        cells = [_cell(r.get(key), spec) for key, spec in columns]
        if 'error' in r:
            cells[0] = f"LeRobot refused it: {r['error'][:120]}"
        lines.append(f"| {r['case']} | {' | '.join(cells)} |")
    smolvla = [r for r in result['rows'] if r['case'].startswith('smolvla')]
    if smolvla:
        lines += ['', 'SmolVLA (same instruction, same explicit noise; select_action over '
                  'n_action_steps per chunk; a further draw reuses the prefix in the arena):', '',
                  '| case | prefix tokens | max abs diff chunk | select_action seq | LeRobot '
                  'ms/chunk | ours ms/chunk | speedup | ours ms/further draw |',
                  '|---|---|---|---|---|---|---|---|']
        for r in smolvla:
            cells = [_cell(r.get(k), f) for k, f in (
                ('chunk_max_abs', '.2e'), ('select_max_abs', '.2e'), ('lerobot_chunk_ms', '.1f'),
                ('ours_chunk_ms', '.1f'), ('chunk_speedup', '.2f'), ('ours_sample_ms', '.1f'))]
            lines.append(f"| {r['case']} | {r['prefix_tokens']} | {' | '.join(cells)} |")
    lines += ['', f"all within tolerance: {result['all_within_tolerance']}", '']
    return '\n'.join(lines)


def parity(python, out, threads, rounds, log, keep=False, skip_smolvla=False):
    """Run every case and the writer check; write the JSON and markdown; return the result."""
    torch.set_num_threads(threads)
    load_before = os.getloadavg()
    worker = LeRobotProcess(python)
    with tempfile.TemporaryDirectory(prefix='lerobot-parity-') as tmp:
        work = out / 'lerobot-parity' if keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        try:
            versions = worker('versions')
            worker('threads', n=threads)
            log(f"LeRobot {versions['lerobot']} (torch {versions['torch']}), torch "
                f'{torch.__version__} here, {threads} threads')
            rows = [run_case(worker, work, case, i, rounds, log)
                    for i, case in enumerate(CASES)]
            rows += [writer_check(worker, work, case, i, log)
                     for i, case in enumerate(WRITER_CASES)]
            if not skip_smolvla:
                rows += [run_smolvla_case(worker, work, case, i, rounds, log)
                         for i, case in enumerate(SMOLVLA_CASES)]
        finally:
            worker.close()
    # a shared machine skews times; the load averages say how busy it was around the run
    result = {'load_average_before': load_before, 'load_average_after': os.getloadavg(),
              'lerobot': versions['lerobot'], 'torch_lerobot': versions['torch'],
              'torch_ours': torch.__version__, 'threads': threads,
              'timed_runs': rounds * PER_ROUND,
              'tolerance': TOLERANCE, 'rows': rows,
              'all_within_tolerance': all(r['within_tolerance'] for r in rows)}
    (out / 'lerobot_parity.json').write_text(json.dumps(result, indent=1))
    (out / 'lerobot_parity.md').write_text(markdown(result))
    act = [r for r in rows if not r['case'].startswith('smolvla')]
    if any('lerobot_chunk_ms' in r for r in act):  # the figure is ACT's
        lerobot_plot({**result, 'rows': act}, str(out / 'cpu-lerobot-act.png'))
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument('--out', default='.', help='folder for the JSON and markdown')
    parser.add_argument('--lerobot-python', default=os.environ.get(LEROBOT_ENV),
                        help=f"the LeRobot environment's python (or ${LEROBOT_ENV})")
    parser.add_argument('--threads', type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument('--rounds', type=int, default=5,
                        help=f'timing rounds after 2 warm-ups; {PER_ROUND} runs per side each')
    parser.add_argument('--skip-smolvla', action='store_true',
                        help='ACT only (SmolVLA needs transformers in the LeRobot environment)')
    parser.add_argument('--keep', action='store_true',
                        help='keep checkpoints and observations under OUT/lerobot-parity')
    args = parser.parse_args(argv)
    if not args.lerobot_python or not os.access(args.lerobot_python, os.X_OK):
        parser.error('no LeRobot environment: run `make bench-lerobot` (builds '
                     f'build/lerobot-venv) or pass --lerobot-python / set {LEROBOT_ENV}')
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = parity(args.lerobot_python, out, args.threads, args.rounds, Log(), args.keep,
                    args.skip_smolvla)
    print(markdown(result))
    return 0 if result['all_within_tolerance'] else 1


if __name__ == '__main__':
    sys.exit(main())
