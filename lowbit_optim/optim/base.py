"""``LowBitOptimizer``: an optimizer whose moments are stored in low bits, generic over its
update rule (``step.rules``); ``optim.adamw.LowBitAdamW`` is the drop-in ``torch.optim.AdamW``.

The public classes (``AdamW8bit``, ``Lion8bit``, ``AdEMAMix4bit``, ...) name their rule and
their signed and unsigned formats (``AdamWFactored4bit`` also says which second moments are
factored, ``is_factored``); all behaviour lives here. Parameters with at least
``min_quant_size`` elements get quantized moments (``QuantizedState``); smaller ones (biases,
norms) keep float32 moments (float64 for float64 parameters), which cost little and follow
the rule's exact arithmetic (``torch.optim.AdamW``'s, for AdamW) to within rounding.
With ``master_weight_bits`` (24 or 32), each bfloat16 or float16 parameter also keeps an integer
correction that makes it a 24- or 32-bit master weight (``master_weights``), kept right for
its parameter across casts of the model (``master_weight_casts``).
``param_groups`` keep the values the user wrote; the step reads them through 0-d CPU tensors
the optimizer owns (see ``hyperparams``). Their storage options (``block_size``, ``amsgrad``,
...) may be edited too: ``step()`` follows or refuses them (``group_options``).
"""

import torch
from torch.optim import Optimizer

from lowbit_optim.checkpoint import load as checkpoint
from lowbit_optim.formats.catalog import QuantFormat, check_block_size
from lowbit_optim.optim import group_options
from lowbit_optim.optim.master_weight_casts import MasterWeightCasts
from lowbit_optim.state import sharding
from lowbit_optim.step.chunks import GROUP_STREAM_BITS, TailScratch
from lowbit_optim.step.dispatch import resolve_backend
from lowbit_optim.step.functional import StepCache, check_gradients, with_gradients
from lowbit_optim.step.master_weights import (
    CORRECTION_KEY,
    check_master_weight_options,
    needs_correction,
    zeros_correction,
)
from lowbit_optim.step.math import compute_dtype
from lowbit_optim.step.rules.base import UpdateRule


def capturing_cuda_graph() -> bool:
    """Whether the current CUDA stream is capturing a graph (never before CUDA is initialised;
    the query itself fails on a build without CUDA)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


class LowBitOptimizer(Optimizer):
    """An optimizer whose moments are stored blockwise in low bits, for any update rule.

    Subclasses set ``rule`` (``step.rules``) and the formats of its signed and unsigned
    moments, and build ``defaults`` with ``_defaults`` from their own arguments (each keeps the
    signature its users know: torch's AdamW, bitsandbytes' Lion8bit, ...).
    """

    rule: UpdateRule
    signed_format: QuantFormat
    unsigned_format: QuantFormat
    # The active ``optim.release.GradientRelease``, if any: backward steps the parameters
    # then, and ``step()`` only ends the step.
    _gradient_release = None

    def __init__(self, params, defaults: dict, *, backend=None):
        self._init_step_helpers()
        super().__init__(params, defaults)
        # From the parameters' devices: None picks "triton" only when they are all CUDA.
        self.backend = resolve_backend(backend, self._devices())

    def _defaults(self, hyperparameters: dict, *, maximize=False, block_size=None, min_quant_size=4096,
                  bf16_stochastic_round=False, master_weight_bits=None) -> dict:
        """The group defaults: the rule's ``hyperparameters`` and the storage options every
        class takes (``block_size=None``: the signed format's default)."""
        if block_size is None:
            block_size = self.signed_format.default_block_size
        return dict(hyperparameters, maximize=maximize, block_size=block_size,
                    min_quant_size=min_quant_size, bf16_stochastic_round=bf16_stochastic_round,
                    master_weight_bits=master_weight_bits)

    def _init_step_helpers(self) -> None:
        """What the step keeps between calls besides ``state``: rebuilt, never saved."""
        self._tail_scratch = TailScratch()
        self._caches: list[StepCache] = []  # per param group: its planned step (step.functional)
        # Per param group index: its storage options as its state was last checked against them.
        self._storage_options: dict[int, tuple] = {}
        self._master_weights = MasterWeightCasts()

    def _devices(self) -> list[torch.device]:
        return [p.device for group in self.param_groups for p in group["params"]]

    def __getstate__(self):
        # torch's Optimizer pickles only defaults, state and param_groups; the backend choice
        # must survive copy.deepcopy and pickle too (the step helpers are rebuilt).
        return {**super().__getstate__(), "backend": self.backend}

    def __setstate__(self, state):
        # torch's __setstate__ (load_state_dict calls it) adds its own step's option to the
        # defaults where the class lacks it: groups added after a load would carry it, those
        # added before would not.
        differentiable = "differentiable" in state.get("defaults", self.__dict__.get("defaults", {}))
        super().__setstate__(state)
        if not differentiable:
            self.defaults.pop("differentiable", None)
        self._init_step_helpers()
        if "backend" not in self.__dict__:
            self.backend = resolve_backend(None, self._devices())
        for group in self.param_groups:
            self._fill_group_options(group)
        self._master_weights.remember_all(self.param_groups, self.state)

    def _fill_group_options(self, group: dict) -> None:
        """Options a group pickled by an older version lacks, at their defaults."""
        group.setdefault("maximize", False)
        group.setdefault("bf16_stochastic_round", False)
        group.setdefault("master_weight_bits", None)
        group.setdefault("block_size", self.signed_format.default_block_size)
        group.setdefault("min_quant_size", 4096)

    def load_state_dict(self, state_dict) -> None:
        """``torch.optim.Optimizer.load_state_dict``, checked first, float32 state kept float32.

        Also takes a ``torch.optim.AdamW`` state dict (its moments get quantized). A state dict
        that does not fit raises ``ValueError`` naming the parameter, with the optimizer left
        unchanged. See ``lowbit_optim.checkpoint`` and docs/checkpoints.md.
        """
        prepared = checkpoint.prepare_load(self, state_dict)
        super().load_state_dict(prepared.state_dict)
        prepared.finish(self)
        self._master_weights.remember_all(self.param_groups, self.state)

    # --- param groups -------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        candidate = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
        self._check_group(candidate)
        params = param_group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        elif not isinstance(params, set):  # torch refuses sets itself, with its own message
            # Consumed once here and handed on as a list: a generator (``m.parameters()``)
            # would otherwise reach torch exhausted and the group would silently be empty.
            params = list(params)
            param_group = {**param_group, "params": params}
        for param in params:
            tensor = _tensor_of(param)
            if isinstance(tensor, torch.Tensor):
                self._check_param(tensor)
        if not isinstance(params, set):
            self._refuse_duplicates(params)
        super().add_param_group(param_group)

    def _refuse_duplicates(self, params: list) -> None:
        """A parameter listed twice would be updated twice per step with one step count
        (torch.optim.AdamW warns that it will refuse it; parameters in two groups it refuses
        without naming them): refused here, named, before the group joins."""
        group_of = {id(other): index for index, group in enumerate(self.param_groups)
                    for other in group["params"]}
        positions: dict[int, int] = {}
        for position, param in enumerate(params):
            tensor = _tensor_of(param)
            name = f"{param[0]!r} " if tensor is not param else ""
            where = f"parameter {name}(shape {tuple(tensor.shape)}) at position {position}"
            if id(tensor) in positions:
                raise ValueError(
                    f"{type(self).__name__}: {where} of the new param group is the one at position "
                    f"{positions[id(tensor)]}: a parameter may appear only once in an optimizer"
                )
            positions[id(tensor)] = position
            if id(tensor) in group_of:
                raise ValueError(
                    f"{type(self).__name__}: {where} of the new param group is already in "
                    f"param group {group_of[id(tensor)]}: a parameter may appear only once in an "
                    "optimizer"
                )

    def _check_param(self, param: torch.Tensor) -> None:
        """Refuse a parameter this optimizer cannot step, before it joins a group."""
        if param.is_complex():
            raise ValueError(
                f"{type(self).__name__} does not support complex parameters "
                f"(got one of shape {tuple(param.shape)}, dtype {param.dtype}); "
                "view it as real with torch.view_as_real"
            )

    def _check_group(self, group: dict) -> None:
        self.rule_of(group).check_hyperparameters(group)
        if not isinstance(group["maximize"], bool):
            raise ValueError(f"Invalid maximize: {group['maximize']!r} (a bool is needed)")
        check_block_size(group["block_size"])
        min_quant_size = group["min_quant_size"]
        if not isinstance(min_quant_size, int) or isinstance(min_quant_size, bool) or min_quant_size < 0:
            raise ValueError(f"Invalid min_quant_size: {min_quant_size!r} (an int >= 0 is needed)")
        check_master_weight_options(group["master_weight_bits"], group["bf16_stochastic_round"])

    # --- what the optimizer stores: asked by checkpoint and distributed code too ------------
    @classmethod
    def rule_of(cls, group: dict) -> UpdateRule:
        """The rule that steps ``group``: ``rule``, for every group of a one-rule class
        (``optim.muon`` picks per group)."""
        return cls.rule

    @classmethod
    def all_moment_keys(cls) -> tuple[str, ...]:
        """Every moment key a group of this class can keep, over the rules it steps with."""
        return cls.rule.all_moment_keys

    @classmethod
    def moment_keys(cls, group: dict) -> tuple[str, ...]:
        """The moments a parameter of ``group`` has, in the rule's order (AdamW's
        ``max_exp_avg_sq`` only with amsgrad)."""
        return cls.rule_of(group).moment_keys(group)

    @classmethod
    def moment_format(cls, key: str) -> QuantFormat:
        """The format of quantized moment ``key``: the signed or the unsigned one, as the rule
        declares the moment."""
        return cls.signed_format if cls.rule.moment(key).signed else cls.unsigned_format

    @staticmethod
    def is_quantized(param: torch.Tensor, group: dict) -> bool:
        """Whether ``param``'s moments are quantized (else float32, float64 for float64).

        ``numel()`` of an FSDP2 (DTensor) parameter is its global size: the decision never
        depends on how it is sharded (see lowbit_optim.state.sharding)."""
        return param.numel() > 0 and param.numel() >= group["min_quant_size"]

    @classmethod
    def is_factored(cls, param: torch.Tensor, group: dict, key: str) -> bool:
        """Whether moment ``key`` of ``param`` is a ``FactoredState`` (row and column
        statistics, ``AdamWFactored4bit``) rather than blockwise codes or float values."""
        return False

    @classmethod
    def amsgrad_refusal(cls) -> str | None:
        """Why this class refuses ``amsgrad=True``, or ``None`` where it keeps amsgrad's maximum
        (its rule declares one)."""
        if any(spec.amsgrad_only for spec in cls.rule.moments):
            return None
        return (f"the {cls.rule.name} rule keeps no amsgrad maximum, its moments are "
                f"{', '.join(cls.rule.all_moment_keys)}")

    @classmethod
    def new_state(cls, param: torch.Tensor, *, amsgrad: bool = False, block_size: int | None = None,
                  min_quant_size: int = 4096, master_weight_bits: int | None = None) -> dict:
        """A new state for ``param`` as this class keeps it (its formats, the options as the
        class takes them), for stepping without an optimizer through the rule's functional
        entry point (``lowbit_optim.functional``)."""
        refusal = cls.amsgrad_refusal()
        if amsgrad and refusal is not None:
            raise ValueError(f"Invalid amsgrad: True ({cls.__name__} does not support amsgrad: {refusal})")
        group = dict(amsgrad=amsgrad, min_quant_size=min_quant_size, master_weight_bits=master_weight_bits,
                     block_size=cls.signed_format.default_block_size if block_size is None else block_size)
        check_block_size(group["block_size"])
        check_master_weight_options(master_weight_bits, False)
        state: dict = {}
        cls._init_state(param, group, state)
        return state

    @classmethod
    def _init_state(cls, param: torch.Tensor, group: dict, state: dict) -> None:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        for key in cls.moment_keys(group):
            if cls.is_factored(param, group, key):
                state[key] = sharding.zeros_factored_state(param)
            elif cls.is_quantized(param, group):
                state[key] = sharding.zeros_state(param, cls.moment_format(key), group["block_size"])
            else:
                state[key] = torch.zeros_like(param, dtype=compute_dtype(param),
                                              memory_format=torch.preserve_format)
        if needs_correction(param, group["master_weight_bits"]):
            state[CORRECTION_KEY] = zeros_correction(param, group["master_weight_bits"])

    # --- the step -----------------------------------------------------------------------
    def _check_grads(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """Refuse a bad gradient (called before any parameter or state is touched)."""
        check_gradients(params, grads, type(self).__name__)

    def _refuse_graph_capture(self) -> None:
        """A CUDA graph would replay this step with the LR, bias corrections and rounding
        noise of the step it captured: they are read on the host (from 0-d CPU tensors) at
        launch. Refused rather than replayed silently wrong."""
        if capturing_cuda_graph():
            raise RuntimeError(
                f"{type(self).__name__}.step() cannot be captured in a CUDA graph: it reads the "
                "learning rate, betas and step count on the host at every launch, so a replay "
                "would repeat the captured values. Run it outside the captured region (with "
                "torch.compile(mode='reduce-overhead') it already is: the step is a graph break)"
            )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._gradient_release is not None:
            self._gradient_release.end_step()
        else:
            self._step()
        return loss

    # Under the user's own torch.compile (the compiled-optimizer tutorial wraps opt.step()
    # and sched.step() in one compiled function) Dynamo skips this frame: the step runs as
    # it does uncompiled, through our own compiled kernels, and reads the LR and betas from
    # the groups at run time. Traced instead, the group's float LR and betas would become
    # guarded constants of the user's graph (one recompile per new value), and per-parameter
    # shapes would be baked in. Measured in docs/usage.md ("torch.compile around the step").
    @torch.compiler.disable(
        reason="lowbit_optim's step runs its own compiled kernels and is a graph break in a "
               "torch.compile'd caller, so fullgraph=True cannot include it: compile the "
               "caller with fullgraph=False (one graph either side of opt.step()), or call "
               "opt.step() outside the compiled function (docs/usage.md)"
    )
    def _step(self) -> None:
        self._refuse_graph_capture()
        # Every group's gradients, options and states are checked before anything changes:
        # the gradients through its kept plan's comparisons while that holds, else one by one;
        # the states against the options and the parameters' dtypes when either changed.
        stepped, changes = [], []
        try:
            for index, group in enumerate(self.param_groups):
                params, grads = with_gradients(group["params"])
                states = [*map(self.state.get, params)]
                held = self._cache(index).holds(self.rule_of(group), params, grads, states, self.backend)
                if not held:
                    self._check_grads(params, grads)
                self._check_group(group)
                changes.append(self._state_changes(index, group, () if held else group["params"]))
                stepped.append((params, grads, states))
        except Exception:
            # A refused group: the groups checked before it step nothing, and their caches
            # must not keep the gradient lists they accepted (nor their memory) alive.
            for cache in self._caches:
                cache.checked_grads = None
            raise
        for index, change in enumerate(changes):
            self._apply_state_changes(index, change)
        for index, (params, grads, states) in enumerate(stepped):
            self._step_params(index, params, grads, states)

    def _check_groups(self) -> None:
        """``step()``'s checks of every group's options and states, all before anything
        changes, for stepping that has no gradients to check first: gradient release, at the
        first hook of each backward (a group edited into something refused must not be
        refused only after other groups' parameters were stepped)."""
        changes = []
        for index, group in enumerate(self.param_groups):
            self._check_group(group)
            changes.append(self._state_changes(index, group, ()))
        for index, change in enumerate(changes):
            self._apply_state_changes(index, change)

    def _state_changes(self, index: int, group: dict, params) -> tuple[tuple, list]:
        """Group ``index``'s storage options, and what bringing its states in line with them
        and with ``params``' dtypes takes (``group_options``, ``master_weight_casts``), as
        calls that do it; refuses an option the states cannot follow. Nothing is modified."""
        options = group_options.snapshot(group)
        previous = self._storage_options.get(index)
        if options == previous and not params:  # the cached step's case: nothing to look at
            return options, []
        actions = []
        if options != previous:
            group_options.check_layouts(self, index, group, previous)
            actions += group_options.amsgrad_changes(self, group)
            params = group["params"]
        actions += self._master_weights.changes(type(self).__name__, params, self.state,
                                                group["master_weight_bits"])
        return options, actions

    def _apply_state_changes(self, index: int, change: tuple[tuple, list]) -> None:
        options, actions = change
        for action in actions:
            action()
        if actions:  # the group's plan, checked with the states as they were, plans again
            self._cache(index).checked_grads = None
        self._storage_options[index] = options

    def _sync_master_weights(self) -> None:
        """Bring every correction in line with its parameter's dtype and group
        (``master_weight_casts``), as the next step would, for code that reads or writes them."""
        for group in self.param_groups:
            for action in self._master_weights.changes(type(self).__name__, group["params"], self.state,
                                                       group["master_weight_bits"]):
                action()

    def _step_params(self, index: int, params: list[torch.Tensor], grads: list[torch.Tensor],
                     states: list | None = None, cache: StepCache | None = None) -> None:
        """Step ``params`` of param group ``index`` with ``grads`` (checked), creating the
        states they lack (``states``: theirs, ``None`` where missing, if already looked up),
        through the rule's functional entry point: the one call every way of stepping
        (``step``, gradient release) makes. ``cache``: where the planned step of these
        ``params`` is kept (default: the group's, for all its parameters that have a gradient)."""
        group = self.param_groups[index]
        if states is None:  # gradient release: step()'s checks of the group, for these parameters
            self._check_group(group)
            self._apply_state_changes(index, self._state_changes(index, group, params))
        if states is None or not all(states):
            states = [*map(self.state.__getitem__, params)]
            for param, state in zip(params, states):
                if not state:
                    self._init_state(param, group, state)
                    self._master_weights.remember(param, state)
        rule = self.rule_of(group)
        rule.step(params, grads, states, **rule.keywords(group), maximize=group["maximize"],
                       stochastic_round=group["bf16_stochastic_round"],
                       rounding_stream=(sharding.rank() << GROUP_STREAM_BITS) | index,
                       backend=self.backend, cache=cache or self._cache(index))

    def _cache(self, index: int) -> StepCache:
        while len(self._caches) <= index:
            self._caches.append(StepCache(self._tail_scratch))
        return self._caches[index]


def _tensor_of(param):
    """The tensor of a params entry: ``named_parameters()`` gives (name, parameter) pairs,
    which torch accepts."""
    return param[1] if isinstance(param, tuple) and len(param) == 2 else param
