"""
Built-in model configs: random weights from a fixed seed, byte-level vocabulary.

They need no download and exist so the runtime, node and tests run anywhere. Their output
is NOT meaningful text; point `model` at a local checkpoint directory for a real model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError

VOCAB = 264  # 256 bytes + <bos>/<eos>/<pad>, padded up to a multiple of 8
SEED = 1234
# The package's trained models (train_default.py, train_policy.py): one folder each.
TRAINED_DIR = Path(__file__).resolve().parents[2] / 'models'
# transformers' default init (std 0.02) makes tiny random models nearly context-blind
# (LFM2 and Llama then repeat one token whatever the state); std 0.1 makes the next
# token depend on the whole state, which is what the exactness/ablation tests need.
INIT_STD = 0.1

_ATTN = {'num_attention_heads': 4, 'num_key_value_heads': 2, 'max_position_embeddings': 32768}
_QWEN_LINEAR = {'linear_num_key_heads': 2, 'linear_num_value_heads': 4, 'linear_key_head_dim': 32,
                'linear_value_head_dim': 32, 'linear_conv_kernel_dim': 4}
_LIN, _FULL = 'linear_attention', 'full_attention'


@dataclass(frozen=True)
class BuiltinSpec:
    config_class: str  # transformers config class name
    model_class: str  # transformers causal-LM class name
    kwargs: dict[str, Any]
    about: str


BUILTINS: dict[str, BuiltinSpec] = {
    # The embedded default: Qwen3-Next style, 3 gated-delta-net layers + 1 full-attention layer.
    'tiny-hybrid': BuiltinSpec('Qwen3NextConfig', 'Qwen3NextForCausalLM', {
        'hidden_size': 128, 'intermediate_size': 256, 'num_hidden_layers': 4, 'head_dim': 32,
        'layer_types': [_LIN, _LIN, _LIN, _FULL], 'mlp_only_layers': [0, 1, 2, 3],
        **_ATTN, **_QWEN_LINEAR}, 'Qwen3-Next-style hybrid (gated DeltaNet + attention)'),
    'tiny-qwen3-5': BuiltinSpec('Qwen3_5TextConfig', 'Qwen3_5ForCausalLM', {
        'hidden_size': 128, 'intermediate_size': 256, 'num_hidden_layers': 4, 'head_dim': 32,
        'layer_types': [_LIN, _LIN, _LIN, _FULL], **_ATTN, **_QWEN_LINEAR},
        'Qwen3.5 text hybrid'),
    'tiny-lfm2': BuiltinSpec('Lfm2Config', 'Lfm2ForCausalLM', {
        'hidden_size': 128, 'intermediate_size': 256, 'num_hidden_layers': 4,
        'full_attn_idxs': [1, 3], 'conv_L_cache': 3, **_ATTN},
        'LFM2: short-conv + attention hybrid'),
    'tiny-mamba2': BuiltinSpec('Mamba2Config', 'Mamba2ForCausalLM', {
        'hidden_size': 128, 'num_hidden_layers': 3, 'num_heads': 8, 'head_dim': 32, 'expand': 2,
        'state_size': 16, 'n_groups': 1, 'conv_kernel': 4, 'chunk_size': 32},
        'Mamba2: pure SSM (no KV at all)'),
    'tiny-llama': BuiltinSpec('LlamaConfig', 'LlamaForCausalLM', {
        'hidden_size': 128, 'intermediate_size': 256, 'num_hidden_layers': 3, **_ATTN},
        'Llama: attention only'),
    # ~27M params; the benchmark model (6 linear-attention + 2 full-attention layers).
    'bench-hybrid': BuiltinSpec('Qwen3NextConfig', 'Qwen3NextForCausalLM', {
        'hidden_size': 512, 'intermediate_size': 1536, 'num_hidden_layers': 8, 'head_dim': 64,
        'num_attention_heads': 8, 'num_key_value_heads': 2, 'max_position_embeddings': 65536,
        'layer_types': [_LIN, _LIN, _LIN, _FULL] * 2, 'mlp_only_layers': list(range(8)),
        'linear_num_key_heads': 4, 'linear_num_value_heads': 8, 'linear_key_head_dim': 64,
        'linear_value_head_dim': 64, 'linear_conv_kernel_dim': 4},
        'Qwen3-Next-style hybrid for benchmarks'),
    # Qwen3.5-0.8B's shape (752M parameters, its vocabulary size and tied embeddings): what
    # the compiled CPU step and llama.cpp do with a real-size model; 1.5 GB in bf16.
    'bench-0.8b': BuiltinSpec('Qwen3NextConfig', 'Qwen3NextForCausalLM', {
        'vocab_size': 248320, 'tie_word_embeddings': True, 'hidden_size': 1024,
        'intermediate_size': 3584, 'num_hidden_layers': 24, 'head_dim': 256,
        'num_attention_heads': 8, 'num_key_value_heads': 2, 'max_position_embeddings': 65536,
        'layer_types': [_LIN, _LIN, _LIN, _FULL] * 6, 'mlp_only_layers': list(range(24)),
        'linear_num_key_heads': 16, 'linear_num_value_heads': 16, 'linear_key_head_dim': 128,
        'linear_value_head_dim': 128, 'linear_conv_kernel_dim': 4},
        'Qwen3.5-0.8B-shaped hybrid for benchmarks (random weights)'),
    # A small SSM with a large state (about 30 MB in float32): the disk-write load of the
    # benchmarks' interrupt measurement, cheap to step.
    'bench-big-state': BuiltinSpec('Mamba2Config', 'Mamba2ForCausalLM', {
        'hidden_size': 128, 'num_hidden_layers': 15, 'num_heads': 4, 'head_dim': 64,
        'expand': 2, 'state_size': 2048, 'n_groups': 1, 'conv_kernel': 4, 'chunk_size': 32},
        'Mamba2 with a ~30 MB state'),
}


# Robot policies (models/policy.py): a policy.json in dict form. The backbone is a
# Qwen3-Next-style hybrid fed observation embeddings: conv + recurrent + attention KV state.
POLICY_BUILTINS: dict[str, dict[str, Any]] = {
    # A 2-link arm: joint positions and velocities in, 8-step chunks of joint torques out.
    'tiny-policy': {
        'obs_dim': 4, 'action_dim': 2, 'horizon': 8,
        'joint_names': ['shoulder', 'elbow'],
        'observation_names': ['shoulder/position', 'elbow/position',
                              'shoulder/velocity', 'elbow/velocity'],
        'action_scale': 2.0, 'action_noise_std': 0.05,
        'backbone': {
            'model_type': 'qwen3_next', 'vocab_size': 1, 'initializer_range': INIT_STD,
            'hidden_size': 64, 'intermediate_size': 128, 'num_hidden_layers': 4,
            'head_dim': 16, 'num_attention_heads': 4, 'num_key_value_heads': 2,
            'max_position_embeddings': 65536, 'layer_types': [_LIN, _LIN, _LIN, _FULL],
            'mlp_only_layers': [0, 1, 2, 3], 'linear_num_key_heads': 2,
            'linear_num_value_heads': 4, 'linear_key_head_dim': 16,
            'linear_value_head_dim': 16, 'linear_conv_kernel_dim': 4},
    },
}


# LeRobot-format policies (models/lerobot.py): written once from their seed into the cache
# folder, then loaded from there by the code that loads a user's LeRobot checkpoint.
LEROBOT_BUILTINS: dict[str, dict[str, Any]] = {
    # The demo's 2-link arm (reach_task): joint angles and a 96x128 top camera in, joint
    # targets out; 20-step chunks blended by temporal ensembling (its buffer is state, so
    # capsules hold it). Trained by train_policy.py: its folder's trained.safetensors is
    # laid over the seeded weights and its training.json gives the normalizer stats.
    'act-arm': {
        'trained': 'act-arm',
        'config': {
            'input_features': {
                'observation.state': {'type': 'STATE', 'shape': [2]},
                'observation.images.top': {'type': 'VISUAL', 'shape': [3, 96, 128]}},
            'output_features': {'action': {'type': 'ACTION', 'shape': [2]}},
            'chunk_size': 20, 'n_action_steps': 1, 'temporal_ensemble_coeff': 0.01,
            'pretrained_backbone_weights': None, 'dim_model': 64, 'n_heads': 4,
            'dim_feedforward': 256, 'n_encoder_layers': 2, 'n_decoder_layers': 1,
            'latent_dim': 8, 'n_vae_encoder_layers': 1, 'use_vae': False},
    },
}


# Streaming speech-to-text (models/speech.py): a Kyutai STT decoder over a Mimi encoder at
# 24 kHz, 80 ms frames. Windows are small (3 frames of codec context, 8 decoder steps) so
# that tests run past the point where the sliding-window caches wrap around.
SPEECH_BUILTINS: dict[str, dict[str, Any]] = {
    'tiny-stt': {
        'text_delay_s': 0.24,
        'codec': {
            'model_type': 'mimi', 'hidden_size': 32, 'num_filters': 4, 'num_residual_layers': 1,
            'upsampling_ratios': [8, 6, 5, 4], 'codebook_size': 16, 'codebook_dim': 16,
            'num_quantizers': 4, 'num_semantic_quantizers': 1, 'num_hidden_layers': 2,
            'num_attention_heads': 2, 'num_key_value_heads': 2, 'head_dim': 16,
            'intermediate_size': 64, 'sliding_window': 6,
            'vector_quantization_hidden_dimension': 16, 'upsample_groups': 32},
        'decoder': {
            'vocab_size': VOCAB, 'hidden_size': 64, 'num_hidden_layers': 2,
            'num_attention_heads': 4, 'num_key_value_heads': 4, 'ffn_dim': 128,
            'num_codebooks': 4, 'codebook_vocab_size': 17, 'audio_bos_token_id': 16,
            'audio_pad_token_id': VOCAB + 4 * 17, 'sliding_window': 8,
            'max_position_embeddings': 65536, 'pad_token_id': 258, 'bos_token_id': 256,
            'eos_token_id': None, 'initializer_range': INIT_STD},
    },
}


def build_builtin(name: str, dtype: torch.dtype):
    """Instantiate built-in model `name` with deterministic random weights."""
    import transformers

    if name not in BUILTINS:
        raise ConfigError(
            f'unknown built-in model {name!r}; choose one of '
            + ', '.join(f'builtin:{n}' for n in [*BUILTINS, *POLICY_BUILTINS, *SPEECH_BUILTINS])
        )
    spec = BUILTINS[name]
    config = getattr(transformers, spec.config_class)(**{
        'vocab_size': VOCAB, 'bos_token_id': 256, 'eos_token_id': 257, 'pad_token_id': 258,
        'initializer_range': INIT_STD, **spec.kwargs})
    # Weights come from a private RNG so building a model never disturbs the caller's seed.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = getattr(transformers, spec.model_class)(config)
    return model.to(dtype).eval()
