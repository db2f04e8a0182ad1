"""HarmonizedOptimizer: a ``torch.optim.Optimizer`` that combines K objectives without conflict.

    opt = mogo.HarmonizedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4),
                                   objectives=["pick", "ocr"], harmonize_every=10, alpha_ema=0.9)
    opt.zero_grad()
    opt.backward(torch.stack([loss_pick, loss_ocr]), shared=kl_loss)
    opt.step()

``backward`` writes ``.grad``; ``step`` keeps its standard meaning and calls the wrapped
optimizer. ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's own, so LR
schedulers, ``GradScaler``, gradient clipping and checkpointing work unchanged.

A step is a *window*: ``zero_grad`` (or the last ``step``) opens it with a copy of mogo's state,
each ``backward`` runs the stages below, and ``step`` closes it.

1. ``_finite_losses``: the losses and ``shared`` finite, agreed across ranks, or the policy acts;
2. ``_objective_grads``: the per-objective gradients, reduced across ranks by the layout;
3. ``_harmonize``: the Gram matrix, the weights, ``sum_k w_k g_k`` into ``.grad``;
4. ``harmonize`` (called by ``step``): the window's last reduction and one finiteness decision
   on the whole ``.grad``.

Between harmonizations, ``_backward_weighted`` replaces 2 and 3 by one backward of
``sum_k w_k L_k + shared``. ``_nonfinite`` is the one policy all checks share; a skipped step
restores the window's copy of mogo's state.
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from numbers import Integral
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor
from torch.autograd.profiler import record_function

from mogo.amortize import AmortizedWeights
from mogo.diagnostics import ConflictMeter, ConflictReport
from mogo.distributed import DataParallel, ShardedParameters, _Layout, as_parameter_grad, local_tensor
from mogo.gram import host_float64
from mogo.jacobian import GradMode, objective_grads
from mogo.weighting import MinNorm, WeightedSum, Weighting, Weights

__all__ = ["HarmonizedOptimizer", "NonFinitePolicy"]

NonFinitePolicy = Literal["raise", "skip", "drop"]


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
        alpha_ema: rho, the EMA decay of alpha reused between harmonizations.
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
            ``last_report`` shows zero norms. See ``docs/failures.rst``.
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
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        names = _objective_names(objectives)
        if nonfinite not in ("raise", "skip", "drop"):
            raise ValueError(f"nonfinite must be 'raise', 'skip' or 'drop', got {nonfinite!r}")
        if grad_mode not in ("auto", "batched", "sequential"):
            raise ValueError(f"grad_mode must be 'auto', 'batched' or 'sequential', got {grad_mode!r}")
        if accumulation not in ("first", "window"):
            raise ValueError(f"accumulation must be 'first' or 'window', got {accumulation!r}")
        if accumulation == "window" and nonfinite == "drop":
            raise ValueError("nonfinite='drop' needs accumulation='first': a window sums every objective")
        if weighting is not None and not callable(weighting):
            raise TypeError(f"weighting must be callable (a mogo.Weighting), got {weighting!r}")
        if distributed is not None and not isinstance(distributed, DataParallel | ShardedParameters):
            raise TypeError(
                f"distributed must be mogo.DataParallel, mogo.ShardedParameters or None, got {distributed!r}"
            )
        self.optimizer = optimizer
        self.objectives = names
        self.weighting = MinNorm() if weighting is None else weighting
        self.amortizer = AmortizedWeights(harmonize_every, alpha_ema)
        self.grad_mode: GradMode = grad_mode
        self.nonfinite: NonFinitePolicy = nonfinite
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
        self._begin_window()
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._patch_step_function()

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

    def _trainable(self) -> list[Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad]

    @property
    def _layout(self) -> _Layout:
        return _ONE_PROCESS if self.distributed is None else self.distributed

    # ---- one step: zero_grad, backward per micro-batch, step ---------------------------------

    def backward(self, losses: Tensor, shared: Tensor | None = None) -> None:
        """Accumulate the harmonized gradient of ``losses`` (K,) into ``.grad``.

        ``shared`` (a scalar, e.g. a KL term) is added with weight 1 and takes no part in the
        weighting. Call once per micro-batch; ``step`` ends the window.

        The stages: the losses' finiteness (agreed across ranks) -> per-objective gradients ->
        their reduction across ranks -> Gram matrix -> weights -> ``sum_k w_k g_k`` into
        ``.grad``. Between harmonizations the cached weights make the middle stages one
        backward of ``sum_k w_k L_k + shared``: autograd combines, the layout reduces.
        """
        self._check_arguments(losses, shared)
        window = self._window
        window.final = False
        if window.skipped:
            return self._release_reducer(losses)
        active = self._finite_losses(losses, shared)
        if active is None:
            self._release_reducer(losses)
            return self._skip()
        if window.weights is not None or not self.amortizer.due:  # weights known: the short path
            return self._backward_weighted(losses, shared, active)
        grads = self._objective_grads(losses, shared, active)
        if shared is not None:  # its row goes into .grad as it is; the others are weighted
            self._add_to_grads([None if g is None else g[-1] for g in grads])
            grads = [None if g is None else g[:-1] for g in grads]
        if self.accumulation == "window":
            return self._accumulate(grads, losses.detach())
        self._harmonize(grads, losses.detach()[active], active)

    def _check_arguments(self, losses: Tensor, shared: Tensor | None) -> None:
        K = len(self.objectives)
        if not isinstance(losses, Tensor) or losses.shape != (K,):
            shape = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
            raise ValueError(
                f"losses must be a tensor of shape ({K},) for objectives {self.objectives}, got {shape}"
            )
        if shared is not None and not isinstance(shared, Tensor):
            raise TypeError(f"shared must be a scalar tensor (a loss) or None, got {type(shared).__name__}")
        if shared is not None and shared.numel() != 1:
            raise ValueError(f"shared must be a scalar tensor (a loss), got shape {tuple(shared.shape)}")

    def _finite_losses(self, losses: Tensor, shared: Tensor | None) -> Tensor | None:
        """Stage 1: the ``(K,)`` mask of objectives this backward keeps (agreed across ranks), or
        None to skip the step. A non-finite shared loss cannot be dropped: it skips the step."""
        values = (
            losses.detach() if shared is None else torch.cat([losses.detach(), shared.detach().reshape(1)])
        )
        names = [*self.objectives, "shared"][: values.numel()]
        finite = self._layout.agree(torch.isfinite(values))
        keep = self._nonfinite(finite, names, "loss for objective(s)", values)
        if keep is None or not bool(keep[len(self.objectives) :].all()):
            return None
        return keep[: len(self.objectives)]

    def _backward_weighted(self, losses: Tensor, shared: Tensor | None, active: Tensor) -> None:
        """The short path: one backward of ``sum_k w_k L_k + shared`` with the window's weights
        (solved on its first micro-batch) or the cached ones; autograd writes ``.grad``, which a
        DDP reducer averages in the backward and :meth:`harmonize` otherwise."""
        window = self._window
        weights = window.weights if window.weights is not None else self.amortizer.loss_weights()
        weights = weights.to(device=losses.device, dtype=losses.dtype)
        # "drop": index, since 0 * NaN is NaN
        total = weights @ losses if bool(active.all()) else weights[active] @ losses[active]
        (total if shared is None else total + shared.reshape(())).backward()
        window.local = True

    def _objective_grads(self, losses: Tensor, shared: Tensor | None, active: Tensor) -> list[Tensor | None]:
        """Stages 2 and 3: the stacked gradients ``[A (+ 1), *p.shape]`` of the active losses (and
        of ``shared``, a last row), reduced across ranks; ``None`` for a parameter no loss
        depends on. Sequential gradients land in a workspace kept between harmonizations
        (``accumulation="first"``, whose harmonization consumes them at once)."""
        rows = losses[active]
        if shared is not None:
            rows = torch.cat([rows, shared.reshape(1).to(rows.dtype)])
        params = self._trainable()
        out = None
        if self.accumulation == "first":
            shapes = [(rows.shape[0], *p.shape) for p in params]
            if self._workspace is None or [b.shape for b in self._workspace] != shapes:
                self._workspace = [p.new_empty(shape) for p, shape in zip(params, shapes, strict=True)]
            out = self._workspace
        with _region("mogo.objective_grads"):
            grads, self.grad_mode = objective_grads(
                rows, params, mode=self.grad_mode, out=out, materialize_grads=False
            )
        return self._layout.reduce(grads, params, rows.shape[0])

    def _accumulate(self, grads: list[Tensor | None], losses: Tensor) -> None:
        """Add this micro-batch's K gradients to the window's buffers (``accumulation="window"``)."""
        window = self._window
        if window.buffers is None:
            window.buffers, window.buffered_losses = grads, losses.clone()
            return
        window.buffers = [
            g if b is None else b if g is None else b + g for b, g in zip(window.buffers, grads, strict=True)
        ]
        window.buffered_losses = window.buffered_losses + losses

    def _harmonize(self, grads: list[Tensor | None], losses: Tensor, active: Tensor) -> None:
        """Stages 4 to 6 on the gradients of the ``A`` active objectives (one ``[A, *p.shape]``
        or ``None`` per parameter) and their losses ``(A,)``: Gram matrix, weights, and
        ``sum_k w_k g_k`` added to ``.grad``."""
        params = self._trainable()
        with _region("mogo.gramian"):
            harmonized = [
                g for g, p in zip(grads, params, strict=True) if g is not None and id(p) in self._harmonized
            ]
            gram = self._layout.gram(harmonized, losses.shape[0])
        host = host_float64(gram)
        finite = np.isfinite(host.diagonal())  # G_kk = ||g_k||^2 is finite exactly when g_k is
        if not finite.all():
            flags = torch.ones(len(self.objectives), dtype=torch.bool)
            flags[active.cpu()] = torch.from_numpy(finite)
            if (
                self._nonfinite(flags, self.objectives, "gradient for objective(s)") is None
                or not finite.any()
            ):
                return self._skip()  # e.g. a NaN that autograd spread into every gradient
            rows = torch.from_numpy(finite)  # "drop": leave out the objectives with non-finite gradients
            grads = [None if g is None else g[rows.to(g.device)] for g in grads]
            gram, losses = gram[rows.to(gram.device)][:, rows.to(gram.device)], losses[rows.to(losses.device)]
            active, host = active & flags.to(active.device), host[np.ix_(finite, finite)]
        with _region("mogo.weighting"):
            zero = not bool((host.diagonal() > 0).any())
            # A weighting of one's own may return anything: NaN weights would make .grad NaN, and
            # the step would be skipped or blamed on the parameters.
            weights = (
                _zero_weights(gram)
                if zero
                else self.weighting(gram, losses.to(torch.float64)).check(self.weighting)
            )
        with _region("mogo.combine"):
            loss_weights = weights.loss_weights
            self._add_to_grads([None if g is None else _combine(loss_weights, g) for g in grads], owned=True)
        with _region("mogo.report"):
            names = tuple(name for name, ok in zip(self.objectives, active.tolist(), strict=True) if ok)
            sum_weights = None if self.sum_weights is None else self.sum_weights[active.cpu()]
            report = ConflictReport.from_gram(gram, weights, names, sum_weights)
        self.last_report = report
        if zero:  # no direction to learn from: a no-op step, reported, and the next batch harmonizes
            return
        expanded = self._expand(weights, active)
        self.amortizer.update(expanded)
        self.meter.update(report)
        self._window.weights = expanded.loss_weights
        self._layout.expect(harmonizing=False)  # the window's other micro-batches are ordinary

    def _add_to_grads(self, updates: list[Tensor | None], *, owned: bool = False) -> None:
        """Add ``updates`` to ``.grad`` (``None``: no gradient, ``.grad`` stays as it is);
        ``owned`` updates are fresh tensors ``.grad`` may keep."""
        with torch.no_grad():
            for p, update in zip(self._trainable(), updates, strict=True):
                if update is None:
                    continue
                update = as_parameter_grad(update, p)
                if p.grad is None:
                    p.grad = update if owned else update.clone()
                else:
                    p.grad.add_(update)

    def _expand(self, weights: Weights, active: Tensor) -> Weights:
        """Weights over the active objectives, scattered to all K (alpha 0, divisor 1 elsewhere)."""
        K = len(self.objectives)
        alpha = weights.alpha.new_zeros(K)
        divisor = weights.divisor.new_ones(K)
        mask = active.to(alpha.device)
        alpha[mask], divisor[mask] = weights.alpha, weights.divisor
        return Weights(alpha, divisor, weights.scale, weights.solve)

    def harmonize(self) -> None:
        """Make ``.grad`` final: with ``accumulation="window"``, solve on the window's summed
        gradients; under data parallelism without DDP, average ``.grad`` over the ranks; then
        the step's finiteness decision on every gradient. ``step`` calls it; call it yourself
        before clipping or unscaling gradients."""
        window = self._window
        if window.final:
            return
        window.final = True
        if window.buffers is not None:
            grads, losses = window.buffers, window.buffered_losses
            window.buffers = window.buffered_losses = None
            self._harmonize(grads, losses, torch.ones(len(self.objectives), dtype=torch.bool))
        if window.skipped:
            return
        if window.local:
            self._layout.finish(self._trainable())
        self._finite_gradients()

    def _finite_gradients(self) -> None:
        """The step's one decision on its gradient: every ``.grad`` (the shared loss's and every
        micro-batch's included) finite on every rank, or the policy acts. The sum of all entries
        is finite exactly when they are, but for a sum that overflows: only then are the
        entries themselves looked at."""
        grads = [(i, local_tensor(p.grad)) for i, p in enumerate(self._trainable()) if p.grad is not None]
        bad = []
        if grads:
            device = grads[0][1].device
            if not math.isfinite(float(torch.stack([g.sum().to(device) for _, g in grads]).sum())):
                bad = [i for i, g in grads if not bool(torch.isfinite(g).all())]
        if self._layout.all_ranks(not bad):  # every rank takes part, with gradients or without
            return
        where = [f"parameter {i}" for i in bad] if bad else ["another rank's parameters"]
        self._nonfinite(torch.zeros(len(where), dtype=torch.bool), where, "gradient in")
        self._skip()

    def _nonfinite(
        self, finite: Tensor, names: Sequence[str], what: str, values: Tensor | None = None
    ) -> Tensor | None:
        """The one non-finite policy, for losses, per-objective gradients and the step's gradient:
        the mask of ``finite`` entries (one per name, the same on every rank) to keep, or None
        when the step is skipped. ``"raise"`` raises ``FloatingPointError`` naming the bad ones,
        after rolling the window back (``step`` then does not update); ``"drop"`` keeps the
        finite ones, and skips when none is left."""
        if bool(finite.all()):
            return finite
        bad = [name for name, ok in zip(names, finite.tolist(), strict=True) if not ok]
        if self.nonfinite == "raise":
            self._skip(mark_gradients=False)
            shown = "" if values is None else f": {values.tolist()}"
            raise FloatingPointError(
                f"non-finite {what} {bad}{shown}. Pass nonfinite='skip' or "
                "'drop' to HarmonizedOptimizer to continue past such steps."
            )
        if self.nonfinite == "skip" or not bool(finite.any()):
            return None
        return finite

    def _skip(self, mark_gradients: bool = True) -> None:
        """Skip this step: mogo's state goes back to what it was when the window opened, later
        micro-batches do nothing, ``step`` does not update, and ``.grad`` is NaN, where a
        GradScaler finds the overflow and lowers its scale as it does for any optimizer."""
        window = self._window
        window.skipped, window.weights, window.buffers, window.buffered_losses = True, None, None, None
        window.restore(self)
        if mark_gradients:
            for p in self._trainable():
                p.grad = torch.full_like(p, float("nan"))

    def _release_reducer(self, losses: Tensor) -> None:
        """Run the backward a DDP reducer waits for, contributing nothing, on a skipped step."""
        if self._layout.reducer_waits():
            (losses.sum() * 0).backward()

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
        if not self._window.skipped:
            self.optimizer.step()
            self.amortizer.step += 1
        self._begin_window()
        return losses

    def _begin_window(self) -> None:
        """Open the window of the next optimizer step: remember mogo's state (a skipped step
        returns to it) and tell the layout whether the window's first forward harmonizes."""
        self._window = _Window(self)
        self._layout.expect(harmonizing=self.amortizer.due)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients and open a new window (its first ``backward`` may harmonize)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._begin_window()

    # ---- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``{"inner": wrapped optimizer's state_dict, "mogo": schedule, weights, statistics}``."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        state = {
            "inner": self.optimizer.state_dict(),
            "mogo": {
                "objectives": list(self.objectives),
                "amortizer": self.amortizer.state_dict(),
                "grad_mode": self.grad_mode,
                "meter": dict(vars(self.meter)),
            },
        }
        if _stateful(self.weighting):  # e.g. PCGrad's generator
            state["mogo"]["weighting"] = self.weighting.state_dict()
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
        if not isinstance(state_dict, dict) or set(state_dict) != {"inner", "mogo"}:
            keys = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(
                f"not a HarmonizedOptimizer state_dict: expected keys ['inner', 'mogo'], got {keys}"
            )
        problems = self._state_problems(state_dict)
        if problems:
            raise ValueError(f"invalid HarmonizedOptimizer state_dict: {'; '.join(problems)}")
        mine = state_dict["mogo"]
        amortizer = AmortizedWeights()
        amortizer.load_state_dict(mine["amortizer"])
        self.optimizer.load_state_dict(state_dict["inner"])  # checks the parameter groups first
        self.amortizer, self.grad_mode, self.meter = (
            amortizer,
            mine["grad_mode"],
            ConflictMeter(**mine["meter"]),
        )
        if _stateful(self.weighting):
            self.weighting.load_state_dict(mine["weighting"])
        self._begin_window()
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _state_problems(self, state_dict: dict[str, Any]) -> list[str]:
        """Every bad field of a state_dict with keys ``inner`` and ``mogo``, as ``"field: problem"``."""
        inner, mine = state_dict["inner"], state_dict["mogo"]
        problems = []
        if not isinstance(inner, dict) or not {"state", "param_groups"} <= set(inner):
            got = sorted(map(str, inner)) if isinstance(inner, dict) else type(inner).__name__
            problems.append(f"inner: not an optimizer state_dict (keys 'state', 'param_groups'), got {got}")
        if not isinstance(mine, dict):
            return [*problems, f"mogo: must be a dict, got {type(mine).__name__}"]
        fields = (
            "objectives",
            "amortizer",
            "grad_mode",
            "meter",
            *(("weighting",) if _stateful(self.weighting) else ()),
        )
        problems += [f"mogo.{field}: missing" for field in fields if field not in mine]
        problems += [f"mogo.{field}: unexpected" for field in sorted(map(str, set(mine) - set(fields)))]
        objectives = mine.get("objectives", list(self.objectives))
        if not isinstance(objectives, list | tuple) or tuple(objectives) != self.objectives:
            problems.append(
                f"mogo.objectives: state_dict is for objectives {objectives!r}, "
                f"this optimizer has {list(self.objectives)}"
            )
        if mine.get("grad_mode", "auto") not in ("auto", "batched", "sequential"):
            problems.append(
                f"mogo.grad_mode: must be 'auto', 'batched' or 'sequential', got {mine['grad_mode']!r}"
            )
        if "amortizer" in mine:
            amortizer = AmortizedWeights.state_problems(mine["amortizer"], len(self.objectives))
            problems += [f"mogo.amortizer.{problem}" for problem in amortizer]
        if "meter" in mine:
            problems += [f"mogo.meter.{problem}" for problem in ConflictMeter.state_problems(mine["meter"])]
        if _stateful(self.weighting) and "weighting" in mine:
            problems += [
                f"mogo.weighting.{problem}" for problem in self.weighting.state_problems(mine["weighting"])
            ]
        return problems

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
            f"alpha_ema={self.amortizer.alpha_ema})"
        )


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


def _stateful(weighting: Weighting) -> bool:
    """Whether a weighting has state of its own to checkpoint (``state_dict``, ``load_state_dict``
    and a ``state_problems`` check, as :class:`mogo.PCGrad`'s generator)."""
    return all(hasattr(weighting, name) for name in ("state_dict", "load_state_dict", "state_problems"))


def _zero_weights(gram: Tensor) -> Weights:
    """Weights 0 for ``A`` objectives (``gram``: ``(A, A)``) whose gradients are all zero."""
    A = gram.shape[0]
    zeros = torch.zeros(A, dtype=torch.float64, device=gram.device)
    return Weights(zeros, torch.ones_like(zeros), zeros.new_zeros(()))


class _Window:
    """What the micro-batches of one optimizer step share, from ``zero_grad`` (or the last
    ``step``) to ``step``; it begins with a copy of mogo's state, for a skipped step to return to."""

    def __init__(self, optimizer: HarmonizedOptimizer) -> None:
        self._saved = (
            copy.copy(vars(optimizer.amortizer)),
            copy.copy(vars(optimizer.meter)),
            optimizer.last_report,
            optimizer.grad_mode,
            optimizer.weighting.state_dict() if _stateful(optimizer.weighting) else None,
        )
        self.weights: Tensor | None = None  # (K,) loss weights solved on this window's first micro-batch
        self.skipped = False  # a non-finite value skipped the step
        self.local = False  # an ordinary backward left rank-local gradients, for the layout to finish
        self.final = False  # harmonize() made .grad final
        self.buffers: list[Tensor | None] | None = None  # summed K gradients (accumulation="window")
        self.buffered_losses: Tensor | None = None

    def restore(self, optimizer: HarmonizedOptimizer) -> None:
        """Put mogo's state back as it was when the window opened: the amortizer's schedule and
        cache (its tensors are replaced, never changed in place), the meter, ``last_report`` and
        ``grad_mode`` (an ``"auto"`` fallback is found again, on the next harmonization)."""
        amortizer, meter, optimizer.last_report, optimizer.grad_mode, weighting = self._saved
        vars(optimizer.amortizer).clear()
        vars(optimizer.amortizer).update(amortizer)
        vars(optimizer.meter).update(meter)
        if weighting is not None:
            optimizer.weighting.load_state_dict(weighting)


_ONE_PROCESS = _Layout()


# torch's own test of a running profiler (private; where it is missing, every range is recorded)
_profiler_enabled = getattr(torch._C._autograd, "_profiler_enabled", lambda: True)


def _region(name: str) -> AbstractContextManager:
    """A named range in ``torch.profiler`` traces while a profiler runs (``mogo.gramian``, ...);
    otherwise nothing, since a ``record_function`` costs about 10 us."""
    return record_function(name) if _profiler_enabled() else nullcontext()


def _combine(weights: Tensor, stacked: Tensor) -> Tensor:
    """``sum_k w_k g_k`` of one parameter's ``[K, *p.shape]`` gradients, as one matrix-vector product."""
    flat = stacked.reshape(stacked.shape[0], -1)
    return (weights.to(device=flat.device, dtype=flat.dtype) @ flat).reshape(stacked.shape[1:])
