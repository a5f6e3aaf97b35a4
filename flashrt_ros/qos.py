"""QoS profiles of the node's topics, used by the node and its clients alike."""

from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy

_RELIABLE = {'history': HistoryPolicy.KEEP_LAST, 'reliability': ReliabilityPolicy.RELIABLE,
             'durability': DurabilityPolicy.VOLATILE}

# ~/tokens and ~/events: a speech or UI consumer sees every chunk and every capsule operation
# in order; the depth bounds what a stalled subscriber piles up; a late joiner has no use
# for old tokens.
STREAM_QOS = QoSProfile(depth=100, **_RELIABLE)
# The ~/generate and ~/import_capsule feedback, as ~/tokens: rclpy's default depth of 10 drops
# chunks of a fast turn for a consumer that takes a few ms per chunk. Transient local: a new
# client's reader can see the node's writer before the writer has seen the reader, and its
# first goal's first chunks, sent in between, reach it once the writer has.
FEEDBACK_QOS = QoSProfile(depth=100,
                          **dict(_RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL))
# ~/interrupt: an interrupt (e-stop, barge-in) is never dropped, even in a burst while the
# state group is busy. Publishers must be RELIABLE too.
INTERRUPT_QOS = QoSProfile(depth=1000, **_RELIABLE)
# ~/prompt, ~/reset, and ~/actions, ~/joint_trajectory: commands, and a controller needs every
# chunk in order while a stalled one should not pile up stale actions.
COMMAND_QOS = QoSProfile(depth=10, **_RELIABLE)
ACTIONS_QOS = COMMAND_QOS
# ~/instruction: the task in force; a node that starts (or restarts) late still gets it.
INSTRUCTION_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1,
                             reliability=ReliabilityPolicy.RELIABLE,
                             durability=DurabilityPolicy.TRANSIENT_LOCAL)
# ~/audio*: every chunk, in order (a lost one changes the transcript); the depth holds a few
# seconds of 20-80 ms chunks while a frame step or an interrupt runs.
AUDIO_QOS = QoSProfile(depth=200, **_RELIABLE)
# ~/observation*: BEST_EFFORT matches sensor publishers of either reliability; depth 1 because
# a control step acts on the newest observation, never on a backlog.
OBSERVATION_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1,
                             reliability=ReliabilityPolicy.BEST_EFFORT,
                             durability=DurabilityPolicy.VOLATILE)
# Camera images: as ~/observation*; depth 2 lets a frame wait while its joint state arrives.
IMAGE_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=2,
                       reliability=ReliabilityPolicy.BEST_EFFORT,
                       durability=DurabilityPolicy.VOLATILE)
# /diagnostics: the system default (reliable, depth 10), what diagnostic_aggregator expects.
DIAGNOSTICS_QOS = 10
