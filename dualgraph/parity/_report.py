"""What a comparison found: a :class:`LeafReport` per array leaf, and the :class:`ParityReport`."""

from __future__ import annotations

from dataclasses import dataclass

from ._tolerances import Tolerance

__all__ = ["LeafReport", "ParityReport"]


@dataclass(frozen=True)
class LeafReport:
    """How one array leaf compares (torch is "actual", JAX the reference).

    - ``max_abs``, ``max_rel``: the largest ``|torch - jax|`` and ``|torch - jax| / |jax|`` over
      the positions finite on both sides (integers: the exact largest difference, an ``int``).
    - ``scale``: the RMS of the reference's finite values, which ``atol`` multiplies.
    - ``score``: the worst ``|torch - jax| / (rtol * |jax| + atol * scale)``; at most 1 passes
      (integers and bools: 0 when equal, ``inf`` otherwise; ``inf`` too when NaN or infinity
      positions differ).
    - ``rel_l2``: ``||torch - jax|| / ||jax||``; ``cosine``: the cosine similarity of the two
      leaves (both ``None`` for integers and bools).
    - ``mismatched``: entries outside tolerance (integers: differing), NaN/inf positions that
      differ included; ``nonfinite``: positions NaN or infinite alike on both sides.
    - ``tolerance``: the limits applied (``None``: compared exactly).
    - ``ulps``: the most representable values an entry is apart from the reference's, where
      the tolerance limits them (``max_ulps``), else ``None``.
    - ``scale_error``, ``offset_error``: the leaf's systematic error, fitted as ``torch - jax =
      scale_error * jax + offset_error * rms`` (complex: magnitudes), and ``bias_usage`` the
      larger over its limit (see :class:`Tolerance`'s ``max_bias``); ``None`` where not limited.
    - ``unmatched_nonfinite``: entries NaN or infinite on one side only, or infinite of the
      other sign (counted in ``mismatched``; ``max_abs`` is over the finite ones), and
      ``first_unmatched`` the first of them, e.g. ``"[0, 3]: torch nan, JAX 0.5"``.
    - ``warning``: e.g. a leaf NaN everywhere on both sides (nothing compared); it fails unless
      the comparison allowed NaN. ``problem``: the two sides' leaves differ in dtype or shape.
    - ``note``: what the reason of a failing leaf adds, e.g. that torch gave no gradient there
      (read as zeros).
    """

    path: str
    dtype: str
    shape: tuple[int, ...]
    max_abs: float
    max_rel: float
    scale: float
    score: float
    rel_l2: float | None
    cosine: float | None
    mismatched: int
    tolerance: Tolerance | None
    nonfinite: int = 0
    warning: str | None = None
    problem: str | None = None
    allow_nan: bool = False
    ulps: int | None = None
    scale_error: float | None = None
    offset_error: float | None = None
    bias_usage: float | None = None
    unmatched_nonfinite: int = 0
    first_unmatched: str | None = None
    note: str | None = None

    @property
    def exact(self) -> bool:
        """Whether the leaf is compared exactly (integers, bools)."""
        return self.tolerance is None

    @property
    def ok(self) -> bool:
        """Within every limit, and no unallowed warning or problem."""
        return self.reason is None

    @property
    def usage(self) -> float:
        """The largest fraction of a limit the leaf uses: :attr:`score`, the relative L2 error
        over its limit, ``1 - cosine`` over ``1 - min_cosine``, or :attr:`bias_usage` (above 1:
        over the limit)."""
        limits = self.tolerance
        if limits is None or self.rel_l2 is None or self.cosine is None:
            return self.score
        return max(
            self.score,
            _fraction(self.rel_l2, limits.max_rel_l2),
            _fraction(1.0 - self.cosine, 1.0 - limits.min_cosine),
            self.bias_usage or 0.0,
        )

    @property
    def reason(self) -> str | None:
        """Why the leaf fails, in one line (its :attr:`note` last); ``None`` when it passes."""
        found = self._reason()
        return found if found is None or self.note is None else f"{found}; {self.note}"

    def _reason(self) -> str | None:
        if self.problem is not None:
            return self.problem
        if self.warning is not None and not self.allow_nan:
            return f"{self.warning} (pass allow_nan=True to accept it)"
        limits = self.tolerance
        if self.score > 1.0:
            if limits is None:
                return f"{self.mismatched} values differ (largest difference {self.max_abs})"
            steps = ""
            allowed = limits.max_ulps
            if self.ulps is not None and allowed is not None and self.ulps > allowed:
                steps = f", {self.ulps} values apart where {allowed} may be"
            unmatched = ""
            if self.unmatched_nonfinite:
                unmatched = (
                    f" where both are finite; {self.unmatched_nonfinite} NaN or infinite on one "
                    f"side only or of the other sign, first at {self.first_unmatched}"
                )
            if self.scale == 0.0 and self.max_abs > 0.0:  # every limit scales with the reference
                unmatched += (
                    "; the reference is 0 wherever it is finite (a fill aside), so its limits "
                    "are 0 and any nonzero entry fails"
                )
            return (
                f"{self.mismatched} values over tolerance, worst at {self.score:.3g}x "
                f"(max abs {self.max_abs:.3g}{steps}{unmatched})"
            )
        if limits is not None and self.rel_l2 is not None and self.rel_l2 > limits.max_rel_l2:
            return f"relative L2 error {self.rel_l2:.3g} > {limits.max_rel_l2:.3g}"
        if limits is not None and self.cosine is not None and self.cosine < limits.min_cosine:
            return f"cosine similarity {self.cosine:.10g} < {limits.min_cosine:.10g}"
        if self.bias_usage is not None and self.bias_usage > 1.0:
            return (
                f"systematic error beyond its rounding scatter ({self.bias_usage:.3g}x its limit):"
                f" torch = jax * (1 + {self.scale_error:.3g}) + {self.offset_error:.3g} x rms"
            )
        return None


@dataclass(frozen=True)
class ParityReport:
    """Every compared leaf (outputs, then input grads, then parameter grads) and the verdict.

    ``left_out``: the parameter grads not compared, each with why (a JAX params leaf made of
    frozen torch parameters only, or of none; a trained parameter of ``torch_fn`` given a
    gradient that ``torch_params`` leaves out), e.g. ``"grad params['table'] (no trained torch
    parameter behind it)"``, ``"grad of torch parameter 'bias' (trained, not in
    torch_params)"``; they do not change the verdict.

    ``str(report)`` is a table, the verdict and worst leaf in the header, the tolerances used
    (and the leaves left out) in the footer.
    """

    entries: tuple[LeafReport, ...]
    left_out: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """Whether every leaf passes (within tolerance, same direction, no unallowed NaN)."""
        return all(entry.ok for entry in self.entries)

    @property
    def worst(self) -> LeafReport | None:
        """The failing leaf furthest over a limit, else the leaf closest to one (by usage)."""
        return max(self.entries, key=lambda e: (not e.ok, e.usage), default=None)

    @property
    def worst_path(self) -> str | None:
        """The path of :attr:`worst`, e.g. ``output['hidden']`` or ``grad params['pos']``."""
        worst = self.worst
        return None if worst is None else worst.path

    @property
    def failures(self) -> tuple[LeafReport, ...]:
        """The leaves that fail."""
        return tuple(entry for entry in self.entries if not entry.ok)

    @property
    def warnings(self) -> tuple[LeafReport, ...]:
        """The leaves with a warning (allowed or not)."""
        return tuple(entry for entry in self.entries if entry.warning is not None)

    def __str__(self) -> str:
        left_out = ["left out: " + "; ".join(self.left_out)] if self.left_out else []
        return "\n".join([self._header(), *_table(self.entries), *_footer(self.entries), *left_out])

    def _header(self) -> str:
        worst = self.worst
        if worst is None:
            return "parity: nothing to compare (no array leaves)"
        warned = len(self.warnings)
        note = f"; {warned} warning{'s' * (warned > 1)}" if warned else ""
        if self.left_out:
            note += f"; {len(self.left_out)} left out"
        if self.ok:
            return (
                f"parity OK: {len(self.entries)} leaves within tolerance (worst: {worst.path} "
                f"at {worst.usage:.2g} of its tolerance{note})"
            )
        return (
            f"parity FAILED: {len(self.failures)} of {len(self.entries)} leaves (worst: "
            f"{worst.path}: {worst.reason}{note})"
        )


def _fraction(value: float, limit: float) -> float:
    if value <= 0.0:
        return 0.0
    return value / limit if limit > 0.0 else float("inf")


_TITLES = (
    "leaf",
    "dtype",
    "shape",
    "max abs",
    "max rel",
    "rms",
    "score",
    "rel l2",
    "cosine",
    "nan/inf",
    "",
)


def _table(entries: tuple[LeafReport, ...]) -> list[str]:
    rows = [_TITLES, *(_row(e) for e in entries)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_TITLES))]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]


def _row(e: LeafReport) -> tuple[str, ...]:
    status = "ok" if e.ok else f"FAIL: {e.reason}"
    if e.ok and e.warning is not None:
        status = f"ok, warning: {e.warning}"
    return (
        e.path,
        e.dtype,
        "[" + ", ".join(map(str, e.shape)) + "]",
        f"{e.max_abs:.3g}",
        "-" if e.exact else f"{e.max_rel:.3g}",
        "-" if e.exact else f"{e.scale:.3g}",
        f"{e.score:.3g}",
        "-" if e.rel_l2 is None else f"{e.rel_l2:.3g}",
        "-" if e.cosine is None else f"{e.cosine:.6f}",
        str(e.nonfinite) if e.nonfinite else "",
        status,
    )


def _footer(entries: tuple[LeafReport, ...]) -> list[str]:
    seen: dict[str, str] = {}
    for e in entries:
        t = e.tolerance
        if t is None:
            seen.setdefault(e.dtype, f"{e.dtype} exact")
        else:
            limits = (
                f"rtol {t.rtol:.2g}, atol {t.atol:.2g} x rms, rel l2 <= {t.max_rel_l2:.2g}, "
                f"cosine >= {t.min_cosine:.10g}"
            )
            if t.max_ulps is not None:
                limits += f", {t.max_ulps} ulp{'s' * (t.max_ulps != 1)} apart at most"
            if t.max_bias is not None:
                limits += f", scale and offset <= {t.max_bias:.2g} beyond scatter"
            seen.setdefault(e.dtype, f"{e.dtype} {limits}")
    return ["tolerances: " + "; ".join(seen.values())] if seen else []
