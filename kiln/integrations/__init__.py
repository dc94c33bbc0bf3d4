"""Integrations of Kiln's compiled training step with training frameworks.

- `kiln.integrations.transformers.Trainer`: a drop-in `transformers.Trainer` whose training steps (forward,
  backward, gradient accumulation, clipping and the AdamW/Adam/SGD update) run in one Kiln program.

Each integration is imported on use, so `import kiln` never imports the framework.
"""
