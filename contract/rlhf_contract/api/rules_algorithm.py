"""Rules of `algorithm.rolloutCorrection` (and its deprecated alias `algorithm.tisCap`): which
thresholds a mode needs, and that they make a band around 1. Single-field bounds (a threshold
above 0) live on the fields (task.py)."""

from __future__ import annotations

from .rule import Rule
from .task import MASK_MODES

_SET = "(has(self.algorithm) && has(self.algorithm.rolloutCorrection))"
_RC = "self.algorithm.rolloutCorrection"
_MODE = f"(has({_RC}.mode) ? {_RC}.mode : 'tis')"
_MASK = f"({_MODE} in {list(MASK_MODES)})"


def _rc(s):
    return s.algorithm.rollout_correction


CORRECTION_RULES: tuple[Rule, ...] = (
    Rule(
        field_path="algorithm.tisCap",
        cel=f"!has(self.algorithm) || !has(self.algorithm.tisCap) || !{_SET}",
        message="is deprecated and cannot be set beside algorithm.rolloutCorrection: tisCap C means "
        "rolloutCorrection {mode: tis, upper: C}; keep only rolloutCorrection",
        check=lambda s: s.algorithm.tis_cap is None or _rc(s) is None,
    ),
    Rule(
        field_path="algorithm.rolloutCorrection.upper",
        cel=f"!{_SET} || !{_MASK} || has({_RC}.upper)",
        message="is required with mode token-mask, sequence-mask or two-sided-mask: the largest importance "
        "ratio kept (e.g. 2.0); set it, or use mode tis (which defaults to a cap of 2.0)",
        check=lambda s: _rc(s) is None or _rc(s).mode not in MASK_MODES or _rc(s).upper is not None,
        detail=lambda s: f"mode {_rc(s).mode}",
    ),
    Rule(
        field_path="algorithm.rolloutCorrection.lower",
        cel=f"!{_SET} || {_MODE} != 'two-sided-mask' || has({_RC}.lower)",
        message="is required with mode two-sided-mask: tokens whose importance ratio is below it are masked "
        "(IcePop uses 0.5); set it, or use token-mask for an upper bound alone",
        check=lambda s: _rc(s) is None or _rc(s).mode != "two-sided-mask" or _rc(s).lower is not None,
    ),
    Rule(
        field_path="algorithm.rolloutCorrection.lower",
        cel=f"!{_SET} || {_MODE} != 'tis' || !has({_RC}.lower)",
        message="is not used by mode tis (it truncates weights above upper only); remove it, or use "
        "two-sided-mask to mask tokens below a lower bound",
        check=lambda s: _rc(s) is None or _rc(s).mode != "tis" or _rc(s).lower is None,
    ),
    Rule(
        field_path="algorithm.rolloutCorrection.lower",
        cel=f"!{_SET} || !has({_RC}.lower) || !has({_RC}.upper) || {_RC}.lower <= {_RC}.upper",
        message="must not exceed algorithm.rolloutCorrection.upper: tokens are kept where lower <= ratio <= upper",
        check=lambda s: _rc(s) is None or _rc(s).lower is None or _rc(s).upper is None or _rc(s).lower <= _rc(s).upper,
        detail=lambda s: f"got lower {_rc(s).lower}, upper {_rc(s).upper}",
    ),
    Rule(
        field_path="algorithm.rolloutCorrection.lower",
        cel=f"!{_SET} || !has({_RC}.lower) || {_RC}.lower <= 1.0",
        message="must be at most 1: a token whose ratio is 1 (trainer and rollout engine agree) would be masked",
        check=lambda s: _rc(s) is None or _rc(s).lower is None or _rc(s).lower <= 1.0,
        detail=lambda s: f"got {_rc(s).lower}",
    ),
    Rule(
        field_path="algorithm.rolloutCorrection.upper",
        cel=f"!{_SET} || !{_MASK} || !has({_RC}.upper) || {_RC}.upper >= 1.0",
        message="must be at least 1 with a mask mode: a token whose ratio is 1 (trainer and rollout engine "
        "agree) would be masked",
        check=lambda s: _rc(s) is None or _rc(s).mode not in MASK_MODES or _rc(s).upper is None or _rc(s).upper >= 1.0,
        detail=lambda s: f"got {_rc(s).upper}",
    ),
)
