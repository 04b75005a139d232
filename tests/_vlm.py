"""A tiny Idefics3 vision-language model (SigLIP-style vision tower, Llama text model), built from a config for engine tests.

The bundled `tiny-count` is a LLaVA model; vLLM's CPU build cannot import its LLaVA implementation
without torchvision (which these machines lack), while its Idefics3 one (SmolVLM's architecture) imports
without it. vLLM's CPU attention takes head sizes of 32 and up (128 wide, 4 heads). Random weights at a scale that keeps the logits far from uniform, so logprob checks mean something.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"] + [
    f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
TEMPLATE = ("{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
            "{% if p.type == 'image' %}<image>{% elif p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}{% endif %}"
            "{% endfor %}{% if add_generation_prompt %}={% endif %}")


def build_tiny_idefics3(folder: Path, image_size: int = 32, patch: int = 8, seed: int = 0) -> Path:
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor, LlamaConfig
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from assay.models import build_char_tokenizer

    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    vision = Idefics3VisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  image_size=image_size, patch_size=patch)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=256, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    config = Idefics3Config(vision_config=vision.to_dict(), text_config=text.to_dict(), scale_factor=2,
                            image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": image_size},
                                       max_image_size={"longest_edge": image_size}, resample=3)
    processor = Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=(image_size // patch) ** 2 // 4, chat_template=TEMPLATE)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return Path(folder)
