"""Vision-language policies: prompts with pictures (docs/multimodal.md).

`inputs`: image content parts read from data, encoded by the model's processor, carried to the
learner (`VisionInputs`), and the blank and shuffle controls; `model`: the bundled `tiny-count`;
`recipe`: how it is built (`assay pretrain tiny-count`).
"""
