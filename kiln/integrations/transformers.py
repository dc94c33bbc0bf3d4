"""`kiln.integrations.transformers.Trainer`: `transformers.Trainer` training with a Kiln compiled step.

    from kiln.integrations.transformers import Trainer          # instead of transformers.Trainer
    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=ds, data_collator=collator)
    trainer.train()

Everything but the training step is the Trainer's own: data loading and collators (dynamic padding: Kiln's
dynamic shapes serve every batch length with one program), the optimizer and its parameter groups
(`create_optimizer()`: a torch AdamW with the no-decay groups), the lr scheduler (warm-up, decay), logging,
evaluation (the eager model, whose parameters Kiln updates in place), checkpoints (`optimizer.pt` is the
torch optimizer's state, which *is* the state Kiln updates) and resuming.

How the Trainer's loop is mapped onto one Kiln step (transformers 5.24 `Trainer._run_epoch`):
- `training_step` (once per micro-batch) calls `kiln.compile(model, optimizer=<the Trainer's torch
  optimizer>, accumulate=gradient_accumulation_steps, max_grad_norm=max_grad_norm, amp="bf16" if bf16)`: it
  adds the micro-batch's gradient to sums the step keeps, and the window's last micro-batch clips the summed
  gradient and runs the update, inside the compiled program.
- The loss is the Trainer's own `compute_loss` (so `num_items_in_batch` token normalisation over the whole
  accumulation window, `compute_loss_func` and label smoothing apply as in eager), scaled as `training_step`
  scales it for gradient accumulation. Kiln's accumulation divides each micro-batch's loss by N, so the
  compiled loss is N times the Trainer's (`_kiln_loss`) and the value returned (what the Trainer logs) is
  divided by N again: the same number eager logs, the same gradients eager sums.
- `compute_loss` (the Trainer's, or a subclass's override) is captured by `torch.export` when a program is
  compiled, like any model code: its tensor math runs in every step, its Python side effects (appending to a
  list, logging) only while compiling; a branch on a tensor's value is guarded like one in the model.
- A window shorter than N (the last of an epoch whose length N does not divide) starts Kiln's cycle with
  `N - k` micro-batches counted, so its update comes after its k micro-batches, and its loss is scaled by
  N / k as the Trainer scales it by 1 / k.
- The Trainer's own clipping (`_clip_grad_norm`) is skipped (no `.grad` exists; Kiln clipped inside the step);
  the `grad_norm` it logs is the norm the step computed before clipping (`step.grad_norm`; with
  `max_grad_norm=0` the step measures it without clipping, as the Trainer does), and its `optimizer.step()`
  is replaced, on the accelerate-wrapped optimizer of this Trainer only, by a check that the compiled step has run exactly one update since the previous `optimizer.step()`
  (`_optimizer_step`); `lr_scheduler.step()` and `zero_grad()` run as usual.

TrainingArguments Kiln cannot honour are refused with a KilnError naming them (`_refuse`): fp16 (Trainer's
GradScaler; use bf16), deepspeed, fsdp, torch_compile, gradient/activation checkpointing (use
`kiln_options={"memory_budget": ...}`), several GPUs or processes, liger kernels, NEFTune, parallelism_config,
and optimizers other than torch's AdamW/Adam/SGD.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import transformers

import kiln
from kiln.errors import KilnError

_OWN = ("optimizer", "loss_fn", "accumulate", "max_grad_norm", "amp")    # set from TrainingArguments


def _refuse(args) -> None:
    """Raise a KilnError naming the first TrainingArguments setting a Kiln-compiled step cannot honour."""
    checks = [
        ("fp16", args.fp16, "fp16=True uses the Trainer's GradScaler around loss.backward() and optimizer.step(), "
         "which the compiled step does not call; use bf16=True (Kiln's amp='bf16'), or fp32"),
        ("deepspeed", args.deepspeed, "DeepSpeed runs its own engine for forward, backward and update"),
        ("fsdp", args.fsdp, "FSDP shards the parameters across processes; Kiln compiles a single-process step "
         "(kiln.DataParallel serves data parallelism with kiln.optim optimizers)"),
        ("torch_compile", args.torch_compile, "Kiln compiles the training step itself; set torch_compile=False"),
        ("activation_checkpointing/gradient_checkpointing",       # one mirrors the other
         bool(getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", None)),
         "Kiln's generated backward does not re-run checkpointed forwards; pass "
         "kiln_options={'memory_budget': ...} to make Kiln recompute activations instead"),
        ("use_liger_kernel", args.use_liger_kernel, "Liger kernels patch the model with Triton kernels Kiln does "
         "not capture; Kiln fuses kernels itself"),
        ("neftune_noise_alpha", args.neftune_noise_alpha is not None, "NEFTune adds noise in an embedding forward "
         "hook, which is not part of the compiled step's contract"),
        ("parallelism_config", getattr(args, "parallelism_config", None) is not None,
         "tensor/context/sequence parallelism is not supported by the Kiln step"),
    ]
    for name, on, why in checks:
        if on:
            value = getattr(args, name, on)
            raise KilnError(f"kiln.integrations.transformers.Trainer does not support TrainingArguments({name}="
                            f"{getattr(value, 'value', value)!r}): {why}")
    if args.world_size > 1 or args.n_gpu > 1:
        raise KilnError(f"kiln.integrations.transformers.Trainer trains on one device in one process, got "
                        f"world_size={args.world_size}, n_gpu={args.n_gpu} (TrainingArguments / torchrun); use "
                        "one process (CUDA_VISIBLE_DEVICES=0), or kiln.compile(..., parallel=kiln.DataParallel())")


def _torch_optimizer(opt):
    """The torch optimizer under accelerate's AcceleratedOptimizer (or the optimizer itself)."""
    while not type(opt).__module__.startswith("torch.optim") and isinstance(getattr(opt, "optimizer", None),
                                                                           torch.optim.Optimizer):
        opt = opt.optimizer
    return opt


class Trainer(transformers.Trainer):
    """A `transformers.Trainer` whose training steps run as one Kiln program (see the module docstring).

    Takes the Trainer's arguments, plus `kiln_options`: further `kiln.compile` keyword arguments (dialects,
    memory_budget, dynamic (default True here: padded batches vary in length), tuning, nonfinite, ...; the
    optimizer, loss, accumulation, clipping and amp come from the Trainer and its TrainingArguments). After
    `train()` has started, `trainer.kiln_step` is the compiled step (`kiln.explain(trainer.kiln_step)`,
    `.cache_info()`).
    """

    def __init__(self, *args: Any, kiln_options: dict | None = None, **kwargs: Any):
        targs = kwargs.get("args", args[1] if len(args) > 1 else None)
        if targs is not None:               # before the Trainer sets anything up
            _refuse(targs)
        self.kiln_options = dict(kiln_options or {})
        taken = sorted(set(self.kiln_options) & set(_OWN))
        if taken:
            raise KilnError(f"kiln_options may not set {taken}: the Trainer's optimizer, compute_loss, "
                            "gradient_accumulation_steps, max_grad_norm and bf16 decide them")
        if self.kiln_options.get("nonfinite") == "skip":
            raise KilnError("kiln_options={'nonfinite': 'skip'} is not supported by the Kiln Trainer: the Trainer's "
                            "loop would count (and schedule) the skipped update; use 'raise' (the default: a "
                            "non-finite loss or gradient raises kiln.NonFiniteError with nothing written) or 'ignore'")
        super().__init__(*args, **kwargs)
        _refuse(self.args)
        self.kiln_step: kiln.CompiledStep | None = None
        self._kiln_key: tuple | None = None
        self._kiln_updates = 0              # updates the compiled step ran that optimizer.step() has not seen

    # ---- setting the step up, once per train() --------------------------------------------------
    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        self._kiln_setup(model)
        return model, train_dataloader

    def _kiln_setup(self, model) -> None:
        """Compile (or reuse) the Kiln step for this model and the Trainer's torch optimizer, and make the
        Trainer's `optimizer.step()` the check that the step has updated."""
        args = self.args
        opt = _torch_optimizer(self.optimizer)
        if type(opt) not in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD):
            raise KilnError(f"kiln.integrations.transformers.Trainer needs a torch.optim.AdamW, Adam or SGD "
                            f"(TrainingArguments(optim='adamw_torch'), the default, or optimizers=(...)), got "
                            f"{type(opt).__module__}.{type(opt).__qualname__} from optim="
                            f"{getattr(args.optim, 'value', args.optim)!r}")
        target = self.accelerator.unwrap_model(model)
        # the Trainer logs the gradient norm even when it does not clip (it measures with max_norm=inf)
        clip = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else math.inf
        amp = "bf16" if args.bf16 else None
        n = args.gradient_accumulation_steps
        key = (id(target), id(opt), n, clip, amp)
        if self.kiln_step is None or key != self._kiln_key:
            options = {"dynamic": True, **self.kiln_options}    # padding collators: every batch its own length
            self.kiln_step = kiln.compile(target, optimizer=opt, loss_fn=self._kiln_loss, accumulate=n,
                                          max_grad_norm=clip, amp=amp, **options)
            self._kiln_key = key
        self.kiln_step.reset_accumulation()  # an earlier train() interrupted mid-window leaves nothing behind
        self._kiln_updates = 0
        wrapped = self.optimizer

        def step(closure=None):
            self._optimizer_step(wrapped, closure)
        # torch's lr schedulers warn unless step() is still their wrapper; this one sets what theirs sets
        # (_opt_called). Only this Trainer's accelerate wrapper is patched; the torch optimizer is untouched
        step._wrapped_by_lr_sched = True
        wrapped.step = step

    def _optimizer_step(self, wrapped, closure=None) -> None:
        """What the Trainer's `optimizer.step()` does here: the update already ran inside the compiled step
        (on the window's last micro-batch); check that it ran exactly once since the previous call."""
        if closure is not None:
            raise KilnError("optimizer.step(closure) is not supported with the Kiln Trainer: the update runs "
                            "inside the compiled training step")
        if self._kiln_updates != 1:
            step = self.kiln_step
            raise KilnError(f"the Trainer called optimizer.step() after {self._kiln_updates} Kiln updates (expected "
                            f"exactly 1; {step.accumulated if step else 0} of {self.args.gradient_accumulation_steps} "
                            "micro-batches are summed): the training loop does not call training_step once per "
                            "micro-batch of each gradient accumulation window, as transformers 5.24's Trainer does")
        self._kiln_updates = 0
        wrapped._opt_called = True           # what the lr scheduler's wrapper of step() sets: no warning

    # ---- the training step ----------------------------------------------------------------
    def _kiln_loss(self, model, scale, num_items_in_batch, **inputs):
        """The loss the compiled step differentiates: the Trainer's `compute_loss`, times `scale` (N / k, or
        N when the loss is already normalised over the window), so that Kiln's loss / N is eager's loss."""
        return self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch) * scale

    def training_step(self, model, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        """One micro-batch through the Kiln step (the window's last also updates); returns the loss the
        eager Trainer returns (scaled for gradient accumulation as it scales it)."""
        step = self.kiln_step
        if step is None:
            raise KilnError("kiln.integrations.transformers.Trainer.training_step runs inside train() (which "
                            "compiles the Kiln step); call trainer.train()")
        model.train()
        inputs = self._prepare_inputs(inputs)
        n = step.accumulate
        k = getattr(self, "current_gradient_accumulation_steps", n)
        if step.accumulated == 0 and k < n:  # a short last window: its k-th micro-batch updates
            step.accumulated = n - k
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:                   # as Trainer.training_step decides it
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) \
                or self.compute_loss_func is not None
        scale = torch.tensor(float(n) if scaled else n / k, dtype=torch.float32)
        if num_items_in_batch is not None and not isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = torch.tensor(float(num_items_in_batch))   # a runtime input, not a recompile
        before = self.kiln_step.accumulated
        loss = step(scale, num_items_in_batch, **inputs)
        if step.accumulated == 0 and (n == 1 or before == n - 1):
            self._kiln_updates += 1
        return loss / n

    # ---- the Trainer's clipping: done inside the step -----------------------------------------
    def _clip_grad_norm(self, model):
        return self.kiln_step.grad_norm      # the compiled step clipped the summed gradient; its norm before

    def _get_grad_norm(self, model, grad_norm=None):
        return self.kiln_step.grad_norm if grad_norm is None else grad_norm
