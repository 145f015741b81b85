"""What an update rule is: ``UpdateRule``, one object per optimizer family that declares

* its moments (``MomentSpec``: the state key of each and whether it is signed, which picks
  the format an optimizer class stores it in), in the order its math takes them;
* its hyperparameters: ``check_hyperparameters`` (torch.optim's wording, before anything
  changes), ``keywords`` (a param group's values as its functional entry point takes them),
  ``scalar_values`` (the group's values under ``scalar_names``, copied into the
  0-d CPU tensors of ``hyperparams.GroupScalars``, so a schedule never recompiles);
* its math, once, in pure PyTorch: ``step_constants`` (per step count: bias corrections,
  schedules, bounds; 0-d tensors) and ``update`` (elementwise: the new parameter and
  moments from the parameter, a finite gradient and the moments). That function is the
  specification and the tests' oracle.

Its public functional entry point, keyword-only in torch's shape (``rules.adamw.adamw``,
``rules.lion.lion``, ``rules.ademamix.ademamix``), is what ``step`` calls and what every
optimizer class steps through (``functional.step_params``).

Everything else is generic over the rule (``rule_step``: the shared policies, quantized and
float moments, master weights, chunking; the optimizer base, checkpoints, FSDP2, offload,
the HF integration, ``state_bytes``). For the Triton step kernel a rule supplies its math a
second time, as the element-wise piece the kernel plugs between decoding and encoding the
moments (``kernel_update``, a ``@triton.jit`` function defined where Triton is installed) and
the per-step constants that piece reads (``kernel_constants``); the kernel applies the shared
policies (``step.kernels.step_kernel``). For the C++ CPU kernel the piece is a functor, named
in ``cpu_functor`` (``step/csrc/rules/<name>.h``, reading ``step_constants``' fields; the
kernel applies the shared policies, ``step/csrc/cpu_step_kernel.h``). Which implementation
steps each parameter is ``step.dispatch.implementation``'s choice, for every rule alike.
"""

from typing import NamedTuple

import torch

from lowbit_optim.step.rule_step import RuleEntry, RulePlan


class MomentSpec(NamedTuple):
    """One moment of a rule: its state key, whether its values can be negative (a signed
    format), whether only amsgrad keeps it and whether the rule's plan steps it factored
    (``FactoredState``)."""

    key: str
    signed: bool
    amsgrad_only: bool = False
    factorable: bool = False


class UpdateRule:
    """Base of the update rules (module docstring). Instances are stateless singletons: the
    compiled step is cached per rule object."""

    name: str
    moments: tuple[MomentSpec, ...]
    scalar_names: tuple[str, ...]
    # The Triton kernel's element-wise piece: ``(param, grad, moments, constants, VARIANT,
    # INTERPRETED) -> (new_param, new_moments)`` on float32 values, ``constants`` from
    # ``kernel_constants``. ``None``: the rule steps through the compiled step on every backend.
    kernel_update = None
    # The name of the C++ CPU kernel's functor of this rule (a row of ``csrc/cpu_step_kernel.h``'s
    # ``kFunctors``; it reads ``step_constants``' fields in their order, which
    # ``cpu_kernel.check_functor_constants`` checks), or None: the compiled step serves ``backend="cpu"``.
    cpu_functor: str | None = None

    def moment_keys(self, group: dict) -> tuple[str, ...]:
        """The moments a parameter of ``group`` keeps, in the order ``update`` takes them."""
        amsgrad = group.get("amsgrad", False)
        return tuple(spec.key for spec in self.moments if amsgrad or not spec.amsgrad_only)

    @property
    def all_moment_keys(self) -> tuple[str, ...]:
        return tuple(spec.key for spec in self.moments)

    def moment(self, key: str) -> MomentSpec:
        return next(spec for spec in self.moments if spec.key == key)

    def check_hyperparameters(self, group: dict) -> None:
        raise NotImplementedError

    def scalar_values(self, group: dict) -> dict:
        raise NotImplementedError

    def keywords(self, group: dict) -> dict:
        """The (checked) hyperparameters of ``group`` as the rule's entry point takes them."""
        raise NotImplementedError

    def step(self, params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict],
             **keywords) -> None:
        """The rule's functional entry point (``keywords``: its keyword-only arguments)."""
        raise NotImplementedError

    def step_constants(self, scalars, step: torch.Tensor):
        """What ``update`` reads at step count ``step`` (0-d float32), from the group's
        ``scalars``: 0-d CPU tensors, computed eagerly once per step count."""
        raise NotImplementedError

    def update(self, param, grad, moments: tuple, constants):
        """``(new_param, new_moments)``; ``grad`` is finite (the shared policy zeroed the rest)."""
        raise NotImplementedError

    def kernel_constants(self, constants) -> tuple[float, ...]:
        """``kernel_update``'s constants (Python floats, a NamedTuple in the order the piece
        unpacks them) from ``step_constants``' 0-d tensors."""
        raise NotImplementedError

    def for_step(self, options, *, exact_moments: bool) -> "UpdateRule":
        """The rule as a step with ``options`` (``hyperparams.StepOptions``) applies it to
        quantized (``exact_moments=False``) or float moments: itself, or a variant of it that
        takes the same ``step_constants`` (AdamW: torch.optim.Adam's L2 decay, the ratio clamp
        that only quantized moments need). Compiled steps are cached per variant."""
        return self

    def for_factored(self, options) -> "UpdateRule":
        """The rule as a step with ``options`` applies it to a parameter whose ``factorable``
        moment is factored (``step.factored``): a variant whose ``update`` takes that moment,
        reconstructed per element by the factored layout, read only, and returns the others."""
        raise NotImplementedError(f"{self!r} has no factored variant")

    def variants(self) -> tuple["UpdateRule", ...]:
        """Every rule ``for_step`` can return."""
        return (self,)

    def kernel_variant(self, scalars) -> int:
        """``kernel_update``'s compile-time switch for the group's ``scalars`` (0: none)."""
        return 0

    def plan(self, entries: list[RuleEntry], backend: str, params: list[torch.Tensor]):
        """The step of one param group's ``entries`` (this rank's tensors; ``params``: the
        parameters as the optimizer holds them), with a ``run(grads, scalars, options,
        scratch)`` method."""
        return RulePlan(self, entries, backend, params)

    def __repr__(self) -> str:
        return f"<update rule {self.name}>"
