"""Adaptive back-off: a request whose recent guesses are mostly rejected stops guessing for a while.

Verifying k guesses costs k more token positions in the step; when few are accepted (prose that does
not repeat itself) that is pure overhead. After every verification the request's window of recent
(proposed, accepted) counts is checked: below `min_rate` accepted, proposals pause for `pause` of the
request's steps, and each further failed window after a pause doubles it (up to `max_pause`); a good
window resets it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class _State:
    window: deque[tuple[int, int]]
    skip: int = 0  # steps left without proposals
    pause: int = 0  # the next pause's length


@dataclass
class AdaptiveBackoff:
    window: int = 4  # verifications judged together
    min_rate: float = 0.3  # accepted / proposed below this over a full window: pause
    first_pause: int = 8
    max_pause: int = 128
    _req: dict[str, _State] = field(default_factory=dict)

    def _state(self, req_id: str) -> _State:
        st = self._req.get(req_id)
        if st is None:
            st = self._req[req_id] = _State(deque(maxlen=self.window), pause=self.first_pause)
        return st

    def should_propose(self, req_id: str) -> bool:
        """Called once per scheduled step of the request; counts paused steps down."""
        st = self._state(req_id)
        if st.skip > 0:
            st.skip -= 1
            return False
        return True

    def record(self, req_id: str, proposed: int, accepted: int) -> None:
        st = self._state(req_id)
        st.window.append((proposed, accepted))
        if len(st.window) < self.window:
            return
        p = sum(x for x, _ in st.window)
        a = sum(y for _, y in st.window)
        if a < self.min_rate * p:
            st.skip = st.pause
            st.pause = min(2 * st.pause, self.max_pause)
            st.window.clear()  # judged afresh after the pause
        else:
            st.pause = self.first_pause

    def paused(self, req_id: str) -> bool:
        st = self._req.get(req_id)
        return st is not None and st.skip > 0

    def release(self, req_id: str) -> None:
        self._req.pop(req_id, None)
