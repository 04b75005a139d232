"""Image generators as policies: a flow-matching model whose actions are denoising steps (docs/images.md).

`shapes` is the bundled task and its verified checker, `flow` the model and the SDE sampler
that gives each step a likelihood (Flow-GRPO), `sampler` the rollout backend, `recipe` the
bundled model's build.
"""
