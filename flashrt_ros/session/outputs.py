"""Where the session layer publishes and logs: implemented by the node, or by a test."""


class Outputs:
    """The session's side effects; every method may be called from any session thread."""

    def event(self, operation, name, tier, size_bytes, latency_ms, success, message,
              stamp=None, stages=()):
        """
        Report a capsule operation (stamp: now() of when it happened, default now).

        stages: an interrupt's [('received', wall time), (stage, wall time), ...], the
        stages of interrupts.STAGES it went through.
        """

    def evictions(self):
        """Report the capsules the lru budget policy evicted since the last call."""

    def chunk(self, turn, index, ids, text, stop_reason, final=False):
        """Stream a chunk of a turn's tokens (index: of its first token in the turn)."""

    def actions(self, step, rows, names, stamp=None):
        """
        Publish action rows [[a_0 .. a_A-1], ...] of the control step `step`.

        stamp: the stamp of the observation they answer (integer nanoseconds on the node's
        clock; None: now).
        """

    def transcript(self, utterance, index, ids, text, final, words=(), stamp=None):
        """
        Publish text tokens of a speech stream (index: frame of the first one).

        words: runtime Word records; stamp: the audio's time (integer ns; None: now).
        """

    def end_of_utterance(self, utterance, index, end, stamp=None):
        """Publish that the speaker stopped (end: a runtime EndOfUtterance; stamp as above)."""

    def start_goal(self, turn):
        """Tell a turn's caller it starts, or ended unstarted, so that it may report it."""

    def not_active_message(self):
        """Why requests are refused while the session is not active."""
        return 'not active'

    def now(self):
        """Return a stamp for an event happening at this moment, by the node's clock."""
        return None

    def log(self, level, message, throttle_s=None):
        """Log at 'info', 'warning' or 'error' (at most once per throttle_s seconds)."""
