"""The node's parameters, declared from one table (runtime settings default to RuntimeConfig's)."""

import dataclasses

from flashrt_ros.runtime import RuntimeConfig
from flashrt_ros.runtime.config import DTYPES, EVICTION_POLICIES, MAX_DRAFT_TOKENS
from flashrt_ros.runtime.config import PROMPT_FORMATS, VERIFY_STRATEGIES
from flashrt_ros.runtime.modes.speech import QUIET_DB, QUIET_S
from flashrt_ros.runtime.state.transfer import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES
from flashrt_ros.session import MODES, POLICY_MODES
from flashrt_ros.session.policy import STEPPINGS
from flashrt_ros.session.turns import GOAL_POLICIES
from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor
from rcl_interfaces.msg import ParameterType, SetParametersResult
from rclpy.parameter import Parameter

from .control import CONTROL_EXECUTORS
from .messages import TRAJECTORY_FIELDS

# Parameters that build the Runtime; a change takes effect at the next configure.
RUNTIME_PARAMS = tuple(f.name for f in dataclasses.fields(RuntimeConfig))
# Set at start-up only: a peer on the DDS domain must not point the node at another model
# or directory, change what it may hold in memory or on disk (the arena's length and dtype,
# the ring, the budgets, whether capsules are evicted), unprotect the home capsule or rewrite
# it (its system prompt, taken again at the next configure) or slow the control path.
READ_ONLY = ('model', 'device', 'capsule_dir', 'device_budget_bytes', 'host_budget_bytes',
             'disk_budget_bytes', 'max_seq_len', 'rollback_depth', 'ring_budget_bytes',
             'eviction', 'home_capsule', 'protect_home', 'control_executor', 'control_priority',
             'cpu_latency_us', 'compute_threads', 'export_allowed', 'dtype', 'system_prompt')
EXPORT_POLICIES = ('unpinned', 'all', 'none')
# Each node keeps its disk capsules apart: {node} is its fully qualified name.
DEFAULT_CAPSULE_DIR = '~/.cache/flashrt_ros/capsules/{node}'
_RUNTIME_DEFAULTS = RuntimeConfig()
_MAX_INT = 2 ** 62
_REBUILD = ' Takes effect at the next configure.'


@dataclasses.dataclass(frozen=True)
class Param:
    """One row of the table: a parameter, its default and its constraints."""

    name: str
    default: object
    description: str
    choices: tuple = ()
    integer: tuple = None       # (from, to)
    floating: tuple = None      # (from, to)
    string_array: bool = False
    constraints: str = ''       # said in the descriptor when there are no choices

    def descriptor(self):
        if self.name in READ_ONLY:
            note = ' Read-only: set at start-up (--ros-args -p, a parameter file, launch).'
        elif self.name in RUNTIME_PARAMS or self.name in _AT_CONFIGURE:
            note = _REBUILD
        else:
            note = ''
        constraints = ' | '.join(self.choices) or self.constraints
        d = ParameterDescriptor(description=self.description + note,
                                additional_constraints=constraints,
                                read_only=self.name in READ_ONLY)
        if self.string_array:
            d.type = ParameterType.PARAMETER_STRING_ARRAY
        if self.integer is not None:
            d.integer_range = [IntegerRange(from_value=self.integer[0],
                                            to_value=self.integer[1], step=1)]
        if self.floating is not None:
            d.floating_point_range = [FloatingPointRange(from_value=self.floating[0],
                                                         to_value=self.floating[1], step=0.0)]
        return d


def _runtime(name, description, **constraints):
    return Param(name, getattr(_RUNTIME_DEFAULTS, name), description, **constraints)


# Read at configure too, though not part of RuntimeConfig.
_AT_CONFIGURE = ('mode', 'stepping', 'control_rate', 'image_topics', 'sync_slop',
                 'joint_names', 'end_of_utterance_s', 'end_of_utterance_db')

PARAMETERS = (
    Param('autostart', True,
          'Walk through configure and activate at startup, so a plain `ros2 run` serves.'),
    Param('mode', 'lm',
          'lm: a language model (~/generate, ~/prompt); policy: a robot policy '
          '(~/observation -> ~/actions); speech: a speech-to-text model (~/audio -> '
          '~/transcript). Must match the model.', choices=tuple(MODES)),
    _runtime('model', "Model: default (a tiny byte-level hybrid trained on Python's "
             'documentation, installed with the package), builtin:<id> (random weights, no '
             'download) or a local checkpoint directory (save_pretrained folder with its '
             'tokenizer).'),
    _runtime('device', 'Device: cpu, cuda or cuda:N.', constraints='cpu | cuda | cuda:N'),
    _runtime('dtype', 'Weight and state dtype. auto: the dtype a local checkpoint was saved in '
             '(torch_dtype in its config.json; float32 when it says none), float32 for the '
             'built-in and policy models.', choices=DTYPES),
    _runtime('max_seq_len', 'KV capacity in tokens; the state arena is sized for it.',
             integer=(8, 1 << 20)),
    _runtime('device_budget_bytes', 'Byte budget of the device capsule tier (0 = unlimited). '
             '-1 (default): sized from the state arena, 4 full-length capsules (4 x the '
             'arena bytes at max_seq_len), at least 256 MiB.', integer=(-1, _MAX_INT)),
    _runtime('host_budget_bytes', 'Byte budget of the host-memory capsule tier (0 = unlimited). '
             '-1 (default): 8 x the arena bytes, at least 1 GiB.', integer=(-1, _MAX_INT)),
    _runtime('disk_budget_bytes', 'Byte budget of the capsule directory (0 = unlimited). '
             '-1 (default): 16 x the arena bytes, at least 4 GiB.', integer=(-1, _MAX_INT)),
    Param('capsule_dir', DEFAULT_CAPSULE_DIR,
          'Directory of the disk tier; capsules there outlive the node. {node} stands for the '
          "node's fully qualified name, so that two nodes never share one by default."),
    _runtime('eviction', 'When a tier is full: refuse the snapshot, or evict least-recently-'
             'used unpinned capsules.', choices=EVICTION_POLICIES),
    _runtime('cuda_graphs', 'Capture the decode step as a CUDA graph at activation (ignored '
             'on CPU).'),
    _runtime('rollback_depth', 'Committed boundaries kept for ~/rollback.', integer=(0, 1024)),
    _runtime('ring_budget_bytes', 'Byte budget of the rollback ring (0 = unlimited; -1, the '
             'default: 2 x the arena bytes, at least 256 MiB); the oldest boundaries are '
             'dropped to stay within it.', integer=(-1, _MAX_INT)),
    _runtime('seed', 'Initial sampler seed.', integer=(0, 2 ** 31 - 1)),
    _runtime('prompt_format', 'How text prompts (~/prompt, and goals with raw false) go in. '
             "chat: with the tokenizer's chat template, as a conversation (system_prompt the "
             'system message, each prompt a user turn, each reply an assistant turn closed by '
             'the end-of-turn tokens); raw: the text as it is; auto: chat when the tokenizer '
             'has a template, else raw.', choices=PROMPT_FORMATS),
    _runtime('speculation', "Self-speculative greedy decoding with the model's MTP head (a "
             'model without one runs plain and /diagnostics says why). Sampled turns are '
             'refused while it is on.'),
    _runtime('speculative_tokens', 'Draft tokens per speculative round.',
             integer=(1, MAX_DRAFT_TOKENS)),
    _runtime('speculative_verify', 'batched: one forward verifies a round (fast; exact in '
             'float32 up to rounding); sequential: one step per token, bit-exact with plain '
             'greedy decoding.', choices=VERIFY_STRATEGIES),
    _runtime('cpu_step', 'Decode Qwen3-Next / Qwen3.5 float32 and bf16 models on a CPU with the '
             'compiled step (cpu_step.c, built with the C compiler at the first start and '
             'cached; /diagnostics cpu_step says why a model runs without it). false: torch '
             "ops whose results equal transformers' bit for bit, at a fraction of the speed."),
    Param('home_capsule', 'home',
          'Name of the capsule taken at activation (system prompt prefilled); ~/reset and the '
          'restore_home policy restore it.'),
    Param('protect_home', True,
          '~/snapshot, ~/fork and ~/delete_capsule may not replace or delete the home capsule '
          '(set false to allow it).'),
    Param('system_prompt', 'You are a helpful robot.',
          'Text prefilled at activation before the home capsule is taken: the system message '
          'of the conversation with a chat template, else raw text (may be empty; ignored in '
          'policy mode).'),
    Param('interrupt_policy', 'stop',
          'What an interrupt (or a goal cancel) does after stopping at the step boundary: stop '
          '(keep that state), rollback (one committed boundary back) or restore_home.',
          choices=tuple(POLICY_MODES)),
    Param('goal_policy', 'reject',
          'A generation request while one is running or queued: reject it, or queue it.',
          choices=GOAL_POLICIES),
    Param('max_new_tokens', 64, 'Token limit of a turn when the goal says 0 (and for ~/prompt).',
          integer=(1, 1 << 20)),
    Param('token_chunk', 1, 'Tokens per TokenChunk on ~/tokens and in the action feedback.',
          integer=(1, 4096)),
    Param('stop_strings', [], 'Stop strings used when a goal gives none (and for ~/prompt).',
          string_array=True),
    Param('control_executor', 'waitset',
          'What takes ~/interrupt and ~/reset. waitset: a wait set of their own on a thread of '
          'its own (the control path); single: a SingleThreadedExecutor on that thread; shared: '
          "the node's own executor, beside services and inputs (the last two are slower; for "
          'comparisons).', choices=CONTROL_EXECUTORS),
    Param('compute_threads', 0,
          'Threads of the model step (torch and the compiled CPU step), set at configure; 0 '
          "keeps torch's default (every core). On a robot, leave a core to the control path and "
          'the middleware (docs/architecture.md).', integer=(0, 1024)),
    Param('control_priority', 0,
          'SCHED_FIFO priority (1-99) of the control thread (the middleware receive threads '
          'one below it, the generation thread at nice -10); 0 keeps the normal policy. Needs '
          'CAP_SYS_NICE or rtprio and nice limits (refused: a warning, normal priority).',
          integer=(0, 99)),
    Param('cpu_latency_us', -1,
          'Microseconds an idle CPU may take to wake (a Linux CPU latency request on '
          "/dev/cpu_dma_latency, system-wide, held from the node's start until it is "
          'destroyed, in every lifecycle state); 0 keeps idle cores out of sleep states, so '
          "the control path's threads wake at once, at the price of their power; -1 leaves "
          'the system as it is. Needs write access to the file (refused: a warning).',
          integer=(-1, 2_000_000)),
    Param('interrupt_timeout', 5.0,
          'Seconds ~/interrupt, ~/reset and deactivate wait for the generation to reach a step '
          'boundary.', floating=(0.01, 600.0)),
    Param('transfer_chunk_bytes', DEFAULT_CHUNK_BYTES,
          'Bytes per ~/export_chunk call when this node imports a capsule (docs/transfer.md '
          'says why 256 KiB, and when 1 MiB is better).', integer=(4096, MAX_CHUNK_BYTES)),
    Param('transfer_shared_memory', True,
          'When this node imports from a node on the same host, read the export from shared '
          'memory (/dev/shm, written by the sender for this user only) instead of DDS chunks: '
          'the same bytes, verified the same way; false: always DDS chunks.'),
    Param('transfer_timeout', 10.0,
          'Seconds an import waits for each answer of the source node before it gives up '
          '(nothing is stored then).', floating=(0.1, 600.0)),
    Param('export_allowed', 'unpinned',
          'Which capsules peers may pull with ~/export_manifest: unpinned (every capsule but '
          'the pinned ones, such as home with its system prompt), all, or none.',
          choices=EXPORT_POLICIES),
    Param('transfer_deadline', 120.0,
          'Seconds a whole import may take (and after 5 s it must average 64 KiB/s) before it '
          'is given up (nothing is stored then).', floating=(0.5, 86400.0)),
    Param('stepping', 'observation',
          'Policy mode. observation: one control step per observation message, whole chunk '
          'published; timer: control_rate timer steps on the newest observation and publishes '
          'one queued action per tick.', choices=STEPPINGS),
    Param('control_rate', 10.0,
          'Policy mode: control steps per second of the timer, and the spacing of '
          'JointTrajectory points.', floating=(0.1, 1000.0)),
    Param('joint_names', [],
          'Policy mode, for a checkpoint that names no joints (LeRobot): the joint of each '
          'action dimension; the state is read as their positions from ~/observation.',
          string_array=True),
    Param('image_topics', [],
          'Policy mode: the sensor_msgs/Image topic of each camera, as <camera>=<topic> '
          'entries (<camera> as in the checkpoint key observation.images.<camera>); a '
          'camera not named is read from ~/image/<camera>.',
          string_array=True),
    Param('sync_slop', 0.05,
          'Policy mode: seconds by which the stamps of one observation (the joint state and '
          'each camera image) may differ and still make one observation.',
          floating=(0.0, 10.0)),
    Param('max_observation_age', 1.0,
          'Policy mode: an input stamped longer ago than this (seconds, node clock) is '
          'refused, and so is an observation whose camera sent nothing for this long; 0 '
          'turns both checks off.', floating=(0.0, 3600.0)),
    Param('end_of_utterance_s', QUIET_S,
          'Speech mode: an end-of-utterance event goes out on ~/end_of_utterance once the '
          'transcript has been quiet this long after words: frames of padding tokens over '
          'audio below end_of_utterance_db; 0 turns the events off.', floating=(0.0, 60.0)),
    Param('end_of_utterance_db', QUIET_DB,
          'Speech mode: audio energy (RMS, dB full scale) below which a padded frame counts '
          'as quiet for end_of_utterance_s.', floating=(-120.0, 0.0)),
    Param('publish_joint_trajectory', False,
          'Policy mode: also publish actions as trajectory_msgs/JointTrajectory on '
          '~/joint_trajectory (read at startup).'),
    Param('trajectory_field', 'positions', 'JointTrajectoryPoint field the actions fill.',
          choices=TRAJECTORY_FIELDS),
    Param('diagnostics_period', 1.0, 'Seconds between /diagnostics messages (read at startup).',
          floating=(0.05, 3600.0)),
)
CHOICES = {p.name: p.choices for p in PARAMETERS if p.choices}


def choice_problem(name, value):
    """Say why `value` is not one of parameter `name`'s choices ('' when it is)."""
    allowed = CHOICES.get(name)
    if allowed is not None and value not in allowed:
        return f'parameter {name}={value!r} is not valid; use one of {", ".join(allowed)}'
    return ''


def declare(node):
    """Declare every parameter on `node` and refuse a bad choice when one is set."""
    for p in PARAMETERS:
        if p.string_array:
            # Declared by type: from an empty default rclpy would infer a byte array and
            # refuse every list of strings. Unset (no override): the default, typed.
            node.declare_parameter(p.name, Parameter.Type.STRING_ARRAY, p.descriptor())
            if node.get_parameter_or(p.name).type_ == Parameter.Type.NOT_SET:
                node.set_parameters([Parameter(p.name, Parameter.Type.STRING_ARRAY,
                                               list(p.default))])
        else:
            node.declare_parameter(p.name, p.default, p.descriptor())
    for parameter in node.get_parameters(list(CHOICES)):
        problem = choice_problem(parameter.name, parameter.value)
        if problem:
            node.get_logger().error(problem)
    node.add_pre_set_parameters_callback(_type_empty_arrays)
    node.add_on_set_parameters_callback(_validate)


STRING_ARRAYS = tuple(p.name for p in PARAMETERS if p.string_array)
_ARRAYS = (Parameter.Type.BYTE_ARRAY, Parameter.Type.BOOL_ARRAY, Parameter.Type.INTEGER_ARRAY,
           Parameter.Type.DOUBLE_ARRAY)


def _type_empty_arrays(parameters):
    # An empty list carries no element type (rclpy and `ros2 param set` pick another array
    # kind), so an empty array for a string-array parameter is taken as an empty string array.
    return [Parameter(p.name, Parameter.Type.STRING_ARRAY, [])
            if p.name in STRING_ARRAYS and p.type_ in _ARRAYS and len(p.value) == 0 else p
            for p in parameters]


def _validate(parameters):
    for parameter in parameters:
        problem = choice_problem(parameter.name, parameter.value)
        if problem:
            return SetParametersResult(successful=False, reason=problem)
    return SetParametersResult(successful=True)


def capsule_dir(template, node_name):
    """Return capsule_dir with {node} replaced by the node's name (/ns/flashrt: ns/flashrt)."""
    return template.replace('{node}', node_name.strip('/'))


def runtime_config(node, node_name):
    """Return the RuntimeConfig the node's parameters describe (ConfigError if invalid)."""
    values = {name: node.get_parameter(name).value for name in RUNTIME_PARAMS}
    values['capsule_dir'] = capsule_dir(values['capsule_dir'], node_name)
    return RuntimeConfig.from_dict(values)
