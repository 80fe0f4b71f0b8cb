"""How many guesses a request verifies next: the draft length that makes its decoding fastest.

A step that verifies k guesses computes 1 + k rows. If each guess is accepted with probability a once the ones
before it were (prompt lookup's guesses run out at the first miss: a geometric model), the step yields on average
E(k) = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a) tokens, and it costs c(k) = t(1 + k) / t(1) of a plain step.
The length chosen is the k in 1..k_max with the highest E(k) / c(k), tokens per plain step's time.

Both sides are measured, not assumed:
- a, per request: accepted / (accepted + misses) over its recent verifications (a miss: a verification that ended
  before its last guess), each older one weighing DECAY times the next; before its first, a prior of one fully
  accepted run of k_max guesses (the length starts at k_max, as with a fixed length).
- t(r), per engine: a line t(r) = t1 + b (r - 1) fitted to the wall time of its decode steps (no prompt chunk)
  against the rows each computed (every request's row and guesses), least squares with each older step weighing
  1 - COST_WEIGHT times the next. A step's rows vary with the guesses found and the requests running, which is
  what the fit needs; until they have varied by MIN_ROWS_SPREAD rows the length is k_max. The costs follow the
  machine, the model and the context: on the bundled model a verified row costs about 0.14 of a plain step at
  512 tokens of context and 0.33 at 4k, where its attention dominates (docs/results/verify-step.txt).
With several requests in a step c(k) is still t(1 + k) / t(1), against a one-row step, which prices guesses
higher than their share of a batch's step: the batch keeps shorter drafts. Stepping down to k = 0 is the
back-off's decision (backoff.py), not this one's: a request that proposes nothing tells nothing more about its
acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.8  # an older verification's weight in a request's acceptance, relative to the next one
COST_WEIGHT = 0.05  # 1 - an older step's weight in the cost fit, relative to the next one
MIN_ROWS_SPREAD = 0.5  # the fit's weighted standard deviation of rows per step before it is used


def expected_tokens(a: float, k: int) -> float:
    """Tokens a step verifying k guesses yields on average at per-guess acceptance a (the model's own token
    included)."""
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass
class StepCosts:
    """The cost line t(r) = t1 + b (r - 1) of an engine's decode steps, from weighted sums of its steps."""

    w: float = 0.0  # sums of weights, weight x rows, x seconds, x rows^2, x rows x seconds
    wr: float = 0.0
    wt: float = 0.0
    wrr: float = 0.0
    wrt: float = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        keep = 1.0 - COST_WEIGHT
        self.w = keep * self.w + 1.0
        self.wr = keep * self.wr + rows
        self.wt = keep * self.wt + seconds
        self.wrr = keep * self.wrr + rows * rows
        self.wrt = keep * self.wrt + rows * seconds

    def line(self) -> tuple[float, float] | None:
        """(t1, b), or None while the rows have not varied enough to fit them."""
        spread = self.w * self.wrr - self.wr * self.wr  # w^2 x the weighted variance of rows
        if self.w <= 0 or spread < (MIN_ROWS_SPREAD * self.w) ** 2:
            return None
        b = (self.w * self.wrt - self.wr * self.wt) / spread
        t1 = (self.wt - b * self.wr) / self.w + b  # the intercept at one row
        return (t1, max(b, 0.0)) if t1 > 0 else None

    def ratio(self, rows: int) -> float | None:
        """t(rows) / t(1), or None until the line is fitted."""
        fit = self.line()
        return None if fit is None else line_ratio(fit, rows)


def line_ratio(fit: tuple[float, float], rows: int) -> float:
    """t(rows) / t(1) on the line fit = (t1, b)."""
    t1, b = fit
    return 1.0 + b * (rows - 1) / t1


@dataclass
class _Acceptance:
    accepted: float
    misses: float

    @classmethod
    def prior(cls, k_max: int) -> "_Acceptance":
        """Before a request's first verification: one fully accepted run of k_max guesses."""
        return cls(float(k_max), 1.0)


@dataclass
class DraftLength:
    costs: StepCosts = field(default_factory=StepCosts)
    _req: dict[str, _Acceptance] = field(default_factory=dict)

    def acceptance(self, req_id: str, k_max: int) -> float:
        st = self._req.get(req_id) or _Acceptance.prior(k_max)
        return st.accepted / (st.accepted + st.misses)

    def length(self, req_id: str, k_max: int) -> int:
        """The request's next draft length, 1..k_max."""
        fit = self.costs.line()
        if fit is None:
            return k_max
        a = self.acceptance(req_id, k_max)
        return max(range(1, k_max + 1), key=lambda k: expected_tokens(a, k) / line_ratio(fit, 1 + k))

    def record(self, req_id: str, proposed: int, accepted: int, k_max: int) -> None:
        """After a verification of `proposed` guesses of which the first `accepted` held."""
        st = self._req.get(req_id)
        if st is None:
            st = self._req[req_id] = _Acceptance.prior(k_max)
        st.accepted = DECAY * st.accepted + accepted
        st.misses = DECAY * st.misses + (1.0 if accepted < proposed else 0.0)

    def release(self, req_id: str) -> None:
        self._req.pop(req_id, None)
