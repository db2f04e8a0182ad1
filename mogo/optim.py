"""HarmonizedOptimizer: a ``torch.optim.Optimizer`` that combines K objectives without conflict.

    opt = mogo.HarmonizedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4),
                                   objectives=["pick", "ocr"], harmonize_every=10, alpha_ema=0.9)
    opt.zero_grad()
    opt.backward(torch.stack([loss_pick, loss_ocr]), shared=kl_loss)
    opt.step()

``backward`` writes ``.grad``; ``step`` keeps its standard meaning and calls the wrapped
optimizer. ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's own, so LR
schedulers, ``GradScaler``, gradient clipping and checkpointing work unchanged.

A harmonizing ``backward(losses)`` runs five stages, each a method defined below it in this order:

1. finite? ``StepGuard.losses``: the losses and ``shared`` finite on every rank, or the
   non-finite policy acts (``mogo.nonfinite``);
2. ``_objective_grads``: the gradient rows, one per objective (two, one per half of the batch,
   with ``gram="cross_fitted"``), reduced across ranks by the layout;
3. ``_gram``: their Gram matrix over the harmonized parameters (a gradient that is not finite
   goes to the policy: ``StepGuard.gradients``), or with ``grad_ema`` that of their EMA
   (``mogo.tracking``);
4. ``_weigh``: the weighting's weights for what the ``gram`` option makes of it
   (``mogo.cross_fit``: the Gram matrix itself, or the cross-fitted estimate), and the weights
   the step applies, kept for the window's other micro-batches and the amortized steps
   (``_remember``: the amortizer's choice, smoothed with ``smooth_harmonized``);
5. ``_add_to_grads``: ``sum_k w_k g_k`` of the batch into ``.grad``; then the report.

Between harmonizations ``_backward_weighted`` replaces stages 2 to 5 by one backward of
``sum_k w_k L_k + shared``. A step is a *window*: ``zero_grad`` (or the last ``step``) opens it,
each ``backward`` runs the stages, and ``step`` closes it with ``harmonize`` (stages 3 to 5 on the
window's sums under ``accumulation="window"``, the layout's averaging of ``.grad``, and the
policy's one decision on the whole ``.grad``) and the wrapped optimizer's update. A skipped step
returns mogo's state to what it was when the window opened, through the components'
``load_state_dict``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from numbers import Integral
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor
from torch.autograd.profiler import record_function

from mogo.amortize import AmortizedWeights
from mogo.cross_fit import GRAM_ESTIMATES
from mogo.diagnostics import ConflictMeter, ConflictReport
from mogo.distributed import DataParallel, ShardedParameters, _Layout, as_parameter_grad
from mogo.gram import GramEstimate, host_float64
from mogo.jacobian import GradMode, objective_grads
from mogo.nonfinite import NonFinitePolicy, StepGuard
from mogo.optim_state import check_state_dict, has_state
from mogo.tracking import GradientTracker
from mogo.weighting import MinNorm, WeightedSum, Weighting, Weights

__all__ = ["HarmonizedOptimizer", "NonFinitePolicy"]

#: What a skipped step returns to: mogo's part of ``state_dict()``, and ``last_report``.
_Snapshot = tuple[dict[str, Any], ConflictReport | None]


class HarmonizedOptimizer(torch.optim.Optimizer):
    """Wrap any optimizer so that ``backward(losses)`` writes a harmonized gradient.

    On a harmonization step (every ``harmonize_every`` optimizer steps) it computes the K
    per-objective gradients from the one graph of ``losses``, their Gram matrix over the
    harmonized parameters, and the weighting's loss weights ``w``; every parameter then receives
    ``sum_k w_k grad L_k`` (plus ``grad shared``). Between harmonizations it backpropagates
    ``sum_k w_k L_k + shared`` once, with the cached, EMA-smoothed weights.

    Args:
        optimizer: the optimizer to wrap; it performs every parameter update.
        objectives: the objectives' names, or their number K.
        weighting: defaults to :class:`mogo.MinNorm` (MARBLE: unit-norm gradients, min-norm
            point, scaled to the mean gradient norm); :class:`mogo.WeightedSum` is the baseline.
            Weights that are not finite raise a ``ValueError`` naming it, whatever ``nonfinite``
            says: they are the weighting's fault, not the step's (:meth:`mogo.Weights.check`).
        harmonize_every: N, the optimizer steps between harmonizations (1: every step).
        alpha_ema: rho, the EMA decay of alpha across harmonizations (CR-MOGM's average, see
            ``mogo.amortize``), reused between them.
        smooth_harmonized: apply the smoothed alpha at harmonization steps too, as CR-MOGM does
            (with ``harmonize_every=1``, every step's weights are the average); by default a
            harmonization applies its own weights, as MARBLE does.
        grad_ema: beta in ``[0, 1)``: the weighting weighs the Gram matrix of an EMA of each
            objective's gradient across harmonizations (MoCo, ``mogo.tracking``), applied to
            this batch's gradients; it keeps K (2K with ``gram="cross_fitted"``) gradients of the
            harmonized parameters in memory, and as much again during a harmonization. 0 (the
            default) tracks nothing.
        params: the parameters whose gradients define the Gram matrix (e.g. a shared trunk or
            the LoRA weights); by default every trainable parameter of ``optimizer``.
        grad_mode: per-objective gradients ``"auto"``, ``"batched"`` or ``"sequential"``.
        nonfinite: what a NaN or Inf does, in a loss (``shared`` included) or in any gradient on
            any kind of step: ``"raise"`` a ``FloatingPointError`` naming the objective (or the
            parameter), ``"skip"`` the step (the parameters, the wrapped optimizer's state and
            mogo's own state stay bit for bit as they were; ``.grad`` is NaN, which a GradScaler
            reads as an overflow), or ``"drop"`` the objective for this step. What cannot be
            dropped skips the step under ``"drop"``: a non-finite shared loss, a NaN that reached
            the shared graph (autograd multiplies zero gradients by it, so every gradient is
            NaN), a non-finite gradient found after an amortized backward. Gradients that are
            all zero are no fault: the step adds zero (as a plain optimizer's would) and
            ``last_report`` shows zero norms. See ``docs/failures.rst`` and ``mogo.nonfinite``.
        sum_weights: weights of the weighted-sum baseline in the conflict diagnostics
            (equal weights by default).
        accumulation: with several ``backward`` calls per step, ``"first"`` solves for the
            weights on the window's first micro-batch and backpropagates them through the others,
            one pass each (the K-gradient cost is paid on one micro-batch per N steps);
            ``"window"`` keeps K gradient buffers over the window and solves on their sums at the
            boundary (:meth:`harmonize`, called by ``step``).
        distributed: across processes, :class:`mogo.DataParallel` (DDP or a replicated model)
            or :class:`mogo.ShardedParameters`; every rank then solves the same QP and takes the
            same non-finite decision.
        gram: what the weighting weighs. ``"same_batch"``: the Gram matrix of the batch's K
            gradients; ``backward`` takes ``(K,)`` losses. ``"cross_fitted"``: the estimate
            ``(G_12 + G_21) / 2`` of the Gram matrix of the *expected* gradients from two
            disjoint halves of the batch, free of the sampling noise on the batch's own Gram
            matrix (:func:`mogo.cross_fitted_gram`); ``backward`` takes ``(2, K)`` losses, row h
            the mean losses of half h, and the update is ``sum_k w_k`` times the gradient of the
            batch's ``losses.mean(0)``, as amortized steps backpropagate it. Each half is
            averaged over the ranks under :class:`mogo.DataParallel`; the report adds the
            cross-batch conflict measures (:class:`mogo.ConflictReport`).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        objectives: Sequence[str] | int,
        *,
        weighting: Weighting | None = None,
        harmonize_every: int = 1,
        alpha_ema: float = 0.0,
        params: Iterable[Tensor] | None = None,
        grad_mode: GradMode = "auto",
        nonfinite: NonFinitePolicy = "raise",
        sum_weights: Sequence[float] | None = None,
        accumulation: Literal["first", "window"] = "first",
        distributed: DataParallel | ShardedParameters | None = None,
        gram: Literal["same_batch", "cross_fitted"] = "same_batch",
        smooth_harmonized: bool = False,
        grad_ema: float = 0.0,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        names = _objective_names(objectives)
        self._guard: StepGuard[_Snapshot] = StepGuard(nonfinite, names, self._snapshot, self._restore)
        if grad_mode not in ("auto", "batched", "sequential"):
            raise ValueError(f"grad_mode must be 'auto', 'batched' or 'sequential', got {grad_mode!r}")
        if accumulation not in ("first", "window"):
            raise ValueError(f"accumulation must be 'first' or 'window', got {accumulation!r}")
        if accumulation == "window" and nonfinite == "drop":
            raise ValueError("nonfinite='drop' needs accumulation='first': a window sums every objective")
        if gram not in GRAM_ESTIMATES:
            raise ValueError(f"gram must be 'same_batch' or 'cross_fitted', got {gram!r}")
        if weighting is not None and not callable(weighting):
            raise TypeError(f"weighting must be callable (a mogo.Weighting), got {weighting!r}")
        if distributed is not None and not isinstance(distributed, DataParallel | ShardedParameters):
            raise TypeError(
                f"distributed must be mogo.DataParallel, mogo.ShardedParameters or None, got {distributed!r}"
            )
        self.optimizer = optimizer
        self.objectives = names
        self.weighting = MinNorm() if weighting is None else weighting
        self.amortizer = AmortizedWeights(harmonize_every, alpha_ema, smooth_harmonized)
        self.tracker = GradientTracker(grad_ema)
        self.grad_mode: GradMode = grad_mode
        self.sum_weights = None if sum_weights is None else _sum_weights(sum_weights, len(names))
        trainable = {id(p) for p in self._trainable()}
        chosen = self._trainable() if params is None else list(params)
        stray = [i for i, p in enumerate(chosen) if id(p) not in trainable]
        if stray:
            raise ValueError(f"params {stray} are not trainable parameters of the wrapped optimizer")
        self._harmonized = {id(p) for p in chosen}
        self.last_report: ConflictReport | None = None
        self.meter = ConflictMeter()
        self._workspace: list[Tensor] | None = None  # sequential K gradients, reused across steps
        self.accumulation = accumulation
        self.distributed = distributed
        self.gram = gram
        self._sampling = GRAM_ESTIMATES[gram]
        # torch.optim.Optimizer's hook dicts: register_*_hook and step's hooks (profile_hook_step) use them
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._open_window()

    # The wrapped optimizer's own dicts, so schedulers and GradScaler act on them.
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    @property
    def nonfinite(self) -> NonFinitePolicy:
        """The non-finite policy, ``"raise"``, ``"skip"`` or ``"drop"``; it may be changed between steps."""
        return self._guard.policy

    @nonfinite.setter
    def nonfinite(self, policy: NonFinitePolicy) -> None:
        self._guard.policy = policy

    @property
    def solves_next(self) -> bool:
        """Whether the next ``backward`` computes one gradient per objective (and solves the
        weighting on them, now or at the window's end), going through the losses' graph once per
        objective; otherwise it is one backward of the weighted sum. A compiled graph whose
        backward donates its buffers can be traversed once only: run the forward of such a step
        eagerly (``torch.compiler.set_stance("force_eager")``)."""
        return self._window.weights is None and self.amortizer.due

    # ---- one step: zero_grad, backward per micro-batch, step ---------------------------------

    @torch.optim.Optimizer.profile_hook_step  # torch's step hooks, and the step's profiler range
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        """Update the parameters with the wrapped optimizer, unless a non-finite step is skipped.

        ``closure``, if given, returns the K losses of a fresh forward pass; ``step`` then zeroes
        the gradients and calls ``backward`` on them itself, and returns the losses.
        """
        losses = None
        if closure is not None:
            with torch.enable_grad():
                self.zero_grad()
                losses = closure()
                self.backward(losses)
        self.harmonize()
        if not self._guard.skipped:
            self.optimizer.step()
            self.amortizer.step += 1
        self._open_window()
        return losses

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients and open a new window (its first ``backward`` may harmonize)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._open_window()

    def backward(self, losses: Tensor, shared: Tensor | None = None) -> None:
        """Accumulate the harmonized gradient of ``losses`` into ``.grad``: ``(K,)``, or
        ``(2, K)`` (two halves of the batch) with ``gram="cross_fitted"``.

        ``shared`` (a scalar, e.g. a KL term) is added with weight 1 and takes no part in the
        weighting. Call once per micro-batch; ``step`` ends the window. Its stages are listed
        in the docstring of the module ``mogo.optim``.

        Raises:
            ValueError, TypeError: ``losses`` is not a tensor of that shape, or ``shared`` not a
                scalar tensor.
            FloatingPointError: a loss or gradient is not finite under ``nonfinite="raise"``.
        """
        _check_losses(losses, shared, self.objectives, self._sampling.loss_shape(len(self.objectives)))
        self._window.final = False
        active = None if self._guard.skipped else self._guard.losses(losses, shared, self._layout)
        if active is None:
            return self._sit_out(losses)
        if not self.solves_next:  # weights known: one backward
            return self._backward_weighted(losses, shared, active)
        grads = self._objective_grads(losses, shared, active)
        if shared is not None:  # its row goes into .grad as it is; the others are weighted
            self._add_to_grads([None if g is None else g[-1] for g in grads])
            grads = [None if g is None else g[:-1] for g in grads]
        if self.accumulation == "window":
            return self._window.accumulate(grads, losses.detach())
        self._harmonize(grads, losses.detach()[..., active], active)

    def harmonize(self) -> None:
        """Make ``.grad`` final: with ``accumulation="window"``, solve on the window's summed
        gradients; under data parallelism without DDP, average ``.grad`` over the ranks; then
        the step's finiteness decision on every gradient. ``step`` calls it; call it yourself
        before clipping or unscaling gradients."""
        window = self._window
        if window.final:
            return
        window.final = True
        if self._guard.skipped:
            return
        sums = window.take_sums()
        if sums is not None:
            self._harmonize(*sums, torch.ones(len(self.objectives), dtype=torch.bool))
            if self._guard.skipped:
                return
        if window.local:
            self._layout.finish(self._trainable())
        self._guard.step_gradients(self._trainable(), self._layout)

    def _open_window(self) -> None:
        """Open the window of the next optimizer step: the guard keeps mogo's state (a skipped
        step returns to it), and the layout learns whether the window's first backward
        harmonizes."""
        self._window = _Window()
        self._guard.open()
        self._layout.expect(harmonizing=self.amortizer.due)

    def _sit_out(self, losses: Tensor) -> None:
        """A micro-batch of a skipped step adds nothing: skip the step if that is not done yet,
        after running the backward a DDP reducer waits for, contributing nothing."""
        if self._layout.reducer_waits():
            (losses.sum() * 0).backward()
        if not self._guard.skipped:
            self._guard.skip(self._trainable())

    def _backward_weighted(self, losses: Tensor, shared: Tensor | None, active: Tensor) -> None:
        """The short path: one backward of ``sum_k w_k L_k + shared`` with the window's weights
        (solved on its first micro-batch) or the cached ones; autograd writes ``.grad``, which a
        DDP reducer averages in the backward and :meth:`harmonize` otherwise."""
        window = self._window
        weights = window.weights if window.weights is not None else self.amortizer.loss_weights()
        weights = weights.to(device=losses.device, dtype=losses.dtype)
        batch = self._sampling.batch_losses(losses)
        # "drop": index, since 0 * NaN is NaN
        total = weights @ batch if bool(active.all()) else weights[active] @ batch[active]
        (total if shared is None else total + shared.reshape(())).backward()
        window.local = True

    def _objective_grads(self, losses: Tensor, shared: Tensor | None, active: Tensor) -> list[Tensor | None]:
        """The stacked gradients ``[R (+ 1), *p.shape]`` of the active objectives' rows (and of
        ``shared``, a last row), reduced across ranks; ``None`` for a parameter no loss depends
        on. Sequential gradients land in a workspace kept between harmonizations
        (``accumulation="first"``, whose harmonization consumes them at once)."""
        rows = self._sampling.rows(losses, active)
        if shared is not None:
            rows = torch.cat([rows, shared.reshape(1).to(rows.dtype)])
        params = self._trainable()
        out = None
        if self.accumulation == "first":
            shapes = [(rows.shape[0], *p.shape) for p in params]
            if self._workspace is None or [b.shape for b in self._workspace] != shapes:
                self._workspace = [p.new_empty(shape) for p, shape in zip(params, shapes, strict=True)]
            out = self._workspace
        with record_function("mogo.objective_grads"):
            grads, self.grad_mode = objective_grads(
                rows, params, mode=self.grad_mode, out=out, materialize_grads=False
            )
        return self._layout.reduce(grads, params, rows.shape[0])

    def _harmonize(self, grads: list[Tensor | None], losses: Tensor, active: Tensor) -> None:
        """Gram matrix, weights and ``.grad`` from the gradient rows of the ``A`` active
        objectives (one ``[R, *p.shape]`` or ``None`` per parameter, ``R`` rows for the
        ``losses``, ``(A,)`` or ``(2, A)``)."""
        sampling = self._sampling
        gram = self._gram(grads, losses.numel())
        host = host_float64(gram)
        finite = sampling.objectives_of(np.isfinite(host.diagonal()))  # G_rr is finite exactly when g_r is
        if not finite.all():
            kept = self._guard.gradients(torch.from_numpy(finite), active)
            if kept is None:  # e.g. a NaN that autograd spread into every gradient
                return self._guard.skip(self._trainable())
            # "drop": leave out the objectives with non-finite gradients
            rows, objectives = (torch.from_numpy(m) for m in (sampling.rows_of(finite), finite))
            grads = [None if g is None else g[rows.to(g.device)] for g in grads]
            gram = gram[rows.to(gram.device)][:, rows.to(gram.device)]
            losses, active, host = losses[..., objectives.to(losses.device)], kept, host[np.ix_(rows, rows)]
        weighed = self._tracked_gram(grads, gram, active)
        # every gradient zero, or (cross-fitted) no objective's signal above its noise
        zero = sampling.no_direction(host_float64(weighed))
        weights = self._weigh(sampling.weighed(weighed), sampling.batch_losses(losses), zero)
        if not zero:  # else a no-op step, reported, and the next batch harmonizes
            weights = self._remember(weights, active)
        row_weights = sampling.row_weights(weights.loss_weights)
        with record_function("mogo.combine"):
            self._add_to_grads([None if g is None else _combine(row_weights, g) for g in grads], owned=True)
        self.last_report = report = self._report(gram, weights, active)
        if not zero:
            self.meter.update(report)

    def _tracked_gram(self, grads: list[Tensor | None], gram: Tensor, active: Tensor) -> Tensor:
        """The Gram matrix the weighting weighs: ``gram``, that of the step's rows, or with
        ``grad_ema`` that of their EMA (the rows of the ``active`` objectives)."""
        if not self.tracker.tracking:
            return gram
        harmonized = [
            g if id(p) in self._harmonized else None for g, p in zip(grads, self._trainable(), strict=True)
        ]
        present = torch.from_numpy(self._sampling.rows_of(active.cpu().numpy()))
        return self._gram(self.tracker.update(harmonized, present), gram.shape[0])

    def _gram(self, grads: list[Tensor | None], rows: int) -> Tensor:
        """The ``(R, R)`` float64 Gram matrix of the harmonized parameters' gradient rows,
        the same on every rank (zeros when none of them has a gradient)."""
        with record_function("mogo.gramian"):
            harmonized = [
                g
                for g, p in zip(grads, self._trainable(), strict=True)
                if g is not None and id(p) in self._harmonized
            ]
            return self._layout.gram(harmonized, rows)

    def _weigh(self, gram: Tensor | GramEstimate, losses: Tensor, zero: bool) -> Weights:
        """The weighting's weights for ``gram`` and ``losses`` (A,), checked; weights 0
        when ``zero`` (no gradient, or no signal above the noise), where a weighting has no
        direction to find."""
        with record_function("mogo.weighting"):
            if zero:
                return _zero_weights(losses.shape[0], losses.device)
            # A weighting of one's own may return anything: NaN weights would make .grad NaN, and
            # the step would be skipped or blamed on the parameters.
            return self.weighting(gram, losses.to(torch.float64)).check(self.weighting)

    def _add_to_grads(self, updates: list[Tensor | None], *, owned: bool = False) -> None:
        """Add ``updates`` to ``.grad`` (``None``: no gradient, ``.grad`` stays as it
        is); ``owned`` updates are fresh tensors ``.grad`` may keep."""
        with torch.no_grad():
            for p, update in zip(self._trainable(), updates, strict=True):
                if update is None:
                    continue
                update = as_parameter_grad(update, p)
                if p.grad is None:
                    p.grad = update if owned else update.clone()
                else:
                    p.grad.add_(update)

    def _report(self, gram: Tensor, weights: Weights, active: Tensor) -> ConflictReport:
        """The diagnostics of a harmonization over the ``active`` objectives, from the Gram
        matrix of their gradient rows."""
        with record_function("mogo.report"):
            names = tuple(name for name, ok in zip(self.objectives, active.tolist(), strict=True) if ok)
            sum_weights = None if self.sum_weights is None else self.sum_weights[active.cpu()]
            batch, halves = self._sampling.report_grams(gram)
            return ConflictReport.from_gram(batch, weights, names, sum_weights, halves=halves)

    def _remember(self, weights: Weights, active: Tensor) -> Weights:
        """Keep a harmonization's weights, over all K objectives, in the amortizer's EMA cache,
        and return those the step applies (its own, or the smoothed ones), over the ``active``
        objectives; the window's other micro-batches apply them as well."""
        applied = self.amortizer.update(_expand(weights, active))
        self._window.weights = applied.loss_weights
        self._layout.expect(harmonizing=False)  # the window's other micro-batches are ordinary
        return _restrict(applied, active)

    def _trainable(self) -> list[Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad]

    @property
    def _layout(self) -> _Layout:
        return _ONE_PROCESS if self.distributed is None else self.distributed

    # ---- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``{"inner": wrapped optimizer's state_dict, "mogo": schedule, weights, statistics}``
        (the format: ``mogo.optim_state``)."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        state = {"inner": self.optimizer.state_dict(), "mogo": self._own_state()}
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, state)
            if result is not None:
                state = result
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`. The whole state is checked first: a bad one raises
        ``ValueError`` naming every bad field, and nothing (the wrapped optimizer included)
        changes."""
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        check_state_dict(state_dict, self.objectives, self.weighting, self.tracker, len(self._trainable()))
        self.optimizer.load_state_dict(state_dict["inner"])  # checks the parameter groups first
        self._load_own_state(state_dict["mogo"])
        self._open_window()
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _snapshot(self) -> _Snapshot:
        """What a skipped step returns to (the guard takes it as each window opens)."""
        return self._own_state(), self.last_report

    def _restore(self, snapshot: _Snapshot) -> None:
        own, self.last_report = snapshot
        self._load_own_state(own)

    def _own_state(self) -> dict[str, Any]:
        """mogo's part of :meth:`state_dict`: each component's own ``state_dict``."""
        state = {
            "objectives": list(self.objectives),
            "amortizer": self.amortizer.state_dict(),
            "grad_mode": self.grad_mode,
            "meter": self.meter.state_dict(),
        }
        if has_state(self.weighting):  # e.g. PCGrad's generator
            state["weighting"] = self.weighting.state_dict()
        if self.tracker.tracking:
            state["tracker"] = self.tracker.state_dict()
        return state

    def _load_own_state(self, state: dict[str, Any]) -> None:
        """Load mogo's part of a state checked by :func:`~mogo.optim_state.check_state_dict`,
        through each component's ``load_state_dict`` (the amortizer's tensors are replaced,
        never changed in place, so a snapshot of them stays as it was)."""
        self.amortizer.load_state_dict(state["amortizer"])
        self.meter.load_state_dict(state["meter"])
        self.grad_mode = state["grad_mode"]  # an "auto" fallback is found again on the next harmonization
        if has_state(self.weighting):
            self.weighting.load_state_dict(state["weighting"])
        if self.tracker.tracking:
            self.tracker.load_state_dict(state["tracker"])

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the distributed layout (its process group and module stay behind) and
        the gradient workspace."""
        return {**self.__dict__, "distributed": None, "_workspace": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return (
            f"HarmonizedOptimizer({self.optimizer.__class__.__name__}, objectives={list(self.objectives)}, "
            f"weighting={self.weighting!r}, harmonize_every={self.amortizer.harmonize_every}, "
            f"alpha_ema={self.amortizer.alpha_ema}, smooth_harmonized={self.amortizer.smooth_harmonized}, "
            f"gram={self.gram!r}, grad_ema={self.tracker.decay})"
        )


def _check_losses(losses: Any, shared: Any, objectives: tuple[str, ...], shape: tuple[int, ...]) -> None:
    """``ValueError`` or ``TypeError`` unless ``losses`` is a tensor of ``shape`` and ``shared`` a
    scalar tensor or None."""
    if not isinstance(losses, Tensor) or losses.shape != shape:
        got = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
        halves = " (two halves' losses, gram='cross_fitted')" if len(shape) == 2 else ""
        raise ValueError(
            f"losses must be a tensor of shape {shape}{halves} for objectives {objectives}, got {got}"
        )
    if shared is not None and not isinstance(shared, Tensor):
        raise TypeError(f"shared must be a scalar tensor (a loss) or None, got {type(shared).__name__}")
    if shared is not None and shared.numel() != 1:
        raise ValueError(f"shared must be a scalar tensor (a loss), got shape {tuple(shared.shape)}")


def _objective_names(objectives: Any) -> tuple[str, ...]:
    """The objectives' names, from K or from distinct strings (a string itself is no list of names)."""
    if isinstance(objectives, Integral) and not isinstance(objectives, bool):
        names = tuple(f"objective_{k}" for k in range(int(objectives)))
    elif isinstance(objectives, Iterable) and not isinstance(objectives, str | bytes):
        names = tuple(objectives)
    else:
        raise TypeError(f"objectives must be a count or a sequence of names, got {objectives!r}")
    if not all(isinstance(name, str) for name in names):
        raise TypeError(f"objective names must be strings, got {list(names)!r}")
    if not names or len(set(names)) != len(names):
        raise ValueError(f"objectives must be a positive count or distinct names, got {objectives!r}")
    return names


def _sum_weights(sum_weights: Sequence[float], K: int) -> Tensor:
    """``(K,)`` float64 weights of the diagnostics' weighted-sum baseline, checked as
    :class:`mogo.WeightedSum` checks its own."""
    if len(sum_weights) != K:
        raise ValueError(f"sum_weights has {len(sum_weights)} entries for {K} objectives")
    try:
        return WeightedSum(sum_weights).weights
    except (TypeError, ValueError) as error:
        raise ValueError(f"sum_weights: {error}") from None


def _zero_weights(objectives: int, device: torch.device) -> Weights:
    """Weights 0 for ``A = objectives`` objectives that give no direction."""
    zeros = torch.zeros(objectives, dtype=torch.float64, device=device)
    return Weights(zeros, torch.ones_like(zeros), zeros.new_zeros(()))


def _combine(weights: Tensor, stacked: Tensor) -> Tensor:
    """``sum_k w_k g_k`` of one parameter's ``[K, *p.shape]`` gradients, as one matrix-vector product."""
    flat = stacked.reshape(stacked.shape[0], -1)
    return (weights.to(device=flat.device, dtype=flat.dtype) @ flat).reshape(stacked.shape[1:])


def _restrict(weights: Weights, active: Tensor) -> Weights:
    """Weights over all K objectives, restricted to those of the ``(K,)`` mask ``active``."""
    mask = active.to(weights.alpha.device)
    return replace(weights, alpha=weights.alpha[mask], divisor=weights.divisor[mask])


def _expand(weights: Weights, active: Tensor) -> Weights:
    """Weights over the active objectives, scattered to all K of the ``(K,)`` mask ``active``
    (alpha 0, divisor 1 elsewhere)."""
    alpha = weights.alpha.new_zeros(active.shape[0])
    divisor = weights.divisor.new_ones(active.shape[0])
    mask = active.to(alpha.device)
    alpha[mask], divisor[mask] = weights.alpha, weights.divisor
    return replace(weights, alpha=alpha, divisor=divisor)


class _Window:
    """What the micro-batches of one optimizer step share, from ``zero_grad`` (or the last
    ``step``) to ``step``."""

    def __init__(self) -> None:
        self.weights: Tensor | None = None  # (K,) loss weights solved on this window's first micro-batch
        self.local = False  # an ordinary backward left rank-local gradients, for the layout to finish
        self.final = False  # harmonize() made .grad final
        self._sums: list[Tensor | None] | None = None  # summed K gradients (accumulation="window")
        self._losses: Tensor | None = None

    def accumulate(self, grads: list[Tensor | None], losses: Tensor) -> None:
        """Add a micro-batch's K gradients (one ``[K, *p.shape]`` or None per parameter) and
        losses ``(K,)`` to the window's sums (``accumulation="window"``)."""
        if self._sums is None:
            self._sums, self._losses = grads, losses.clone()
            return
        self._sums = [
            g if s is None else s if g is None else s + g for s, g in zip(self._sums, grads, strict=True)
        ]
        self._losses = self._losses + losses

    def take_sums(self) -> tuple[list[Tensor | None], Tensor] | None:
        """The summed gradients and losses, handed over once (their memory goes with them), or
        None when nothing was accumulated."""
        if self._sums is None:
            return None
        sums, self._sums, self._losses = (self._sums, self._losses), None, None
        return sums


_ONE_PROCESS = _Layout()
