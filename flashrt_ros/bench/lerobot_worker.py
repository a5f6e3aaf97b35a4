"""
LeRobot side of the ACT and SmolVLA parity benchmark; run by the LeRobot environment's Python.

    build/lerobot-venv/bin/python lerobot_worker.py

Reads one JSON request per line on stdin and answers one JSON line on stdout; the timing
loops run here, so the pipe is never inside a timed region. It imports only LeRobot, torch
and numpy, never flashrt_ros. Observations come in an .npz (uint8 images, [T, 3, H, W] per
camera, divided by 255 here; float32 states [T, state_dim]); outputs go to an .npz. Requests:
  {"op": "threads", "n": n}                  torch.set_num_threads(n)
  {"op": "build", "path": d, "config": {...}, "seed": s, "stats": file.npz | null}
      a random-weight ACTPolicy and its processors, saved as LeRobot's training script does
  {"op": "build_smolvla", "path": d, "config": {...}, "seed": s, "stats": file.npz | null}
      the same for a SmolVLA over the VLM folder config["vlm_model_name"] (no VLM weights)
  {"op": "load", "path": d}                  <type>Policy.from_pretrained + the processor factory
  {"op": "run", "obs": file.npz, "out": file.npz, "steps": n, "task": str?, "noise": file.npz?}
      write 'chunk' (preprocessor -> predict_action_chunk -> postprocessor on observation 0)
      and 'actions' (select_action over observations 0..steps-1 after reset()); a SmolVLA gets
      the task and the same noise ('noise' [1, chunk_size, max_action_dim]) for every chunk
  {"op": "time", "what": "chunk"|"select", "repeats": r, "warmup": w}
      wall seconds of r chunks (or select_action steps that compute one) on observation 0
"""

import json
import sys
import time

from lerobot.configs.types import FeatureType, PolicyFeature
from lerobot.policies.act.configuration_act import ACTConfig
from lerobot.policies.act.modeling_act import ACTPolicy
from lerobot.policies.factory import make_pre_post_processors
import numpy as np
import torch


def _features(config):
    """Return ACTConfig features of {'cameras': {name: [3, H, W]}, 'state_dim', 'action_dim'}."""
    inputs = {f'observation.images.{cam}': PolicyFeature(FeatureType.VISUAL, tuple(shape))
              for cam, shape in config.pop('cameras').items()}
    inputs['observation.state'] = PolicyFeature(FeatureType.STATE, (config.pop('state_dim'),))
    outputs = {'action': PolicyFeature(FeatureType.ACTION, (config.pop('action_dim'),))}
    return inputs, outputs


def build(path, config, seed, stats=None, smolvla=False):
    """Build a random-weight ACT with LeRobot's code and save it with its processors."""
    inputs, outputs = _features(dict(config))
    rest = {k: v for k, v in config.items() if k not in ('cameras', 'state_dim', 'action_dim')}
    torch.manual_seed(seed)
    if smolvla:  # the VLM's config and tokenizer from a local folder, its weights random
        from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig
        from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy

        cfg = SmolVLAConfig(input_features=inputs, output_features=outputs, device='cpu',
                            load_vlm_weights=False, **rest)
        policy = SmolVLAPolicy(cfg)
    else:  # ACT's default normalization_mapping: MEAN_STD for images, state and action
        cfg = ACTConfig(input_features=inputs, output_features=outputs, device='cpu',
                        pretrained_backbone_weights=None, **rest)
        policy = ACTPolicy(cfg)
    dataset_stats = None
    if stats:
        with np.load(stats) as f:  # keys 'observation.state/mean', ...
            dataset_stats = {}
            for key in f.files:
                feature, stat = key.rsplit('/', 1)
                dataset_stats.setdefault(feature, {})[stat] = torch.from_numpy(f[key])
    pre, post = make_pre_post_processors(cfg, dataset_stats=dataset_stats)
    # lerobot/utils/train_utils.py save_checkpoint: the policy, then both pipelines
    policy.save_pretrained(path)
    pre.save_pretrained(path)
    post.save_pretrained(path)
    return {'parameters': sum(p.numel() for p in policy.parameters())}


def _observations(path):
    """Per-step observation dicts, unbatched (the preprocessor adds the batch dimension)."""
    with np.load(path) as f:
        arrays = {k: f[k] for k in f.files}
    steps = len(arrays['observation.state'])
    obs = []
    for t in range(steps):
        step = {}
        for key, value in arrays.items():
            x = value[t].astype(np.float32) / 255.0 if value.dtype == np.uint8 else value[t]
            step[key] = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
        obs.append(step)
    return obs


def samples_s(fn, repeats, warmup=0):
    """Wall seconds of `repeats` calls of fn after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return samples


class Loaded:
    """One checkpoint loaded as a user would: the policy and both processor pipelines."""

    def __init__(self):
        self.policy = self.pre = self.post = self.first = self.noise = None

    def load(self, path):
        """Load path with its policy class's from_pretrained and the processor factory."""
        with open(f'{path}/config.json') as f:
            kind = json.load(f)['type']
        policy_class = ACTPolicy
        if kind == 'smolvla':
            from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy as policy_class
        self.policy = policy_class.from_pretrained(path)
        self.policy.eval()
        self.pre, self.post = make_pre_post_processors(
            self.policy.config, pretrained_path=path,
            preprocessor_overrides={'device_processor': {'device': 'cpu'}})
        return {'parameters': sum(p.numel() for p in self.policy.parameters())}

    def _noise(self):
        return {} if self.noise is None else {'noise': self.noise}

    def chunk(self, observation):
        """Preprocessor -> predict_action_chunk -> postprocessor: [1, chunk_size, action_dim]."""
        with torch.inference_mode():
            return self.post(self.policy.predict_action_chunk(self.pre(dict(observation)),
                                                              **self._noise()))

    def select(self, observation):
        """One select_action step through both pipelines: [1, action_dim]."""
        with torch.inference_mode():
            return self.post(self.policy.select_action(self.pre(dict(observation)),
                                                       **self._noise()))

    def run(self, obs, out, steps, task=None, noise=None):
        """Write 'chunk' (observation 0) and 'actions' (select_action over 0..steps-1)."""
        observations = _observations(obs)
        if task is not None:
            observations = [{**o, 'task': task} for o in observations]
        if noise is not None:
            with np.load(noise) as f:
                self.noise = torch.from_numpy(f['noise'])
        self.first = observations[0]
        chunk = self.chunk(self.first)
        self.policy.reset()
        actions = torch.cat([self.select(o) for o in observations[:steps]])
        np.savez(out, chunk=chunk[0].numpy(), actions=actions.numpy())
        return {'chunk_shape': list(chunk.shape[1:]), 'steps': len(actions)}

    def time(self, what, repeats, warmup=0):
        """Time a chunk, or a select_action step that computes one, on observation 0."""
        def select():
            self.policy.reset()  # the queue empty (or the ensembler fresh): a chunk is computed
            self.select(self.first)

        fn = select if what == 'select' else lambda: self.chunk(self.first)
        return {'samples_s': samples_s(fn, repeats, warmup)}


def main():
    loaded = Loaded()
    ops = {
        'threads': lambda n: {'threads': torch.set_num_threads(n) or torch.get_num_threads()},
        'build': build,
        'build_smolvla': lambda **kw: build(**kw, smolvla=True),
        'load': loaded.load,
        'run': loaded.run,
        'time': loaded.time,
        'versions': lambda: {'torch': torch.__version__, 'lerobot': _lerobot_version()},
    }
    replies, sys.stdout = sys.stdout, sys.stderr  # stray prints must not reach the pipe
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = ops[request.pop('op')](**request)
        except Exception as exc:  # reported to the caller, who raises
            reply = {'error': f'{type(exc).__name__}: {exc}'}
        replies.write(json.dumps(reply) + '\n')
        replies.flush()


def _lerobot_version():
    from importlib.metadata import version

    return version('lerobot')


if __name__ == '__main__':
    main()
