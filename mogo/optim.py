"""HarmonizedOptimizer: a ``torch.optim.Optimizer`` that combines K objectives without conflict.

    opt = mogo.HarmonizedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4),
                                   objectives=["pick", "ocr"], harmonize_every=10, alpha_ema=0.9)
    opt.zero_grad()
    opt.backward(torch.stack([loss_pick, loss_ocr]), shared=kl_loss)
    opt.step()

``backward`` writes ``.grad``; ``step`` keeps its standard meaning and calls the wrapped
optimizer. ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's own, so LR
schedulers, ``GradScaler``, gradient clipping and checkpointing work unchanged.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal

import torch
from torch import Tensor
from torch.autograd.profiler import record_function

from mogo.amortize import AmortizedWeights
from mogo.diagnostics import ConflictMeter, ConflictReport
from mogo.distributed import DataParallel, ShardedParameters, as_parameter_grad, local_shards
from mogo.gram import gramian
from mogo.jacobian import GradMode, objective_grads
from mogo.weighting import MinNorm, Weighting, Weights

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
        harmonize_every: N, the optimizer steps between harmonizations (1: every step).
        alpha_ema: rho, the EMA decay of alpha reused between harmonizations.
        params: the parameters whose gradients define the Gram matrix (e.g. a shared trunk or
            the LoRA weights); by default every trainable parameter of ``optimizer``.
        grad_mode: per-objective gradients ``"auto"``, ``"batched"`` or ``"sequential"``.
        nonfinite: what a NaN or Inf loss (or harmonized gradient) does: ``"raise"`` a
            ``FloatingPointError`` naming the objective, ``"skip"`` the step (parameters and
            optimizer state stay untouched; ``.grad`` is NaN, which a GradScaler reads as an
            overflow), or ``"drop"`` the objective for this step. A NaN
            that reaches the shared graph (autograd multiplies zero gradients by it) makes every
            gradient non-finite; ``"drop"`` then skips the step.
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
        names = (
            tuple(f"objective_{k}" for k in range(objectives))
            if isinstance(objectives, int)
            else tuple(objectives)
        )
        if not names or len(set(names)) != len(names):
            raise ValueError(f"objectives must be a positive count or distinct names, got {objectives!r}")
        if nonfinite not in ("raise", "skip", "drop"):
            raise ValueError(f"nonfinite must be 'raise', 'skip' or 'drop', got {nonfinite!r}")
        if grad_mode not in ("auto", "batched", "sequential"):
            raise ValueError(f"grad_mode must be 'auto', 'batched' or 'sequential', got {grad_mode!r}")
        if accumulation not in ("first", "window"):
            raise ValueError(f"accumulation must be 'first' or 'window', got {accumulation!r}")
        if accumulation == "window" and nonfinite == "drop":
            raise ValueError("nonfinite='drop' needs accumulation='first': a window sums every objective")
        if sum_weights is not None and len(sum_weights) != len(names):
            raise ValueError(f"sum_weights has {len(sum_weights)} entries for {len(names)} objectives")
        self.optimizer = optimizer
        self.objectives = names
        self.weighting = MinNorm() if weighting is None else weighting
        self.amortizer = AmortizedWeights(harmonize_every, alpha_ema)
        self.grad_mode: GradMode = grad_mode
        self.nonfinite: NonFinitePolicy = nonfinite
        self.sum_weights = None if sum_weights is None else torch.tensor(sum_weights, dtype=torch.float64)
        trainable = {id(p) for p in self._trainable()}
        chosen = self._trainable() if params is None else list(params)
        stray = [i for i, p in enumerate(chosen) if id(p) not in trainable]
        if stray:
            raise ValueError(f"params {stray} are not trainable parameters of the wrapped optimizer")
        self._harmonized = {id(p) for p in chosen}
        self.last_report: ConflictReport | None = None
        self.meter = ConflictMeter()
        self._skip_step = False
        self._dropped = False  # an amortized backward left out a non-finite objective
        self._workspace: list[Tensor] | None = None  # sequential K gradients, reused across steps
        self._window_weights: Tensor | None = None  # weights solved in this step's window
        self.accumulation = accumulation
        self._buffers: list[Tensor] | None = None  # the window's summed K gradients ("window")
        self._buffered_losses: Tensor | None = None
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

    def backward(self, losses: Tensor, shared: Tensor | None = None) -> None:
        """Accumulate the harmonized gradient of ``losses`` (K,) into ``.grad``.

        ``shared`` (a scalar, e.g. a KL term) is added with weight 1 and takes no part in the
        weighting. Call once per micro-batch; ``step`` ends the window.
        """
        K = len(self.objectives)
        if not isinstance(losses, Tensor) or losses.shape != (K,):
            shape = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
            raise ValueError(
                f"losses must be a tensor of shape ({K},) for objectives {self.objectives}, got {shape}"
            )
        if shared is not None and shared.numel() != 1:
            raise ValueError(f"shared must be a scalar loss, got shape {tuple(shared.shape)}")
        if self._skip_step:
            self._release_reducer(losses)
            return
        values = (
            losses.detach() if self.distributed is None else self.distributed.agree_finite(losses.detach())
        )
        active = self._finite_objectives(values, "loss")
        if active is None:
            self._release_reducer(losses)
            self._mark_skipped()
            return
        if self.amortizer.due and self.accumulation == "window":
            self._accumulate(losses, shared)
        elif self.amortizer.due and self._window_weights is None:
            self._harmonize(losses, shared, active)
        else:
            weights = (
                self._window_weights if self._window_weights is not None else self.amortizer.loss_weights()
            )
            weights = weights.to(device=losses.device, dtype=losses.dtype)
            complete = bool(active.all())  # else "drop": index, since 0 * NaN is NaN
            total = weights @ losses if complete else weights[active] @ losses[active]
            (total if shared is None else total + shared.reshape(())).backward()
            self._dropped = self._dropped or not complete
            if self.distributed is not None:
                self.distributed.note_local_backward()

    def _release_reducer(self, losses: Tensor) -> None:
        """Run the backward a DDP reducer waits for, contributing nothing, on a skipped step."""
        if self.distributed is not None and self.distributed.expects_backward():
            (losses.sum() * 0).backward()

    def _finite_objectives(self, values: Tensor, what: str) -> Tensor | None:
        """The mask of objectives to keep, or None when the step is skipped; raises on "raise"."""
        finite = torch.isfinite(values)
        if bool(finite.all()):
            return finite
        bad = [name for name, ok in zip(self.objectives, finite.tolist(), strict=True) if not ok]
        if self.nonfinite == "raise":
            raise FloatingPointError(
                f"non-finite {what} for objective(s) {bad}: {values.tolist()}. "
                "Pass nonfinite='skip' or 'drop' to HarmonizedOptimizer to continue past such steps."
            )
        if self.nonfinite == "skip" or not bool(finite.any()):
            return None
        return finite

    def _mark_skipped(self) -> None:
        """Skip this step: ``step`` will not update, and ``.grad`` is NaN, where a GradScaler
        finds the overflow and lowers its scale as it does for any optimizer."""
        self._skip_step = True
        for p in self._trainable():
            p.grad = torch.full_like(p, float("nan"))

    def _objective_grads(
        self, losses: Tensor, shared: Tensor | None, active: Tensor, *, reuse: bool = False
    ) -> list[Tensor]:
        """Stacked gradients of the active losses (rows) and of ``shared`` (a last row, if given);
        ``reuse``: in the optimizer's workspace, kept between harmonizations, which the result
        must not outlive."""
        rows = losses[active]
        if shared is not None:
            rows = torch.cat([rows, shared.reshape(1).to(rows.dtype)])
        params = self._trainable()
        out = None
        if reuse:
            shapes = [(rows.shape[0], *p.shape) for p in params]
            if self._workspace is None or [b.shape for b in self._workspace] != shapes:
                self._workspace = [p.new_empty(shape) for p, shape in zip(params, shapes, strict=True)]
            out = self._workspace
        with _region("mogo.objective_grads"):
            grads, self.grad_mode = objective_grads(rows, params, mode=self.grad_mode, out=out)
        if self.distributed is None:
            return grads
        return self.distributed.reduce_grads([local_shards(g, p) for g, p in zip(grads, params, strict=True)])

    def _harmonize(self, losses: Tensor, shared: Tensor | None, active: Tensor) -> None:
        """Harmonize on this micro-batch and write the update (``accumulation="first"``)."""
        grads = self._objective_grads(losses, shared, active, reuse=True)
        n = int(active.sum())
        if shared is not None:
            self._add_to_grads([g[n] for g in grads])
        self._apply([g[:n] for g in grads], active, losses.detach()[active])
        if self.distributed is not None:
            self.distributed.after_harmonize()

    def _accumulate(self, losses: Tensor, shared: Tensor | None) -> None:
        """Add this micro-batch's K gradients to the window's buffers (``accumulation="window"``)."""
        K = len(self.objectives)
        grads = self._objective_grads(losses, shared, torch.ones(K, dtype=torch.bool, device=losses.device))
        if shared is not None:
            self._add_to_grads([g[K] for g in grads])
        if self._buffers is None:
            self._buffers, self._buffered_losses = [g[:K] for g in grads], losses.detach().clone()
        else:
            self._buffers = [b + g[:K] for b, g in zip(self._buffers, grads, strict=True)]
            self._buffered_losses = self._buffered_losses + losses.detach()

    def _add_to_grads(self, updates: list[Tensor], *, owned: bool = False) -> None:
        """Add ``updates`` to ``.grad``; ``owned`` updates are fresh tensors ``.grad`` may keep."""
        with torch.no_grad():
            for p, update in zip(self._trainable(), updates, strict=True):
                update = as_parameter_grad(update, p)
                if p.grad is None:
                    p.grad = update if owned else update.clone()
                else:
                    p.grad.add_(update)

    def _apply(self, rows: list[Tensor], active: Tensor, losses: Tensor) -> None:
        """Solve the weighting on the gradients ``rows`` (one ``[A, *p.shape]`` per parameter, for
        the ``A`` active objectives) and add ``sum_k w_k g_k`` to ``.grad``."""
        params = self._trainable()
        harmonized = [g for g, p in zip(rows, params, strict=True) if id(p) in self._harmonized]
        with _region("mogo.gramian"):
            gram = gramian(harmonized) if self.distributed is None else self.distributed.gram(harmonized)
        if not bool(torch.isfinite(gram).all()):
            finite_rows = torch.isfinite(gram).all(dim=1).cpu()
            values = torch.zeros(len(self.objectives), dtype=torch.float64)  # NaN marks a bad gradient
            values[active] = torch.where(finite_rows, 0.0, float("nan")).to(torch.float64)
            kept = self._finite_objectives(values, "gradient")
            if kept is None or not bool((kept & active).any()):
                self._mark_skipped()  # e.g. a NaN that autograd spread into every gradient
                return
            keep_rows = kept[active]  # "drop": leave out the objectives with non-finite gradients
            rows = [g[keep_rows.to(g.device)] for g in rows]
            gram = gram[keep_rows][:, keep_rows]
            losses = losses[keep_rows.to(losses.device)]
            active = active & kept
        with _region("mogo.weighting"):
            weights = self.weighting(gram, losses.to(torch.float64))
            expanded = self._expand(weights, active)
            self.amortizer.update(expanded)
        with _region("mogo.combine"):
            loss_weights = weights.loss_weights
            self._add_to_grads([_combine(loss_weights, g) for g in rows], owned=True)
        self._window_weights = expanded.loss_weights
        with _region("mogo.report"):
            names = tuple(name for name, ok in zip(self.objectives, active.tolist(), strict=True) if ok)
            sum_weights = None if self.sum_weights is None else self.sum_weights[active.cpu()]
            self.last_report = ConflictReport.from_gram(gram, weights, names, sum_weights)
            self.meter.update(self.last_report)

    def harmonize(self) -> None:
        """Make ``.grad`` final: with ``accumulation="window"``, solve on the window's summed
        gradients; under data parallelism without DDP, average ``.grad`` over the ranks. ``step``
        calls it; call it yourself before clipping or unscaling gradients."""
        if self._buffers is not None:
            buffers, losses = self._buffers, self._buffered_losses
            self._buffers = self._buffered_losses = None
            active = torch.ones(len(self.objectives), dtype=torch.bool, device=losses.device)
            self._apply(buffers, active, losses)
        if self.distributed is not None and not self._skip_step:
            self.distributed.finish(self._trainable())

    def _expand(self, weights: Weights, active: Tensor) -> Weights:
        """Weights over the active objectives, scattered to all K (alpha 0, divisor 1 elsewhere)."""
        K = len(self.objectives)
        alpha = weights.alpha.new_zeros(K)
        divisor = weights.divisor.new_ones(K)
        mask = active.to(alpha.device)
        alpha[mask], divisor[mask] = weights.alpha, weights.divisor
        return Weights(alpha, divisor, weights.scale, weights.solve)

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
        if self._dropped and not self._skip_step and not self._grads_finite():
            self._mark_skipped()  # the dropped objective's NaN reached the shared graph
        skipped, self._skip_step, self._window_weights = self._skip_step, False, None
        self._dropped = False
        if not skipped:
            self.optimizer.step()
            self.amortizer.step += 1
        self._begin_window()
        return losses

    def _grads_finite(self) -> bool:
        return all(bool(torch.isfinite(p.grad).all()) for p in self._trainable() if p.grad is not None)

    def _begin_window(self) -> None:
        """Tell the distributed layout whether the next step's first forward harmonizes."""
        if self.distributed is not None:
            self.distributed.begin_window(self.amortizer.due and self._window_weights is None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients and open a new window (its first ``backward`` may harmonize)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._skip_step, self._window_weights, self._dropped = False, None, False
        self._buffers = self._buffered_losses = None
        self._begin_window()

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
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, state)
            if result is not None:
                state = result
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; checks it before changing anything."""
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        if not isinstance(state_dict, dict) or set(state_dict) != {"inner", "mogo"}:
            keys = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(
                f"not a HarmonizedOptimizer state_dict: expected keys ['inner', 'mogo'], got {keys}"
            )
        mine = state_dict["mogo"]
        if tuple(mine.get("objectives", ())) != self.objectives:
            raise ValueError(
                f"state_dict is for objectives {mine.get('objectives')}, "
                f"this optimizer has {list(self.objectives)}"
            )
        amortizer = AmortizedWeights()
        amortizer.load_state_dict(mine["amortizer"])
        self.optimizer.load_state_dict(state_dict["inner"])
        self.amortizer = amortizer
        self.grad_mode = mine["grad_mode"]
        self.meter = ConflictMeter(**mine["meter"])
        self._begin_window()
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

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
