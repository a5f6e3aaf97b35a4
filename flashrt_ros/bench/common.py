"""What every figure shares: sample statistics, progress lines, and the run's environment."""

import importlib.metadata
import os
import platform
import subprocess
import sys
import time

import numpy as np
import torch

# Published reference results ("Execution-State Capsules", RTX 5090), shown beside ours.
PAPER = {
    'gpu': 'RTX 5090',
    'ttft_speedup': {2048: 3.9, 16384: 27.0},
    'restore_ms_max': 1.0,  # GPU-resident snapshot and restore under 1 ms
}


def stamp_s(header):
    """Return a std_msgs/Header's stamp in seconds (the wall clock of the node's host)."""
    return header.stamp.sec + header.stamp.nanosec * 1e-9


def busy_processes(n):
    """Start `n` unrelated processes that keep a core busy each (a Python loop, nice 0)."""
    return [subprocess.Popen([sys.executable, '-c', 'while True: pass']) for _ in range(n)]


def summarize(samples, scale=1.0):
    """Return median, p10, p90 (times `scale`) and n of a list of samples."""
    x = np.asarray(samples, dtype=np.float64) * scale
    if x.size == 0:
        return {'median': None, 'p10': None, 'p90': None, 'n': 0}
    p10, median, p90 = np.percentile(x, [10, 50, 90])
    return {'median': float(median), 'p10': float(p10), 'p90': float(p90), 'n': int(x.size)}


def ratio(a, b):
    """Return a / b, or None when either is missing or b is zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b


class Log:
    """Progress lines on stderr, stamped with the seconds since the run started."""

    def __init__(self, quiet=False):
        self.t0 = time.monotonic()
        self.quiet = quiet

    def __call__(self, message):
        """Print one progress line."""
        if not self.quiet:
            print(f'[{time.monotonic() - self.t0:7.1f}s] {message}', file=sys.stderr,
                  flush=True)

    def elapsed(self):
        """Return the seconds since the run started."""
        return time.monotonic() - self.t0


def cpu_sample():
    """Return (wall s, CPU s of this process and its waited-for children, /proc/stat cpu row)."""
    try:
        with open('/proc/stat') as f:
            jiffies = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        jiffies = []
    t = os.times()
    return time.monotonic(), t.user + t.system + t.children_user + t.children_system, jiffies


def cpu_usage(start, end):
    """Say how busy the machine was between two cpu_sample()s, and how much of it was us."""
    wall = max(end[0] - start[0], 1e-9)
    ours = 100.0 * (end[1] - start[1]) / (wall * (os.cpu_count() or 1))
    usage = {'this_run_pct': round(ours, 1)}
    d = [b - a for a, b in zip(start[2], end[2])]
    if len(d) == 8 and sum(d) > 0:  # user nice system idle iowait irq softirq steal
        busy = 100.0 * (sum(d) - d[3] - d[4]) / sum(d)
        usage.update(machine_busy_pct=round(busy, 1), others_pct=round(max(0.0, busy - ours), 1),
                     steal_pct=round(100.0 * d[7] / sum(d), 1))
    return usage


def _version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model():
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('model name'):
                    return line.split(':', 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _git_commit():
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(['git', 'describe', '--always', '--dirty', '--abbrev=7'], cwd=here,
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def machine_info():
    """Describe the host: CPU, cores, threads, load and the software versions."""
    return {
        'platform': platform.platform(),
        'cpu': _cpu_model(),
        'cpu_count': os.cpu_count(),
        'torch_threads': torch.get_num_threads(),
        'loadavg_start': list(os.getloadavg()),
        'python': platform.python_version(),
        'torch': torch.__version__,
        'transformers': _version('transformers'),
        'rclpy': _version('ros-rclpy') or _version('rclpy'),
        'git_commit': _git_commit(),
        'kernels': {
            'flash_linear_attention': _version('flash-linear-attention') is not None,
            'causal_conv1d': _version('causal-conv1d') is not None,
        },
    }


def _nvidia_smi(index):
    fields = ('name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,'
              'power.draw,power.limit,temperature.gpu,persistence_mode,pstate')
    try:
        out = subprocess.run(['nvidia-smi', f'--id={index}', f'--query-gpu={fields}',
                              '--format=csv,noheader,nounits'],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {'error': f'nvidia-smi not usable: {exc}'}
    values = [v.strip() for v in out.stdout.strip().split(',')]
    names = fields.split(',')
    if out.returncode != 0 or len(values) != len(names):
        return {'error': (out.stderr or out.stdout).strip()[:300]}
    return dict(zip(names, values))


def device_info(device):
    """Describe the device the runtime runs on (GPU name, driver and clocks on CUDA)."""
    device = torch.device(device)
    if device.type != 'cuda':
        return {'type': device.type, 'name': _cpu_model()}
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return {
        'type': 'cuda',
        'name': props.name,
        'capability': f'{props.major}.{props.minor}',
        'memory_bytes': props.total_memory,
        'cuda_runtime': torch.version.cuda,
        'nvidia_smi': _nvidia_smi(index),
    }


def model_info(rt):
    """Describe the model and its state arena."""
    stats = rt.stats()
    model = rt.adapter.model
    config = rt.adapter.config
    keys = ('hidden_size', 'intermediate_size', 'num_hidden_layers', 'num_attention_heads',
            'num_key_value_heads', 'head_dim', 'vocab_size', 'layer_types')
    return {
        'id': stats.model,
        'family': stats.family,
        'dtype': stats.dtype,
        'parameters': sum(p.numel() for p in model.parameters()),
        'state_arena_bytes': rt.state_nbytes,
        'max_seq_len': rt.config.max_seq_len,
        'components': rt.components,
        'cuda_graph': stats.cuda_graph,
        'cuda_graph_note': stats.cuda_graph_note,
        'decode_fastpath_note': stats.decode_fastpath_note,
        'kernels': list(stats.kernels),
        'config': {k: getattr(config, k) for k in keys if hasattr(config, k)},
    }
