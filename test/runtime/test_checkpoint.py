"""A built-in model saved with save_pretrained loads through the local-path route unchanged."""

from flashrt_ros.runtime.models import save_builtin
from runtime_harness import greedy, PROMPT


def test_local_checkpoint_behaves_like_the_builtin(make_runtime, tmp_path):
    path = save_builtin('builtin:tiny-hybrid', tmp_path / 'ckpt')
    assert (path / 'config.json').is_file()
    builtin = make_runtime('builtin:tiny-hybrid')
    local = make_runtime(str(path))
    assert local.fingerprint == builtin.fingerprint
    assert local.tokenize(PROMPT) == builtin.tokenize(PROMPT)
    assert greedy(local, 10, prompt=PROMPT) == greedy(builtin, 10, prompt=PROMPT)
    # Same model, same layout: a capsule moves between them through the disk tier.
    builtin.snapshot('shared', tier='disk')
    expected = greedy(builtin, 6)
    local.reset()
    local.restore('shared')
    assert greedy(local, 6) == expected
