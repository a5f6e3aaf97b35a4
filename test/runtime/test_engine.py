"""Guards around CUDA graphs a CPU can check: the torch release, the replay-vs-eager check."""

from flashrt_ros.runtime.engine import graph_refusal, replay_mismatch
import pytest
from runtime_harness import PROMPT


@pytest.mark.parametrize('version', ['2.12.0', '2.13.0+cpu', '2.13.0+cu130', '3.0.1'])
def test_graph_capture_is_tried_from_torch_2_12(version):
    assert graph_refusal(version) is None


@pytest.mark.parametrize('version', ['2.11.0', '2.4.1+cu121', '2.5.0a0+872d972e41.nv24.08'])
def test_older_torch_runs_eager_and_says_why(version):
    note = graph_refusal(version)
    assert note.startswith('disabled:') and version in note and 'torch>=2.12' in note


def test_a_replay_that_differs_from_the_eager_step_is_named(make_runtime):
    rt = make_runtime()
    rt.prefill(PROMPT)
    views, step = rt.arena.views, rt.engine._step
    assert replay_mismatch(step, step, views) is None  # the same step both ways

    def wrong():  # a graph that froze a stale branch: one state tensor off
        step()
        views['logits'].add_(0.5)

    assert replay_mismatch(wrong, step, views) == 'logits differs by up to 0.5'

    def wrong_tokens():
        step()
        views['tokens'][0] += 1

    assert replay_mismatch(wrong_tokens, step, views) == 'tokens differs'
