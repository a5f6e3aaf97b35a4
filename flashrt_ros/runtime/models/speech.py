"""
Streaming speech-to-text (Kyutai STT): Mimi's streaming encoder feeding a text decoder.

Every 80 ms frame of 24 kHz audio goes through the Mimi encoder (causal SEANet convs, a
sliding-window transformer, a replicate-padded downsampling conv, the residual quantizer)
to one code per codebook; the decoder then takes the previous text token plus those codes
and yields the next text token. All the state between frames lives in the arena:

  * ``pad{i}``          each causal conv's left context [1, C, P] (transformers reassigns
                        these per call, and the first layer's is a view of the caller's
                        chunk, so ArenaPaddingCache copies into arena views instead);
  * ``codec.L{i}.*``    the encoder transformer's sliding-window KV (CacheBinding);
  * ``dec.L{i}.*``      the decoder's KV (CacheBinding; sliding-window for Kyutai STT);
  * ``audio.partial``   the samples of a frame not yet complete;
  * ``audio.history``   the resampler's last input samples (audio sent at another rate);
  * ``tokens``          the text tokens fed, the last decoder window of them (the engine's
                        history; the decoder itself reads only the pending one).

The sliding windows keep their rows in a ring (CacheBinding's ring_windows), so a frame
writes a few rows of each (window_writes), a rollback boundary keeps just those, and with
only sliding-window layers (Kyutai STT's and Mimi's) an utterance has no length bound: the
positions count on, the state stays the same size.

Non-tensor state in the meta: each conv's first-call flag (a replicate-padded conv pads
its first call with its first sample, later calls with the cached context), the samples in
the partial frame, the resampler's rate and counters, and the bindings' sliding-window
counters.

Loading: ``builtin:tiny-stt`` (seeded random weights; its codebooks are seeded by one
calibration pass, since transformers initialises Mimi's codebooks to zero and a zero
codebook gives one code for every frame) or a local checkpoint directory (config.json with
model_type ``kyutai_speech_to_text``, safetensors, a tokenizer). The processor's settings come
from whichever file the checkpoint has: ``processor_config.json`` (its ``feature_extractor``,
as transformers 5 saves it) or ``preprocessor_config.json``: ``audio_delay_seconds`` is the
text delay that flush() reads out, ``audio_silence_prefix_seconds`` the silence fed before
every utterance (``silence_left`` in the meta counts what is still to feed), and
``sampling_rate`` must be the codec's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from .base import StateAdapter
from .binding import CacheBinding, module_fingerprint
from .builtin import SEED, SPEECH_BUILTINS
from .hf import checkpoint_tokenizer
from .resample import StreamingResampler
from .tokenizer import ByteTokenizer
from ..errors import ConfigError
from ..state.arena import StateSpec

MODEL_TYPE = 'kyutai_speech_to_text'
CALIBRATION_FRAMES = 64  # frames of seeded audio the built-in's codebooks are drawn from
DEFAULT_DELAY_S = 0.5  # text delay of a checkpoint that does not state one
PROCESSOR_FILES = ('processor_config.json', 'preprocessor_config.json')  # first found wins


@dataclass(frozen=True)
class SpeechSpec:
    """What a speech model consumes; the node checks audio messages with it."""

    sample_rate: int
    frame_size: int  # samples per frame (the decoder's step)
    text_delay_s: float  # how far the text lags the audio (flush feeds this much silence)
    pad_token_id: int  # the text token of a frame with no new text
    silence_prefix_s: float = 0.0  # silence fed before each utterance (the processor's)
    # Where the delay, prefix and rate were read from (said in /diagnostics).
    settings: str = dataclasses.field(default='built-in', compare=False)


class ArenaPaddingCache:
    """Mimi's conv padding cache, kept in arena views and updated with copy_."""

    def __init__(self, convs: list[torch.nn.Module]):
        self.modes = [conv.pad_mode for conv in convs]
        self.sizes = [(int(conv.in_channels), int(conv.padding_total)) for conv in convs]
        self.views: list[torch.Tensor] = []
        self.started = [False] * len(convs)  # first-call flags (meta)

    def update(self, hidden: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Return the left context for this call ([1, C, P]) and keep the next one."""
        view = self.views[layer_idx]  # [1, C, P]
        padding = view.shape[-1]
        if self.started[layer_idx] or self.modes[layer_idx] == 'constant':
            current = view.clone()
        else:  # replicate: the first call pads with its own first sample
            current = hidden[..., :1].expand(view.shape).clone()
        self.started[layer_idx] = True
        if padding > 0:
            short = max(0, padding - hidden.shape[-1])
            view.copy_(torch.cat([current[:, :, -short:], hidden], dim=-1) if short
                       else hidden[:, :, -padding:])
        return current


class KyutaiSTTAdapter(StateAdapter):
    """A Kyutai STT model stepping one 80 ms frame at a time over arena-bound state."""

    family = MODEL_TYPE

    def __init__(self, model, tokenizer, max_seq_len: int, model_id: str, text_delay_s: float,
                 silence_prefix_s: float = 0.0, settings: str = 'built-in'):
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.model_id, self.tokenizer, self.max_seq_len = model_id, tokenizer, max_seq_len
        cfg = model.config
        self.config = cfg
        self.codec = model.codec_model
        first = next(self.model.parameters())
        self.device, self.dtype = first.device, first.dtype
        self.vocab_size = int(model.lm_head.weight.shape[0])
        self.num_codebooks = int(cfg.num_codebooks)
        codec_cfg = self.codec.config
        self.spec = SpeechSpec(int(codec_cfg.sampling_rate), int(cfg.frame_size),
                               float(text_delay_s), int(cfg.pad_token_id),
                               float(silence_prefix_s), settings)
        # As transformers' feature extractor pads: int(seconds * rate) samples.
        self.prefix_samples = int(self.spec.silence_prefix_s * self.spec.sample_rate)
        self.silence_left = self.prefix_samples  # of the prefix, still to feed (meta)
        self._bos = torch.full((1, 1, self.num_codebooks + 1), int(cfg.audio_bos_token_id),
                               dtype=torch.long, device=self.device)
        self._bos[0, 0, 0] = int(cfg.bos_token_id)
        self._ids = torch.zeros((1, 1, self.num_codebooks + 1), dtype=torch.long,
                                device=self.device)  # [1, 1, 1 + K]: text token + codes
        seanet = self.codec.encoder.encoder_seanet
        convs = [seanet.get_submodule(n) for n in seanet._conv1d_layer_names]
        self.padding = ArenaPaddingCache(convs + [self.codec.encoder.downsample])
        # The encoder transformer steps latent_stride times per frame. Each cache is at
        # least the model's window long, whatever max_seq_len.
        self.codec_steps = int(codec_cfg.latent_stride)
        self.codec_binding = CacheBinding(
            codec_cfg, max((max_seq_len + 1) * self.codec_steps, codec_cfg.sliding_window or 0),
            'mimi', self._probe_codec, ring_windows=True)
        dec_len = max(max_seq_len, cfg.sliding_window or 0)
        self.dec_binding = CacheBinding(cfg, dec_len, MODEL_TYPE, self._probe_decoder,
                                        ring_windows=True)
        # Decoder steps an utterance may run: None (no bound) when every cache is a window.
        bounded = not (self.codec_binding.only_windows and self.dec_binding.only_windows)
        self.max_steps = dec_len if bounded else None
        windows = [s.shape[2] for s in self.dec_binding.specs if s.window_dim is not None]
        self.text_window = None if bounded else max(windows)
        self.samples = 0  # samples in the partial frame (meta)
        self.partial: torch.Tensor | None = None  # [frame_size] arena view
        self.resampler = StreamingResampler(self.spec.sample_rate)

    # ---- probes: one throwaway forward each, to learn the cache tensors ---------------

    @torch.inference_mode()
    def _probe_codec(self, cache) -> None:
        x = torch.zeros(1, 1, self.config.frame_size, device=self.device)  # [1, 1, S]
        self.codec.encoder(x, cache=cache, use_streaming=True)

    @torch.inference_mode()
    def _probe_decoder(self, cache) -> None:
        self.model.model(input_ids=self._bos.expand(1, 4, -1), cache=cache, use_cache=True)

    # ---- the state contract ------------------------------------------------------------

    def state_specs(self) -> list[StateSpec]:
        specs = [StateSpec(f'pad{i}', 'conv', (1, c, p), torch.float32)
                 for i, (c, p) in enumerate(self.padding.sizes)]
        specs += [_renamed(s, 'codec.') for s in self.codec_binding.specs]
        specs += [_renamed(s, 'dec.') for s in self.dec_binding.specs]
        specs.append(StateSpec('audio.partial', 'audio', (self.spec.frame_size,),
                               torch.float32))
        specs.append(StateSpec('audio.history', 'audio', (self.resampler.size,),
                               torch.float32))
        if self.text_window is None:  # as long as the utterance may be
            specs.append(StateSpec('tokens', 'tokens', (self.max_steps,), torch.int32,
                                   seq_dim=0))
        else:
            specs.append(StateSpec('tokens', 'tokens', (self.text_window,), torch.int32,
                                   window_dim=0))
        return specs

    def window_writes(self) -> dict[str, tuple[int, int]]:
        """Return the window rows the next frame writes (the first frame also runs BOS)."""
        position = self.dec_binding.cache.get_seq_length()
        steps = 1 if position else 2
        writes = {'codec.' + k: v
                  for k, v in self.codec_binding.window_writes(self.codec_steps).items()}
        writes.update(('dec.' + k, v) for k, v in self.dec_binding.window_writes(steps).items())
        if self.text_window is not None:
            writes['tokens'] = (position, steps)
        return writes

    def bind(self, views: dict[str, torch.Tensor]) -> None:
        self.padding.views = [views[f'pad{i}'] for i in range(len(self.padding.sizes))]
        for prefix, binding in (('codec.', self.codec_binding), ('dec.', self.dec_binding)):
            binding.bind({k[len(prefix):]: v for k, v in views.items() if k.startswith(prefix)})
        self.partial = views['audio.partial']
        self.resampler.history = views['audio.history']

    def export_meta(self) -> dict[str, Any]:
        return {'layers': self.dec_binding.export_meta()['layers'],
                'codec_layers': self.codec_binding.export_meta()['layers'],
                'conv_started': list(self.padding.started), 'samples': self.samples,
                'resample': self.resampler.export_meta(), 'silence_left': self.silence_left}

    def check_meta(self, meta: dict[str, Any]) -> None:
        self.dec_binding.check_meta({'layers': meta['layers']})
        self.codec_binding.check_meta({'layers': meta['codec_layers']})
        flags = meta['conv_started']
        if not (isinstance(flags, list) and len(flags) == len(self.padding.sizes)
                and all(isinstance(f, bool) for f in flags)):
            raise ValueError(f'conv_started needs {len(self.padding.sizes)} flags')
        samples = meta['samples']
        if type(samples) is not int or not 0 <= samples < self.spec.frame_size:
            raise ValueError(f'samples must be in [0, {self.spec.frame_size})')
        self.resampler.check_meta(meta['resample'])
        left = meta.get('silence_left', 0)
        if type(left) is not int or not 0 <= left <= self.prefix_samples:
            raise ValueError(f'silence_left must be in [0, {self.prefix_samples}]')

    def import_meta(self, meta: dict[str, Any]) -> None:
        self.dec_binding.import_meta({'layers': meta['layers']})
        self.codec_binding.import_meta({'layers': meta['codec_layers']})
        self.padding.started[:] = meta['conv_started']
        self.samples = meta['samples']
        self.resampler.import_meta(meta['resample'])
        # A capsule from before the prefix existed: its stream is under way, nothing to feed.
        self.silence_left = meta.get('silence_left', 0)

    def reset_meta(self) -> None:
        self.dec_binding.reset_meta()
        self.codec_binding.reset_meta()
        self.padding.started[:] = [False] * len(self.padding.started)
        self.samples = 0
        self.resampler.reset_meta()
        self.silence_left = self.prefix_samples

    def fingerprint(self) -> str:
        cfg = {k: v for k, v in self.config.to_dict().items()
               if k not in ('_name_or_path', 'architectures', 'transformers_version', 'dtype')}
        # The codebooks are buffers, not parameters: hash them too (a seeded built-in and
        # an unseeded one differ only there).
        h = hashlib.sha256()
        for name, buf in self.codec.quantizer.named_buffers():
            if name.endswith('embed_sum'):
                h.update(buf.reshape(-1)[:64].float().cpu().numpy().tobytes())
        cfg['codebooks'] = h.hexdigest()
        return module_fingerprint(cfg, self.model, self.dtype)

    # ---- compute ---------------------------------------------------------------------

    @torch.inference_mode()
    def bos_step(self, position: int) -> torch.Tensor:
        """Run the utterance's first decoder step (text and audio BOS); return logits [V]."""
        self.dec_binding.set_window(position + 1)
        out = self.model(input_ids=self._bos, cache=self.dec_binding.cache, use_cache=True)
        return out.logits[0, -1]

    @torch.inference_mode()
    def frame_step(self, frame: torch.Tensor, token: int, position: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode one frame [S], feed it with text `token`; return (codes [K], logits [V])."""
        x = frame.view(1, 1, -1)  # [1, 1, S]
        codes = self.codec.encode(x, encoder_cache=self.codec_binding.cache,
                                  padding_cache=self.padding).audio_codes  # [1, K, 1]
        self._ids[0, 0, 0] = token
        self._ids[0, 0, 1:] = codes[0, :, 0]
        self.dec_binding.set_window(position + 1)
        out = self.model(input_ids=self._ids, cache=self.dec_binding.cache, use_cache=True)
        return codes[0, :, 0], out.logits[0, -1]


def _renamed(spec: StateSpec, prefix: str) -> StateSpec:
    return dataclasses.replace(spec, name=prefix + spec.name)


# ---- loading ------------------------------------------------------------------------------


def is_speech_model(model_id: str) -> bool:
    """Whether `model` names a built-in speech model or a Kyutai STT checkpoint directory."""
    if model_id.startswith('builtin:'):
        return model_id.split(':', 1)[1] in SPEECH_BUILTINS
    config = Path(model_id).expanduser() / 'config.json'
    try:
        return json.loads(config.read_text()).get('model_type') == MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False


def build_tiny_stt(name: str):
    """Build built-in speech model `name`: seeded weights, codebooks seeded by calibration."""
    from transformers import KyutaiSpeechToTextConfig, KyutaiSpeechToTextForConditionalGeneration

    spec = SPEECH_BUILTINS[name]
    config = KyutaiSpeechToTextConfig(**spec['decoder'], codec_config=spec['codec'])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = KyutaiSpeechToTextForConditionalGeneration(config).eval()
        calibrate_codebooks(model.codec_model, torch.Generator().manual_seed(SEED))
    return model, spec['text_delay_s']


@torch.inference_mode()
def calibrate_codebooks(codec, generator: torch.Generator) -> None:
    """
    Seed every codebook with encoder latents of seeded audio (one pass, residual by residual).

    Each codebook's entries are latents (residuals after the codebooks before it) drawn at
    random, so every codebook splits the latent space and a frame's codes depend on its audio.
    """
    frames = CALIBRATION_FRAMES * codec.config.frame_size
    t = torch.arange(frames) / codec.config.sampling_rate
    audio = 0.1 * torch.randn(frames, generator=generator) + 0.3 * torch.sin(
        2 * torch.pi * 220 * t * (1 + t))  # noise and a chirp
    latents = codec.encoder(audio.view(1, 1, -1).to(codec.device)).latents  # [1, D, T]
    quantizer = codec.quantizer
    for rvq in (quantizer.semantic_residual_vector_quantizer,
                quantizer.acoustic_residual_vector_quantizer):
        x = rvq.input_proj(latents) if rvq.input_proj is not None else latents
        residual = x[0].T  # [T, d]
        for layer in rvq.layers:
            book = layer.codebook
            pick = torch.randint(0, residual.shape[0], (book.codebook_size,),
                                 generator=generator)
            book.embed_sum.copy_(residual[pick.to(residual.device)])
            book.cluster_usage.fill_(1.0)
            book._embed = None  # the embed property caches embed_sum / usage
            residual = residual - book.embed[book.quantize(residual)]
            book._embed = None  # not a buffer: a cached one would stay behind on a .to(device)


def load_speech(model_id: str, device: torch.device, dtype: torch.dtype,
                max_seq_len: int) -> KyutaiSTTAdapter:
    """`builtin:<speech model>` or a local Kyutai STT checkpoint directory (never downloads)."""
    if model_id.startswith('builtin:'):
        model, delay = build_tiny_stt(model_id.split(':', 1)[1])
        tokenizer, settings = ByteTokenizer(), {'text_delay_s': delay}
    else:
        model, tokenizer, settings = _load_local(Path(model_id).expanduser(), dtype)
    rate = int(model.codec_model.config.sampling_rate)
    if settings.get('sample_rate', rate) != rate:
        raise ConfigError(
            f"{model_id!r}: the processor's sampling_rate {settings['sample_rate']} is not the "
            f"codec's {rate}")
    model = model.to(device)
    model.model.to(dtype)  # the codec stays float32 (transformers keeps it so)
    model.lm_head.to(dtype)
    return KyutaiSTTAdapter(model, tokenizer, max_seq_len, model_id, settings['text_delay_s'],
                            settings.get('silence_prefix_s', 0.0),
                            settings.get('source', 'built-in'))


def processor_settings(path: Path) -> dict:
    """
    Return the text delay, silence prefix and rate a checkpoint's processor file states.

    {'text_delay_s', 'silence_prefix_s', 'sample_rate' (if stated), 'source' (the file, or
    a note that there is none and the defaults are in use)}.
    """
    for name in PROCESSOR_FILES:
        try:
            saved = json.loads((path / name).read_text())
        except OSError:
            continue
        except ValueError as exc:
            raise ConfigError(f'{str(path / name)!r} is not JSON: {exc}') from exc
        # transformers 5 nests the feature extractor's settings in the processor's file.
        fields = saved.get('feature_extractor', saved) if isinstance(saved, dict) else {}
        try:
            settings = {
                'text_delay_s': float(fields.get('audio_delay_seconds', DEFAULT_DELAY_S)),
                'silence_prefix_s': float(fields.get('audio_silence_prefix_seconds') or 0.0),
                'source': name}
            if fields.get('sampling_rate') is not None:
                settings['sample_rate'] = int(fields['sampling_rate'])
        except (TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f'{str(path / name)!r}: a bad processor setting: {exc}') from exc
        if settings['text_delay_s'] < 0 or settings['silence_prefix_s'] < 0:
            raise ConfigError(f'{str(path / name)!r}: a negative delay or silence prefix')
        return settings
    return {'text_delay_s': DEFAULT_DELAY_S, 'silence_prefix_s': 0.0,
            'source': f'no processor file: defaults (text delay {DEFAULT_DELAY_S} s)'}


def _load_local(path: Path, dtype: torch.dtype):
    from transformers import KyutaiSpeechToTextForConditionalGeneration

    try:
        model = KyutaiSpeechToTextForConditionalGeneration.from_pretrained(
            str(path), local_files_only=True, dtype=dtype)
    except Exception as exc:  # transformers raises many types for a bad checkpoint
        raise ConfigError(f'cannot load a Kyutai STT model from {str(path)!r}: {exc}') from exc
    return model, checkpoint_tokenizer(path), processor_settings(path)


def save_speech_builtin(model_id: str, directory: str | Path) -> Path:
    """Write a built-in speech model as a checkpoint directory (weights, tokenizer, delay)."""
    model, delay = build_tiny_stt(model_id.removeprefix('builtin:'))
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    ByteTokenizer().save(out)
    (out / 'preprocessor_config.json').write_text(json.dumps({
        'feature_extractor_type': 'KyutaiSpeechToTextFeatureExtractor',
        'sampling_rate': int(model.codec_model.config.sampling_rate),
        'audio_delay_seconds': delay}, indent=1) + '\n')
    return out
