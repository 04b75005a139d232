"""The bundled tiny vision-language model.

A VLM folder is an ordinary Hugging Face folder whose `config.json` has a `vision_config`
(LLaVA, Qwen2-VL, …): `assay.models.load_policy` loads it with `AutoModelForImageTextToText`
and its `AutoProcessor`, and returns `(model, tokenizer)` like every policy, the processor hung
on the tokenizer as `tokenizer.processor`, where `assay.vision.inputs.encode_sample` finds
it. Everything that encodes a prompt goes through that one function, so the sampler, the
length check and the learner see the same image tokens.

`build_tiny_vlm` makes the bundled `tiny-count`'s starting point: a LLaVA model
(`LlavaForConditionalGeneration`, which vLLM serves wherever torchvision is installed) whose
language model is the bundled `tiny-arith` (a Qwen2 causal LM with a character tokenizer,
one token `<image>` added), whose vision tower is a freshly initialised CLIP encoder at a
tiny size, and whose processor is `LlavaProcessor` with a `CLIPImageProcessor`: the
picture is resized and normalised by Hugging Face's own code, never by hand.
"""

from __future__ import annotations

IMAGE_TOKEN = "<image>"
#: the tiny VLM's chat template: a user message's image parts become `<image>`, text parts their text; the
#: generation prompt is `=`, which is where the bundled arithmetic model gives an answer
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'image' %}<image>{% elif p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}={% endif %}"
)


def build_tiny_vlm(base: str = "tiny-arith", image_size: int = 24, patch: int = 4, hidden: int = 64, layers: int = 2, heads: int = 4,
                   intermediate: int = 256, seed: int = 0):
    """`(model, tokenizer)`: a LLaVA model over the bundled `base` language model and a new CLIP vision tower.

    Every weight is set from `seed` first (`assay.models.init_weights`), then the language model's are
    copied from `base`; `<image>`'s embedding row keeps its seeded value (image features replace it).
    """
    import torch
    from transformers import CLIPImageProcessor, CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    from assay.models import init_weights, load_policy

    lm, tok = load_policy(base)
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    text = lm.config.to_dict()
    text["vocab_size"] = len(tok)
    vision = CLIPVisionConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
                              image_size=image_size, patch_size=patch, projection_dim=hidden)
    config = LlavaConfig(vision_config=vision.to_dict(), text_config=text, image_token_index=tok.convert_tokens_to_ids(IMAGE_TOKEN),
                         vision_feature_select_strategy="default", vision_feature_layer=-1, projector_hidden_act="gelu",
                         tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).float()
    init_weights(model, seed)
    with torch.no_grad():
        own = model.model.language_model.state_dict()
        for name, w in lm.model.state_dict().items():
            own[name][: w.shape[0]].copy_(w)
    model.tie_weights()
    model.generation_config.eos_token_id = lm.generation_config.eos_token_id
    images = CLIPImageProcessor(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size},
                                image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], do_convert_rgb=True)
    processor = LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=patch, vision_feature_select_strategy="default",
                               image_token=IMAGE_TOKEN, num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE)
    tok.chat_template = CHAT_TEMPLATE
    tok.processor = processor
    model.policy_kind = "vision"
    return model, tok
