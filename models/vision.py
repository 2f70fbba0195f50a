"""models/vision.py: screenshots into Qwen2-VL / Qwen2.5-VL prompts, so seed.py keeps one path for both.

`ImageText` is a user message (str) that carries its screenshot and `ImageIds` the prompt's token ids
(list) that carry the processed pixels: they flow through rollout, analysis, re-scoring and the loss like
plain str / list, so the teacher prompt (skills.with_skill on the text) keeps the SAME pixels.
`encode_image_chat` does the processor's work by hand (PIL image processor, then the text and after it
<|vision_start|> <|image_pad|> x grid_t*grid_h*grid_w/merge^2 <|vision_end|>: the screenshot ends the user
turn); `image_inputs` gives a padded batch its pixel_values, image_grid_thw, mm_token_type_ids and 3D M-RoPE
position ids. Only the padded layout carries images. Departure from the paper: its MiniWoB policy is a
pretrained Qwen2.5-VL; the tiny VLM (models/tiny.py) learns to read screenshots in its warm-up.
Run: python train.py --env vision
"""
import torch

IMAGE_PAD, VISION_START, VISION_END = "<|image_pad|>", "<|vision_start|>", "<|vision_end|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, "<|video_pad|>")

class ImageText(str):
    """A user message with the screenshot (H, W, 3 uint8) it is about."""

    def __new__(cls, text, image):
        self = super().__new__(cls, text)
        self.image = image
        return self


class ImageIds(list):
    """Prompt token ids with the processed image: pixel_values (patches, dim) and grid_thw (3,). A slice keeps
    them (the caller must not cut the image tokens out)."""

    def __getitem__(self, index):
        if isinstance(index, slice):
            return with_pixels(self, super().__getitem__(index))
        return super().__getitem__(index)


def with_pixels(source, ids):
    """ids as ImageIds carrying source's pixels when source has them, else ids unchanged."""
    if getattr(source, "pixel_values", None) is None:
        return ids
    ids = ImageIds(ids)
    ids.pixel_values, ids.grid_thw = source.pixel_values, source.grid_thw
    return ids


def same_image(source, text):
    """`text` (e.g. the teacher prompt made from source by skills.with_skill) with source's screenshot, if any."""
    image = getattr(source, "image", None)
    return text if image is None else ImageText(text, image)


def observation_text(observation):
    """The text part of an observation: a vision env's {"text", "image"} or a plain string."""
    return observation["text"] if isinstance(observation, dict) else observation


def user_message(text, observation):
    """The rendered prompt text, with the observation's screenshot attached when it has one."""
    image = observation.get("image") if isinstance(observation, dict) else None
    return text if image is None else ImageText(text, image)


def has_images(prompts):
    return any(getattr(p, "pixel_values", None) is not None for p in prompts)


# ----------------------------------------------------------------------------- prompts and batches

def encode_image_chat(tokenizer, message):
    """Token ids (ImageIds) of one user turn [text, image] plus the assistant header. The screenshot comes last,
    next to where the answer is written: the tiny VLM warmed up that way read 0.542 / 0.333 greedy success with
    warm-up seed 1, against 0.271 / 0.271 with the screenshot first (docs/vision.md)."""
    processor = getattr(tokenizer, "image_processor", None)
    if processor is None:
        raise ValueError("this env shows images but the model has no image processor: use a Qwen2-VL / Qwen2.5-VL "
                         "model or --model tiny")
    out = processor(images=[message.image], return_tensors="pt")
    grid = out["image_grid_thw"][0]                                                # (3,)
    n_tokens = int(grid.prod()) // processor.merge_size ** 2
    turn = [{"role": "user", "content": [{"type": "text", "text": str(message)}, {"type": "image"}]}]
    chat = tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
    if IMAGE_PAD not in chat:  # a template that only renders string content: the image block ends the message
        turn = [{"role": "user", "content": f"{message}{VISION_START}{IMAGE_PAD}{VISION_END}"}]
        chat = tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
    ids = ImageIds(tokenizer(chat.replace(IMAGE_PAD, IMAGE_PAD * n_tokens, 1), add_special_tokens=False)["input_ids"])
    ids.pixel_values, ids.grid_thw = out["pixel_values"], grid                     # (patches, 3*2*14*14), (3,)
    return ids


def image_inputs(model, prompts, ids, attention):
    """Extra forward kwargs for a padded batch whose rows start with `prompts` (ids, attention (B, T)): {} when
    no prompt has an image, else pixel_values, image_grid_thw, mm_token_type_ids and 3D position_ids (3, B, T)."""
    images = [p for p in prompts if getattr(p, "pixel_values", None) is not None]
    if not images:
        return {}
    token_types = (ids == model.config.image_token_id).int()                       # (B, T)
    grid = torch.stack([p.grid_thw for p in images]).to(ids.device)                # (n_images, 3)
    positions, _ = model.model.get_rope_index(input_ids=ids, mm_token_type_ids=token_types, image_grid_thw=grid,
                                              attention_mask=attention)           # (3, B, T)
    pixels = torch.cat([p.pixel_values for p in images]).to(ids.device, model.dtype)
    return {"pixel_values": pixels, "image_grid_thw": grid, "mm_token_type_ids": token_types, "position_ids": positions}


# ----------------------------------------------------------------------------- models

def is_vlm(name_or_path):
    """True when the model's config has a vision tower (a folder or hub name already available offline)."""
    from transformers import AutoConfig
    try:
        return getattr(AutoConfig.from_pretrained(name_or_path), "vision_config", None) is not None
    except (OSError, ValueError):
        return False


def is_vlm_model(model):
    return getattr(model.config, "vision_config", None) is not None


def load_vlm(name_or_path, dtype):
    """(model, tokenizer) of a Qwen2-VL / Qwen2.5-VL; the PIL image processor rides on tokenizer.image_processor
    (the default processor needs torchvision, which does not import beside the CPU torch wheel)."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer, Qwen2VLImageProcessorPil
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    tokenizer.image_processor = Qwen2VLImageProcessorPil.from_pretrained(name_or_path)
    model = AutoModelForImageTextToText.from_pretrained(name_or_path, dtype=dtype)
    return model, tokenizer
