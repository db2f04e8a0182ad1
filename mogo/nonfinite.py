"""What a NaN or Inf does to a :class:`~mogo.HarmonizedOptimizer` step: raise, skip or drop.

The policy wraps a step as optax's ``apply_if_finite`` wraps an update: the optimizer opens a
:class:`StepGuard` with each step, asks it at its checks and does what it answers, and a step
the guard skips goes back to the state the guard kept when the step opened. The checks:

* every ``backward``'s losses and ``shared`` loss (:meth:`StepGuard.losses`);
* a harmonization's K gradients, by the diagonal of their Gram matrix (:meth:`StepGuard.gradients`);
* the step's whole ``.grad``, once, before the update (:meth:`StepGuard.step_gradients`).

``"raise"`` raises ``FloatingPointError`` naming what is not finite, after going back (``step``
then does not update); ``"skip"`` skips the step; ``"drop"`` keeps the objectives that are
finite, and skips the step when none is left or when what is not finite cannot be dropped (the
shared loss, the step's ``.grad``). Finite flags are agreed across ranks before any rank acts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Generic, Literal, TypeVar, get_args

import torch
from torch import Tensor

from mogo.distributed import _Layout, local_tensor

__all__ = ["NonFinitePolicy", "StepGuard"]

NonFinitePolicy = Literal["raise", "skip", "drop"]

S = TypeVar("S")


class StepGuard(Generic[S]):
    """The non-finite policy over the steps of one optimizer.

    Args:
        policy: ``"raise"``, ``"skip"`` or ``"drop"`` (see the module).
        objectives: the K objectives' names, for messages.
        save: returns the state a skipped step goes back to; called as each step opens.
        restore: puts a state that ``save`` returned back in place.

    Raises:
        ValueError: an unknown policy (also when :attr:`policy` is set later).
    """

    def __init__(
        self,
        policy: NonFinitePolicy,
        objectives: Sequence[str],
        save: Callable[[], S],
        restore: Callable[[S], None],
    ) -> None:
        self.policy = policy
        self.objectives = tuple(objectives)
        self._save, self._restore = save, restore
        self._saved: S | None = None
        self.skipped = False  # the open step is skipped: it adds nothing more and does not update

    @property
    def policy(self) -> NonFinitePolicy:
        """What a non-finite value does: ``"raise"``, ``"skip"`` or ``"drop"``."""
        return self._policy

    @policy.setter
    def policy(self, policy: NonFinitePolicy) -> None:
        if policy not in get_args(NonFinitePolicy):
            raise ValueError(f"nonfinite must be 'raise', 'skip' or 'drop', got {policy!r}")
        self._policy = policy

    def open(self) -> None:
        """A step opens: keep the state to go back to."""
        self._saved, self.skipped = self._save(), False

    def losses(self, losses: Tensor, shared: Tensor | None, layout: _Layout) -> Tensor | None:
        """The ``(K,)`` bool mask of the objectives to keep, whose losses (``(K,)``, or
        ``(H, K)`` of H parts of the batch: every part's) are finite on every rank; None when
        the step is to be skipped (:meth:`skip`), a non-finite ``shared`` loss included, since
        it cannot be dropped."""
        K = len(self.objectives)
        values = losses.detach()
        finite = torch.isfinite(values.reshape(-1, K)).all(0)
        if shared is not None:
            values = torch.cat([values.reshape(-1), shared.detach().reshape(1)])
            finite = torch.cat([finite, torch.isfinite(shared.detach().reshape(1))])
        names = [*self.objectives, "shared"][: finite.numel()]
        keep = self._decide(layout.agree(finite), names, "loss for objective(s)", values)
        if keep is None or not bool(keep[K:].all()):
            return None
        return keep[:K]

    def gradients(self, finite: Tensor, active: Tensor) -> Tensor | None:
        """The ``(K,)`` mask of the objectives a harmonization keeps, given ``finite``, the
        ``(A,)`` flags of the ``A`` objectives of ``active`` (``(K,)`` bool) whose gradients are
        finite; None when the step is to be skipped. The flags are the same on every rank: they
        come from the reduced Gram matrix."""
        flags = torch.ones(len(self.objectives), dtype=torch.bool)
        flags[active.cpu()] = finite
        # flags holds the objectives dropped earlier as finite: none left is read from finite
        if self._decide(flags, self.objectives, "gradient for objective(s)") is None or not bool(
            finite.any()
        ):
            return None
        return active & flags.to(active.device)

    def step_gradients(self, params: Sequence[Tensor], layout: _Layout) -> None:
        """The step's one decision on its gradient: every ``.grad`` of ``params`` finite on
        every rank, or the step is skipped (under ``"drop"`` too: nothing is left to drop), or
        the error raised. The sum of all entries is finite exactly when they are, but for a sum
        that overflows: only then are the entries themselves looked at."""
        grads = [(i, local_tensor(p.grad)) for i, p in enumerate(params) if p.grad is not None]
        bad = []
        if grads:
            device = grads[0][1].device
            if not math.isfinite(float(torch.stack([g.sum().to(device) for _, g in grads]).sum())):
                bad = [i for i, g in grads if not bool(torch.isfinite(g).all())]
        if layout.all_ranks(not bad):  # every rank takes part, with gradients or without
            return
        where = [f"parameter {i}" for i in bad] if bad else ["another rank's parameters"]
        self._decide(torch.zeros(len(where), dtype=torch.bool), where, "gradient in")
        self.skip(params)

    def skip(self, params: Sequence[Tensor]) -> None:
        """Skip the open step: the state goes back to what it was when the step opened, and the
        ``.grad`` of ``params`` is NaN, where a ``GradScaler`` finds the overflow and lowers its
        scale as it does for any optimizer."""
        self._go_back()
        for p in params:
            p.grad = torch.full_like(p, float("nan"))

    def _decide(
        self, finite: Tensor, names: Sequence[str], what: str, values: Tensor | None = None
    ) -> Tensor | None:
        """The one policy of every check: the mask of ``finite`` entries (one per name, the
        same on every rank) to keep, or None when the step is to be skipped. ``"raise"`` goes
        back, then raises ``FloatingPointError`` naming the bad ones; ``"drop"`` keeps the
        finite ones, and skips when none is left."""
        if bool(finite.all()):
            return finite
        bad = [name for name, ok in zip(names, finite.tolist(), strict=True) if not ok]
        if self.policy == "raise":
            self._go_back()
            shown = "" if values is None else f": {values.tolist()}"
            raise FloatingPointError(
                f"non-finite {what} {bad}{shown}. Pass nonfinite='skip' or "
                "'drop' to HarmonizedOptimizer to continue past such steps."
            )
        if self.policy == "skip" or not bool(finite.any()):
            return None
        return finite

    def _go_back(self) -> None:
        """Mark the open step skipped and restore the state kept when it opened."""
        self.skipped = True
        self._restore(self._saved)
