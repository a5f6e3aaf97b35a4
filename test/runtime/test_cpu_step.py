"""The compiled CPU step: transformers' tokens, exact multi-token calls, and its fallbacks."""

import os
from pathlib import Path
import shutil
import subprocess
import threading

from flashrt_ros.runtime import preemption
from flashrt_ros.runtime.models import cpu_step
from flashrt_ros.runtime.models.hf import DEFAULT_DIR, save_builtin
from flashrt_ros.runtime.preemption import StepAborted
import pytest
from runtime_harness import decode_steps, greedy, OTHER_PROMPT, PROMPT
import test_speculation as speculation
import torch

FAST = ['builtin:tiny-hybrid', 'builtin:tiny-qwen3-5']


def _odd_checkpoint(directory, head_dim, key_dim, value_dim, hidden):
    """Write a Qwen3-Next checkpoint whose sizes are not multiples of a vector (8 or 16 floats)."""
    from flashrt_ros.runtime.models.tokenizer import ByteTokenizer
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=264, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=4,
        head_dim=head_dim, num_attention_heads=4, num_key_value_heads=2,
        layer_types=['linear_attention'] * 3 + ['full_attention'], mlp_only_layers=[0, 1, 2, 3],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=key_dim,
        linear_value_head_dim=value_dim, linear_conv_kernel_dim=4, tie_word_embeddings=True,
        rope_parameters={'rope_type': 'default', 'rope_theta': 10000.0,
                         'partial_rotary_factor': 0.5},
        initializer_range=0.2)  # large enough that the context changes the tokens
    torch.manual_seed(0)
    Qwen3NextForCausalLM(config).float().save_pretrained(str(directory))
    ByteTokenizer().save(directory)
    return str(directory)


@pytest.mark.parametrize('dims', [(12, 12, 12, 92), (20, 20, 28, 100), (36, 24, 40, 76)])
def test_sizes_off_the_vector_width_take_the_scalar_tails(make_runtime, tmp_path, dims):
    # Head dims that are not multiples of 8 (12, 20, 36) attend through the scalar path and
    # end their dot products in the scalar tail; hidden sizes that are not multiples of 8
    # end every projection from the residual stream (and the MLP's down projection) there.
    model = _odd_checkpoint(tmp_path / 'odd', *dims)
    fast = make_runtime(model, max_seq_len=512)
    exact = make_runtime(model, max_seq_len=512, cpu_step=False)
    assert fast.adapter.cpu_step is not None, fast.stats().cpu_step_note
    for rt in (fast, exact):
        rt.prefill(PROMPT * 6, raw=True)  # attention over more than one span of rows
    logits_fast, _ = decode_steps(fast, 12)
    logits_exact, _ = decode_steps(exact, 12)
    for i, (a, b) in enumerate(zip(logits_fast, logits_exact)):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), f'step {i}: {(a - b).abs().max()}'
    assert greedy(fast, 12) == greedy(exact, 12)


@pytest.mark.parametrize('model', FAST + ['default'])
def test_steps_agree_with_the_exact_path_to_float32_rounding(make_runtime, model):
    fast = make_runtime(model, max_seq_len=600)
    exact = make_runtime(model, max_seq_len=600, cpu_step=False)
    assert fast.adapter.cpu_step is not None, fast.stats().cpu_step_note
    assert exact.adapter.cpu_step is None and exact.stats().cpu_step_note.startswith('off')
    for rt in (fast, exact):
        rt.prefill(PROMPT * 8, raw=True)  # past one attention window of the exact path
    calls = []
    step = fast.adapter.cpu_step.step
    fast.adapter.cpu_step.step = lambda *a: calls.append(1) or step(*a)
    logits_fast, _ = decode_steps(fast, 16)
    logits_exact, _ = decode_steps(exact, 16)
    assert len(calls) == 16
    for i, (a, b) in enumerate(zip(logits_fast, logits_exact)):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), f'step {i}: {(a - b).abs().max()}'
        assert int(a.argmax()) == int(b.argmax())
    for name, view in fast.arena.views.items():
        other = exact.arena.views[name]
        if view.dtype.is_floating_point:
            assert torch.allclose(view, other, rtol=1e-4, atol=1e-4), name
        else:
            assert torch.equal(view, other), name


@pytest.mark.parametrize('model', FAST)
def test_a_multi_token_call_equals_single_steps_bit_for_bit(make_runtime, model):
    rt = make_runtime(model, max_seq_len=256)
    cs = rt.adapter.cpu_step
    rt.prefill(PROMPT, raw=True)
    tokens, pos = [17, 99, 3, 250], rt.position
    start = rt.arena.storage.clone()
    singles, single_states = [], []
    for i, t in enumerate(tokens):
        logits, hidden = cs.forward([t], pos + i)
        singles.append((logits.clone(), hidden.clone()))
        single_states.append(rt.arena.storage.clone())
    for used in range(1, len(tokens) + 1):
        rt.arena.storage.copy_(start)
        logits, hidden = cs.forward(tokens, pos, save=True)
        for i, (l1, h1) in enumerate(singles):
            assert torch.equal(logits[i:i + 1], l1) and torch.equal(hidden[i:i + 1], h1), i
        cs.keep_prefix(used, len(tokens))
        # the rows of the dropped tokens are the caller's to zero (the speculator's job)
        rows = rt.arena.storage[rt.arena.prefix_nbytes(pos + used):
                                rt.arena.prefix_nbytes(pos + len(tokens))]
        rows.zero_()
        expected = single_states[used - 1].clone()
        expected[rt.arena.prefix_nbytes(pos + used):
                 rt.arena.prefix_nbytes(pos + len(tokens))].zero_()
        assert torch.equal(rt.arena.storage, expected), used


@pytest.mark.parametrize('model', FAST + ['default'])
def test_the_thread_count_changes_no_bit(make_runtime, model):
    """Rows and attention spans split over threads, each formed alike: one thread or four."""
    rt = make_runtime(model, max_seq_len=4400)
    cs = rt.adapter.cpu_step
    # Long enough that attention splits its spans over threads (1 MiB of keys: 4,096 rows
    # of 2 heads of 32); a partial last span.
    rt.prefill([(7 * i) % 250 + 3 for i in range(4101)])
    pos, start = rt.position, rt.arena.storage.clone()
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 4):
            torch.set_num_threads(n)
            rt.arena.storage.copy_(start)
            logits = [cs.forward(tokens, pos + i, save=True)[0].clone()
                      for i, tokens in enumerate([[17], [99, 3, 250, 5]])]
            runs.append((logits, rt.arena.storage.clone()))
    finally:
        torch.set_num_threads(threads)
    (one, state_one), (four, state_four) = runs
    assert all(torch.equal(a, b) for a, b in zip(one, four))
    assert torch.equal(state_one, state_four)


def test_a_watched_model_takes_the_exact_path(make_runtime):
    rt = make_runtime('builtin:tiny-hybrid')
    rt.prefill(PROMPT, raw=True)
    rt.snapshot('a')
    plain = greedy(rt, 6)
    seen = []
    mlp = rt.adapter.model.model.layers[1].mlp  # a module every step of the exact path calls
    handle = mlp.register_forward_hook(lambda m, a, out: seen.append(1))
    try:
        rt.restore('a')
        assert greedy(rt, 6) == plain
    finally:
        handle.remove()
    assert len(seen) == 5  # each of the 5 steps (the 6th token stays pending) ran exact
    assert not rt.adapter.cpu_step.observed()


def test_a_preemption_arriving_mid_step_is_met_between_layers(make_runtime):
    rt = make_runtime('builtin:tiny-hybrid')
    rt.prefill(PROMPT, raw=True)
    cs, layers = rt.adapter.cpu_step, list(rt.adapter.model.model.layers)
    met = []

    def hook(module, args):
        met.append(module)
        if len(met) == 2:
            raise StepAborted()

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    preemption.arm(1)  # what an armed Preemption does: the C loop polls it between layers
    try:
        with pytest.raises(StepAborted):
            cs.forward([5], rt.position)
    finally:
        preemption.arm(-1)
        handle.remove()
    assert met == layers[:2]  # checked before each layer, as a module call would be
    assert preemption.ARMED.value == 0


def test_a_preemption_armed_in_the_last_layer_is_met_before_the_head(make_runtime):
    """After the layers the step polls once more (meet()): the head does not run."""
    rt = make_runtime('builtin:tiny-hybrid')
    rt.prefill(PROMPT, raw=True)
    cs = rt.adapter.cpu_step
    logits, _ = cs.forward([5], rt.position)
    before = logits.clone()
    met = []

    def check(module, args):  # a preemption's check, armed after every layer's poll
        met.append(module)
        raise StepAborted()

    preemption.arm(1, check)  # no global hook: the layer polls find nothing to meet
    try:
        with pytest.raises(StepAborted):
            cs.forward([6], rt.position + 1)
    finally:
        preemption.arm(-1, check)
    assert met == [None]  # met once, by meet() after the last layer
    assert logits.equal(before)  # the head did not write this step's logits
    assert preemption.ARMED.value == 0


def test_a_real_preemption_ends_a_compiled_turn(make_runtime):
    rt = make_runtime('builtin:tiny-hybrid', max_seq_len=2048)
    rt.prefill(PROMPT, raw=True)
    rt.snapshot('a')
    digest = rt.state_digest()
    gen = rt.generate(max_new_tokens=1500, stop=(), eos=False)
    next(gen)
    done = threading.Event()

    def drain():
        for _ in gen:
            pass
        done.set()

    thread = threading.Thread(target=drain)
    thread.start()
    info = rt.restore('a', preempt=True)
    thread.join(30.0)
    assert done.is_set() and gen.result.stop_reason == 'interrupted'
    assert info.name == 'a' and rt.state_digest() == digest
    assert preemption.ARMED.value == 0 and not rt.generating


def test_without_a_compiler_the_runtime_says_why_and_runs_exact(make_runtime, monkeypatch,
                                                                tmp_path):
    monkeypatch.setenv('CC', str(tmp_path / 'no-such-cc'))
    monkeypatch.setenv(cpu_step.CACHE_ENV, str(tmp_path / 'kernels'))
    monkeypatch.setattr(cpu_step, '_library', None)
    monkeypatch.setattr(cpu_step, '_library_error', None)
    rt = make_runtime('builtin:tiny-hybrid')
    note = rt.stats().cpu_step_note
    assert rt.adapter.cpu_step is None and 'no C compiler' in note and 'CC' in note
    exact = make_runtime('builtin:tiny-hybrid', cpu_step=False)
    assert greedy(rt, 8, prompt=PROMPT) == greedy(exact, 8, prompt=PROMPT)


def test_a_compile_error_is_reported(monkeypatch, tmp_path):
    bad = tmp_path / 'bad.c'
    bad.write_text('this is not C\n')
    monkeypatch.setattr(cpu_step, 'SOURCE', bad)
    monkeypatch.setenv(cpu_step.CACHE_ENV, str(tmp_path / 'kernels'))
    with pytest.raises(cpu_step.Unavailable, match='does not compile'):
        cpu_step._compile()
    assert not list((tmp_path / 'kernels').glob('*.so'))  # nothing half-written is cached


def test_models_it_does_not_run_say_why(make_runtime):
    for model, words in [('builtin:tiny-lfm2', 'no decode fast path'),
                         ('builtin:tiny-mamba2', 'no decode fast path')]:
        rt = make_runtime(model)
        assert rt.adapter.cpu_step is None and words in rt.stats().cpu_step_note
    half = make_runtime('builtin:tiny-hybrid', dtype='float16')
    assert 'float32' in half.stats().cpu_step_note


def test_restore_and_rollback_continue_exactly(make_runtime):
    rt = make_runtime('builtin:tiny-qwen3-5')
    rt.prefill(PROMPT, raw=True)
    rt.snapshot('a')
    reference = greedy(rt, 12)
    digest = rt.state_digest()
    rt.prefill(OTHER_PROMPT, raw=True)
    rt.restore('a')
    assert greedy(rt, 12) == reference and rt.state_digest() == digest
    rt.restore('a')
    greedy(rt, 5)
    rt.rollback(1)
    assert greedy(rt, 12) == reference and rt.state_digest() == digest


# ---- bfloat16 -------------------------------------------------------------------------
# A bf16 model's step is float32 arithmetic over its weights' exact float32 values, with
# the conv window and KV rows rounded to bf16 as the arena stores them. transformers' bf16
# forward rounds every activation (the residual stream too) to bf16, so the two agree to
# bf16 rounding over the layers: within BF16_LOGITS of the largest logit, with the same
# argmax. Whole greedy turns are compared on the trained default only: a random model's
# near-ties are closer than bf16 rounding, and a turn there may flip a token (tiny-hybrid
# did at its 18th).
BF16_LOGITS = 0.15


def _bf16_checkpoint(model, directory):
    """Write `model` (a built-in or 'default') as a bf16 checkpoint folder; return its path."""
    if model != 'default':
        return str(save_builtin(model, directory, torch.bfloat16))
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(DEFAULT_DIR), dtype=torch.bfloat16).save_pretrained(
        str(directory))
    for f in DEFAULT_DIR.iterdir():
        if not (directory / f.name).exists():
            shutil.copy(f, directory / f.name)
    return str(directory)


def _bf16(make_runtime):
    return lambda model='builtin:tiny-hybrid', **kw: make_runtime(model, **{
        'dtype': 'bfloat16', **kw})


@pytest.mark.parametrize('k', [7, 40, 1037])
def test_bf16_products_are_the_float32_products_of_the_widened_weights(k):
    # The same products summed in another order (a bf16 pair widens into an even and an odd
    # vector): float32 rounding apart, and k = 7 (the scalar tail alone) bit for bit.
    lib = cpu_step.library()
    g = torch.Generator().manual_seed(k)
    rows, T = 37, 4
    w = torch.randn(rows, k, generator=g).bfloat16()
    x, ones = torch.randn(T, k, generator=g), torch.ones(k)
    out = {}
    for weights, bf in ((w, 1), (w.float(), 0)):
        y, normed = torch.empty(T, rows), torch.empty(T, k)
        lib.fr_head(x.data_ptr(), ones.data_ptr(), 1e-6, weights.data_ptr(), y.data_ptr(),
                    normed.data_ptr(), k, rows, T, 1, bf)
        out[bf] = y
    assert torch.allclose(out[1], out[0], rtol=1e-5, atol=1e-5)
    assert k != 7 or torch.equal(out[1], out[0])


@pytest.mark.parametrize('model,turns', [('builtin:tiny-hybrid', False), ('default', True)])
def test_a_bf16_checkpoint_steps_compiled_like_transformers_bf16(make_runtime, tmp_path, model,
                                                                 turns):
    path = _bf16_checkpoint(model, tmp_path / 'bf16')
    fast = make_runtime(path, dtype='auto', max_seq_len=600)
    exact = make_runtime(path, dtype='auto', max_seq_len=600, cpu_step=False)
    assert fast.adapter.dtype == torch.bfloat16
    assert fast.adapter.cpu_step is not None, fast.stats().cpu_step_note
    for rt in (fast, exact):
        rt.prefill(PROMPT * 8, raw=True)
        if model == 'default':
            # The default answers with a plan here; after the raw prompt alone it picks a
            # colour its training drew uniformly, where bf16 logits can tie exactly.
            rt.prefill('<|im_start|>user\nput the red cup in the bin<|im_end|>\n'
                       '<|im_start|>assistant\n', raw=True)
    logits_fast, _ = decode_steps(fast, 16)
    logits_exact, _ = decode_steps(exact, 16)
    for i, (a, b) in enumerate(zip(logits_fast, logits_exact)):
        assert (a - b).abs().max() <= BF16_LOGITS * b.abs().max(), i
        assert int(a.argmax()) == int(b.argmax()), i
    for prompt in (PROMPT, OTHER_PROMPT) if turns else ():
        fast.reset()
        exact.reset()
        assert greedy(fast, 20, prompt=prompt) == greedy(exact, 20, prompt=prompt)


@pytest.mark.parametrize('model', FAST)
def test_bf16_multi_token_calls_equal_single_steps_bit_for_bit(make_runtime, model):
    test_a_multi_token_call_equals_single_steps_bit_for_bit(_bf16(make_runtime), model)


def test_bf16_thread_count_changes_no_bit(make_runtime):
    test_the_thread_count_changes_no_bit(_bf16(make_runtime), 'builtin:tiny-qwen3-5')


def test_bf16_restore_and_rollback_continue_exactly(make_runtime):
    test_restore_and_rollback_continue_exactly(_bf16(make_runtime))


@pytest.mark.parametrize('model', speculation.MODELS)
def test_bf16_compiled_verify_is_plain_greedy_at_every_commit(make_runtime, model):
    speculation.test_compiled_batched_rounds_are_plain_greedy_at_every_commit(
        _bf16(make_runtime), model, 'mixed')


# ---- aarch64 (Jetson Thor's CPU): cross-compiled, run under qemu-user ------------------
CHECK = Path(__file__).with_name('cpu_step_check.c')
CROSS, QEMU, SYSROOT = 'aarch64-linux-gnu-gcc', 'qemu-aarch64', Path('/usr/aarch64-linux-gnu')
ARM_FLAGS = {'armv8-a': ['-march=armv8-a'],  # NEON only: any 64-bit Arm
             'armv9-a+sve2+bf16': ['-march=armv9-a+sve2+bf16']}  # Neoverse V2/V3's features


def _check_outputs(command, dtype):
    out = subprocess.run(command + [dtype], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr  # also: a 4-token call equals 4 one-token calls
    return torch.tensor([float(v) for v in out.stdout.split()])


@pytest.mark.skipif(not (shutil.which(CROSS) and shutil.which(QEMU) and SYSROOT.is_dir()),
                    reason=f'needs {CROSS} and {QEMU} (apt-get install gcc-aarch64-linux-gnu '
                           'qemu-user)')
@pytest.mark.parametrize('arch', ARM_FLAGS)
@pytest.mark.parametrize('lanes', cpu_step.LANES)
def test_the_aarch64_build_agrees_with_this_one(tmp_path, arch, lanes):
    models = str(cpu_step.SOURCE.parent)
    flags = ['-O3', '-std=gnu11', '-fopenmp', f'-DLANES={lanes}', '-I', models, str(CHECK),
             '-lm']
    native, arm = tmp_path / 'native', tmp_path / 'arm'
    subprocess.run([os.environ.get('CC') or 'cc', '-march=native', *flags, '-o', str(native)],
                   check=True, timeout=300)
    subprocess.run([CROSS, *ARM_FLAGS[arch], *flags, '-o', str(arm)], check=True, timeout=300)
    for dtype in ('f32', 'bf16'):
        here = _check_outputs([str(native)], dtype)
        there = _check_outputs([QEMU, '-cpu', 'max', '-L', str(SYSROOT), str(arm)], dtype)
        assert here.numel() == there.numel() > 0
        # float32 rounding apart: the compilers contract multiply-adds differently
        assert torch.allclose(here, there, rtol=1e-5, atol=1e-5), (here - there).abs().max()


def test_the_real_size_benchmark_model_has_qwen3_5_0_8b_shape():
    # builtin:bench-0.8b is the benchmark's real-size model: Qwen3.5-0.8B's layer sizes,
    # vocabulary and tied embeddings (752M parameters), built on the meta device here.
    import transformers
    from flashrt_ros.runtime.models.builtin import BUILTINS

    spec = BUILTINS['bench-0.8b']
    config = getattr(transformers, spec.config_class)(**spec.kwargs)
    with torch.device('meta'):
        model = getattr(transformers, spec.model_class)(config)
    assert sum(p.numel() for p in model.parameters()) == 752_393_024
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert config.layer_types.count('full_attention') == 6
