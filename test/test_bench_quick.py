"""Smoke test of the benchmark suite: a tiny subset runs and writes a well-formed result."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAT_KEYS = {'median', 'p10', 'p90', 'n'}


def _bench(tmp_path, name, only, lengths, first_on_path=None):
    """Run the bench on the tiny model in a subprocess; return its output and its JSON."""
    env = dict(os.environ)
    # The installed package first (when env.sh is sourced), the source tree as a fallback.
    env['PYTHONPATH'] = os.pathsep.join(
        p for p in (first_on_path, env.get('PYTHONPATH'), ROOT) if p)
    cmd = [sys.executable, '-m', 'flashrt_ros.bench', '--quick', '--only', only,
           '--model', 'builtin:tiny-hybrid', '--lengths', *lengths, '--repeats', '1',
           '--out', str(tmp_path), '--name', name]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / f'{name}.json') as f:
        return proc.stdout + proc.stderr, json.load(f)


def test_bench_quick_subset_writes_schema_and_correctness(tmp_path):
    _, data = _bench(tmp_path, 'smoke', 'fig1,fig3', ['128', '256'])
    assert {'machine', 'device', 'model', 'plan', 'figures'} <= set(data)
    assert data['machine']['torch'] and data['machine']['transformers']
    assert data['device']['type'] == 'cpu'
    assert data['model']['id'] == 'builtin:tiny-hybrid' and data['model']['parameters'] > 0
    assert list(data['figures']) == ['fig1', 'fig3']

    fig1 = data['figures']['fig1']
    assert {r['tier'] for r in fig1['rows']} == {'device', 'host', 'disk'}
    assert {r['position'] for r in fig1['rows']} == {64, 128, 256}
    for row in fig1['rows']:
        assert row['bytes'] > 0
        for key in ('snapshot_ms', 'restore_ms', 'raw_snapshot_ms', 'raw_restore_ms'):
            assert set(row[key]) == STAT_KEYS and row[key]['n'] >= 1
        assert row['restore_vs_raw'] is not None and row['snapshot_vs_raw'] is not None
        # The device tier also times the restore's own copy, to split off what surrounds it.
        has_copy = row['tier'] == 'device'
        assert ('restore_copy_ms' in row) == has_copy and ('restore_rest_us' in row) == has_copy
        if has_copy:
            assert set(row['restore_copy_ms']) == STAT_KEYS and row['restore_copy_vs_raw'] > 0
            assert isinstance(row['restore_rest_us'], float)

    fig3 = data['figures']['fig3']
    assert fig3['state_advanced_by_decode'] is True
    for tier in ('device', 'host', 'disk'):
        assert fig3['tiers'][tier]['byte_exact'] is True, tier
        assert fig3['tiers'][tier]['token_identical'] is True, tier
    assert fig3['kv_only']['diverged'] is True
    assert isinstance(fig3['kv_only']['first_diverging_step'], int)
    assert fig3['passed'] is True

    assert (tmp_path / 'smoke-fig1.png').is_file() and (tmp_path / 'smoke-fig3.png').is_file()
    assert (tmp_path / 'smoke.md').is_file()


BLOCKER = """
import sys


class Blocked:  # rclpy and matplotlib unimportable, as on a GPU image without ROS or plots
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('rclpy', 'matplotlib'):
            raise ImportError(f'{name} is blocked by this test')
        return None


sys.meta_path.insert(0, Blocked())
"""


def test_bench_runs_fig1_without_rclpy_and_matplotlib(tmp_path):
    site = tmp_path / 'site'
    site.mkdir()
    (site / 'sitecustomize.py').write_text(BLOCKER)
    env = dict(os.environ, PYTHONPATH=str(site))
    check = subprocess.run([sys.executable, '-c', 'import rclpy'], env=env,
                           capture_output=True, text=True, timeout=60)
    assert check.returncode != 0 and 'blocked by this test' in check.stderr
    output, data = _bench(tmp_path, 'noros', 'fig1', ['128'], first_on_path=str(site))
    assert list(data['figures']) == ['fig1'] and data['figures']['fig1']['rows']
    assert data['model']['kernels'] and all(
        k.endswith(':reference') for k in data['model']['kernels'])  # a CPU runtime's
    assert data['plots'] == {} and 'no plots' in output


def test_arch_check_knows_which_builds_run_on_a_device():
    from flashrt_ros.bench.gpu_env import arch_supported

    cu128 = ['sm_75', 'sm_80', 'sm_86', 'sm_90', 'sm_100', 'sm_120', 'compute_120']
    assert arch_supported((8, 9), cu128)  # an sm_86 cubin runs on 8.9
    assert arch_supported((12, 1), cu128)
    assert not arch_supported((11, 0), ['sm_80', 'sm_90', 'sm_100', 'sm_120'])  # Thor
    assert arch_supported((11, 0), ['sm_90', 'sm_100', 'sm_110', 'sm_120'])
    assert arch_supported((11, 0), ['sm_90', 'compute_100'])  # PTX: the driver compiles it
    assert not arch_supported((9, 0), ['sm_100a', 'compute_100'])  # PTX never runs backward
    assert not arch_supported((10, 3), ['sm_100a']) and arch_supported((10, 0), ['sm_100a'])
    assert not arch_supported((8, 0), [])


def test_bench_interrupts_in_policy_and_speech_mode_over_ros(tmp_path):
    """fig5modes --quick: every RESTORE is answered; each one cuts the long audio chunk."""
    if not all(importlib.util.find_spec(m) for m in ('rclpy', 'flashrt_ros.msg')):
        pytest.skip('rclpy or the generated interfaces are not importable (make setup)')
    _, data = _bench(tmp_path, 'modes', 'fig5modes', ['128'])
    fig = data['figures']['fig5modes']
    assert 'error' not in fig, fig.get('error')
    assert fig['exit_codes'] == {'policy': 0, 'speech': 0, 'prompt': 0}
    rows = {r['mode']: r for r in fig['rows']}
    assert set(rows) == {'policy', 'speech', 'prompt'}
    for mode, row in rows.items():
        assert row['missed'] == 0, mode
        assert row['received_to_restored']['n'] == row['rounds'], mode
        assert row['step_ms']['n'] >= 1 and row['step_ms']['median'] > 0, mode
        stages = [row[s]['median'] for s in ('callback', 'checked', 'armed', 'step_left',
                                             'copied', 'restored')]
        assert stages == sorted(stages), (mode, stages)
    assert rows['speech']['cut_or_abandoned'] == rows['speech']['rounds']  # each cut short
