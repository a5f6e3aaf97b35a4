"""Conversions between ROS messages and the runtime's and session's records."""

from builtin_interfaces.msg import Duration, Time
from diagnostic_msgs.msg import DiagnosticStatus, KeyValue
from flashrt_ros.action import Generate
from flashrt_ros.msg import ActionChunk, CapsuleInfo, EndOfUtterance, TokenChunk
from flashrt_ros.msg import TranscriptWord
from flashrt_ros.runtime.modes.lm.chat import turn_count
from flashrt_ros.session import TurnRequest
import numpy as np
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

TRAJECTORY_FIELDS = ('positions', 'velocities', 'accelerations', 'effort')


def stamp(seconds):
    """Convert unix seconds (float) to builtin_interfaces/Time."""
    sec = int(seconds)
    return Time(sec=sec, nanosec=int((seconds - sec) * 1e9))


def duration(seconds):
    """Convert seconds (float) to builtin_interfaces/Duration."""
    sec = int(seconds)
    return Duration(sec=sec, nanosec=int((seconds - sec) * 1e9))


def info_msg(info, msg=None):
    """Fill msg (a new CapsuleInfo message by default) from a runtime CapsuleInfo."""
    msg = CapsuleInfo() if msg is None else msg
    msg.name, msg.tier, msg.size_bytes = info.name, info.tier, int(info.nbytes)
    msg.position, msg.created = int(info.position), stamp(info.created)
    msg.checksum, msg.fingerprint = info.checksum, info.fingerprint
    msg.components, msg.pinned = list(info.components), bool(info.pinned)
    origin = info.origin
    if origin is not None:
        msg.origin_node, msg.origin_name = origin.node, origin.name
        msg.imported = stamp(origin.imported)
    msg.roles, msg.turns = list(info.roles), turn_count(info.roles)
    return msg


def turn_request(goal):
    """Convert a Generate goal to a TurnRequest."""
    return TurnRequest(
        prompt=goal.prompt, token_ids=tuple(goal.token_ids), raw=bool(goal.raw),
        max_new_tokens=int(goal.max_new_tokens), temperature=float(goal.temperature),
        top_k=int(goal.top_k), top_p=float(goal.top_p), seed=int(goal.seed),
        stop=tuple(goal.stop), start_from=goal.start_from, save_as=goal.save_as,
        save_tier=goal.save_tier)


def result_msg(result):
    """Convert a TurnResult to a Generate result."""
    return Generate.Result(
        success=result.success, message=result.message, text=result.text,
        token_ids=list(result.token_ids), stop_reason=result.stop_reason,
        time_to_first_token_ms=result.time_to_first_token_ms,
        tokens_per_second=result.tokens_per_second, position=int(result.position))


def token_chunk(turn, index, ids, text, stop_reason, final, now):
    """Build the TokenChunk of a turn's tokens, stamped `now` (a builtin_interfaces Time)."""
    chunk = TokenChunk(turn_id=turn.turn_id, index=index, token_ids=list(ids), text=text,
                       final=final, stop_reason=stop_reason)
    chunk.header.stamp = now
    return chunk


def transcript_chunk(utterance, index, ids, text, final, words, stamp):
    """Build the TokenChunk of a speech stream's tokens and words (turn_id: the utterance)."""
    chunk = TokenChunk(turn_id=int(utterance), index=int(index), token_ids=list(ids),
                       text=text, final=final, stop_reason='flush' if final else '',
                       words=[TranscriptWord(text=w.text, start=float(w.start), end=float(w.end),
                                             partial=bool(w.partial)) for w in words])
    chunk.header.stamp = stamp
    return chunk


def end_of_utterance(utterance, index, end, stamp):
    """Build the EndOfUtterance of a runtime EndOfUtterance record."""
    msg = EndOfUtterance(turn_id=int(utterance), index=int(index), text=end.text,
                         start=float(end.start), end=float(end.end),
                         quiet_seconds=float(end.quiet_s),
                         pause_probability=float(end.pause_probability))
    msg.header.stamp = stamp
    return msg


def audio_samples(msg):
    """
    Return an AudioChunk's samples as a mono numpy array (int16 or float32).

    Raise ValueError saying what is wrong with the format.
    """
    fields = {'int16': msg.int16_samples, 'float32': msg.float32_samples}
    data = fields.get(msg.sample_format)
    if data is None:
        raise ValueError(f'sample_format {msg.sample_format!r} is not supported; use '
                         "'int16' or 'float32'")
    other = fields['float32' if msg.sample_format == 'int16' else 'int16']
    if len(other) and not len(data):
        raise ValueError(f'sample_format is {msg.sample_format!r} but the samples are in '
                         f'the other field; put them in {msg.sample_format}_samples')
    channels = int(msg.channels) or 1
    samples = np.asarray(data, dtype=np.int16 if msg.sample_format == 'int16' else np.float32)
    if samples.size % channels:
        raise ValueError(f'{samples.size} samples do not split into {channels} channels')
    if channels > 1:  # interleaved: average to mono, in float32
        scale = 32768.0 if samples.dtype == np.int16 else 1.0
        samples = samples.reshape(-1, channels).astype(np.float32).mean(axis=1) / scale
    return samples


# PortAudio sample formats, which mgonzs13/audio_common's AudioInfo.format carries:
# code -> (the AudioData field holding the samples, full scale, offset)
_PORTAUDIO_FORMATS = {1: ('float32_data', 1.0, 0.0), 2: ('int32_data', 2.0 ** 31, 0.0),
                      4: ('int24_data', 2.0 ** 23, 0.0), 8: ('int16_data', 32768.0, 0.0),
                      16: ('int8_data', 128.0, 0.0), 32: ('uint8_data', 128.0, 128.0)}


def audio_common_flavour(module) -> str:
    """
    Tell the two incompatible audio_common_msgs packages of ROS 2 apart by their fields.

    'typed': mgonzs13/audio_common (AudioStamped: header, audio = {audio: AudioData of typed
    arrays, info: format, channels, rate}); 'bytes': ros-drivers/audio_common (AudioData:
    uint8[] data, S16LE); '' when `module` is neither.
    """
    stamped, data = getattr(module, 'AudioStamped', None), getattr(module, 'AudioData', None)
    if stamped is not None and 'audio' in stamped.get_fields_and_field_types():
        return 'typed'
    if data is not None and set(data.get_fields_and_field_types()) == {'data'}:
        return 'bytes'
    return ''


def audio_common_samples(msg, flavour: str):
    """
    Return (mono float32 samples, sample rate or None) of an audio_common_msgs message.

    'typed': an AudioStamped, its samples in the field its info.format names (PortAudio
    codes), interleaved channels averaged. 'bytes': an AudioData of S16LE mono samples at
    the model's rate (rate None). Raise ValueError saying what is wrong with the format.
    """
    if flavour == 'bytes':
        raw = bytes(msg.data)
        if len(raw) % 2:
            raise ValueError(f'AudioData of {len(raw)} bytes is not whole S16LE samples')
        return np.frombuffer(raw, dtype='<i2').astype(np.float32) / 32768.0, None
    audio, info = msg.audio.audio, msg.audio.info
    found = _PORTAUDIO_FORMATS.get(int(info.format))
    if found is None:
        raise ValueError(f'audio_common format {info.format} is not supported; use a PortAudio '
                         f'sample format: {sorted(_PORTAUDIO_FORMATS)}')
    field, scale, offset = found
    samples = (np.asarray(getattr(audio, field), dtype=np.float64) - offset) / scale
    channels = int(info.channels) or 1
    if samples.size % channels:
        raise ValueError(f'{samples.size} samples do not split into {channels} channels')
    samples = samples.reshape(-1, channels).mean(axis=1) if channels > 1 else samples
    return samples.astype(np.float32), int(info.rate) or None


def joint_state_vector(msg, names):
    """
    Return the observation vector named by `names` ('<joint>/position|velocity|effort').

    Raise ValueError naming what is missing.
    """
    if not names:
        raise ValueError('the policy declares no observation_names, so a JointState cannot be '
                         'mapped; publish the raw vector on ~/observation_vector')
    index = {joint: i for i, joint in enumerate(msg.name)}
    values = []
    for name in names:
        joint, _, field = name.rpartition('/')
        data = getattr(msg, field, None) if field in ('position', 'velocity', 'effort') else None
        if data is None or joint not in index or index[joint] >= len(data):
            raise ValueError(f'JointState has no {field or "value"} for {joint or name!r} '
                             f'(the policy needs {list(names)})')
        values.append(float(data[index[joint]]))
    return values


def action_chunk(step, rows, names, stamp, dt):
    """Build the ActionChunk of action rows [[a_0..a_A-1], ...], `dt` seconds apart."""
    msg = ActionChunk(step=int(step), horizon=len(rows), action_dim=len(rows[0]),
                      actions=[float(a) for row in rows for a in row], names=list(names),
                      dt=float(dt))
    msg.header.stamp = stamp
    return msg


def nanoseconds_of(stamp):
    """Return a builtin_interfaces/Time as integer nanoseconds."""
    return stamp.sec * 1_000_000_000 + stamp.nanosec


def time_of(nanoseconds):
    """Return integer nanoseconds (>= 0) as a builtin_interfaces/Time, exactly."""
    return Time(sec=nanoseconds // 1_000_000_000, nanosec=nanoseconds % 1_000_000_000)


def joint_trajectory(rows, names, dt, field, now):
    """Build a JointTrajectory whose points are the rows, `dt` seconds apart, in `field`."""
    trajectory = JointTrajectory(joint_names=list(names) or
                                 [f'action_{i}' for i in range(len(rows[0]))])
    trajectory.header.stamp = now
    for i, row in enumerate(rows):
        point = JointTrajectoryPoint(time_from_start=duration((i + 1) * dt))
        setattr(point, field, [float(a) for a in row])
        trajectory.points.append(point)
    return trajectory


def speculation_values(spec):
    """Return the diagnostics of speculative decoding: its figures, or why it is off."""
    if not spec or not spec.get('enabled'):
        return {'speculation': (spec or {}).get('note') or 'off'}
    return {'speculation': f"on ({spec['verify']}, {spec['draft_tokens']} drafts)",
            'speculation_rounds': spec['rounds'],
            'speculation_mean_accepted_length': f"{spec['mean_accepted_length']:.3f}",
            'speculation_acceptance_by_depth': ', '.join(
                f'{a:.3f}' for a in spec['acceptance_by_depth'])}


def diagnostic_status(name, state_label, session, stage='', extra=None):
    """
    Build the node's DiagnosticStatus: lifecycle state, and the runtime's stats if any.

    stage: what a configure or activate in progress is doing (loading, binding, warm-up,
    home prefill); '' when none runs. extra: more {key: value} (the interrupts' stages).
    """
    status = DiagnosticStatus(name=name)
    values = {'lifecycle_state': state_label}
    if stage:
        values['stage'] = stage
    if session is None:
        status.level = DiagnosticStatus.WARN
        status.message = f'configuring: {stage}' if stage else 'unconfigured'
    else:
        try:
            stats = session.runtime.stats()
        except Exception as exc:
            stats = None
            status.level, status.message = DiagnosticStatus.WARN, f'no stats: {exc}'
        if stats is not None:
            status.hardware_id = str(stats.device)
            values.update(model=stats.model, dtype=stats.dtype, state_bytes=stats.state_nbytes,
                          turns=turn_count(role for role, _ in session.runtime.conversation),
                          position=stats.position, generating=session.turns.running is not None)
            for tier, t in stats.tiers.items():
                values[f'{tier}_capsules'] = t.count
                values[f'{tier}_bytes_used'] = t.bytes_used
                values[f'{tier}_budget_bytes'] = t.budget
            values['rollback_ring_capsules'] = stats.rollback_ring.count
            values['rollback_ring_bytes'] = stats.rollback_ring.bytes_used
            values['last_restore_ms'] = f'{stats.last_restore_s * 1e3:.4f}'
            values['p99_restore_ms'] = f'{stats.p99_restore_s * 1e3:.4f}'
            values['last_restore_copied_bytes'] = stats.last_restore_copied_bytes
            values['decode_tokens_per_s'] = f'{stats.decode_tokens_per_s:.1f}'
            values['cuda_graph'] = stats.cuda_graph
            values['disk_temp_bytes'] = stats.disk_temp_bytes
            values['kernels'] = ', '.join(stats.kernels) or 'none'
            values['cpu_step'] = stats.cpu_step_note or 'on'
            values.update(speculation_values(stats.speculation))
            values.update(session.mode.diagnostics(stats))
            if state_label == 'active':
                status.level, status.message = DiagnosticStatus.OK, 'active'
            else:
                status.level = DiagnosticStatus.WARN
                status.message = f'{state_label}: {stage}' if stage else state_label
    values.update(extra or {})
    status.values = [KeyValue(key=k, value=str(v)) for k, v in values.items()]
    return status
