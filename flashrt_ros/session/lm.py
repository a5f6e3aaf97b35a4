"""Language-model mode: generation turns streamed as token chunks."""

from flashrt_ros.runtime import BusyError, FlashRTError

from .modes import Mode

BUSY_MESSAGE = 'a generation is running; cancel it or publish ~/interrupt'


def _or_default(kind, value):
    """Return value as `kind`, or None (the checkpoint's default) when it is negative."""
    return None if value < 0 else kind(value)


class LMMode(Mode):
    """A causal language model: ~/generate goals and ~/prompt messages run as turns."""

    name = 'lm'
    kind = 'a language model'

    @staticmethod
    def serves(runtime):
        return not (runtime.is_policy or runtime.is_speech)

    def turn_refusal(self, source):
        return ''

    def prepare_home(self, system_prompt):
        if system_prompt:
            self.runtime.prefill(system_prompt)

    def _sampling(self, request):
        """Return the runtime's sampling keywords of a request (negative: the default)."""
        return {
            'max_new_tokens': int(request.max_new_tokens or self._param('max_new_tokens')),
            'temperature': _or_default(float, request.temperature),
            'top_k': _or_default(int, request.top_k), 'top_p': _or_default(float, request.top_p),
            'seed': None if request.seed < 0 else int(request.seed),
            'stop': tuple(request.stop) or tuple(self._param('stop_strings'))}

    def check_turn(self, request):
        try:
            self.runtime.sampling(**self._sampling(request))
        except FlashRTError as exc:
            return str(exc)
        return ''

    def run_turn(self, turn, should_stop):
        """Generate and stream the turn's tokens; return the runtime's result (None: failed)."""
        rt, request = self.runtime, turn.request
        try:
            gen = rt.generate(
                prompt=list(request.token_ids) if request.token_ids else (request.prompt or None),
                raw=bool(request.raw), **self._sampling(request))
        except FlashRTError as exc:
            turn.fail(BUSY_MESSAGE if isinstance(exc, BusyError) else str(exc), rt.position)
            return None
        chunk_size = self._param('token_chunk')
        ids, pieces = [], []
        try:
            if should_stop(turn) or turn.replaced_by:  # replaced before the slot was ours
                gen.close()
            for event in gen:
                ids.append(event.token_id)
                pieces.append(event.text)
                if len(ids) >= chunk_size:
                    self._out.chunk(turn, turn.streamed, ids, ''.join(pieces), '')
                    turn.streamed += len(ids)
                    ids, pieces = [], []
                if should_stop(turn):
                    gen.close()  # a cancel or an interrupt: stop at this step boundary
        except Exception as exc:
            gen.close()
            if gen.result is None:
                raise  # not the model: the scheduler reports it as a bug
            # The model step failed (out of memory, a NaN, ...): the runtime ended the turn
            # and put the state back; say so, and close the stream like any other turn.
            reason = gen.result.stop_reason
            where = ('the state is back at the last committed boundary' if reason == 'error'
                     else 'a waiting restore/rollback replaced the state')
            turn.fail(f'the model step failed: {exc!r}; {where} (position {rt.position})',
                      rt.position, reason, ids, ''.join(pieces))
            turn.result.text, turn.result.token_ids = gen.result.text, list(gen.result.token_ids)
            return None
        turn.final = ids, ''.join(pieces), gen.result.stop_reason
        return gen.result
