"""models/policy.py: a Hugging Face causal LM (or Qwen2-VL) with its tokenizer, as the Policy SEED acts with, and
the one way a policy is saved and loaded.

load_policy takes any folder or hub name already on disk (nothing is downloaded unless the user's environment
allows it): bf16 on CUDA, fp32 on CPU unless told otherwise. save_policy writes model, tokenizer and, for a VLM,
its image processor into one ordinary Hugging Face folder, which load_policy reads back; checkpoints, stage 1,
the tiny warm-up and the tiny builders all use it. No departure from the paper.
"""
import inspect

import torch

from models import vision


def kv_cache_name(model):
    """The KV cache's argument and output field: transformers 5.24 renamed past_key_values to cache."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class Policy:
    """A causal LM, its tokenizer and the ids that end a turn. Acts, analyzes and is trained."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        stops = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
        self.stop_ids = sorted(i for i in stops if isinstance(i, int) and 0 <= i < len(tokenizer))
        # a VLM never samples its vision tokens: an <|image_pad|> in a response would be read as a missing image
        self.sees_images = vision.is_vlm_model(model)  # a text-only policy reads an observation's text alone
        banned = [tokenizer.convert_tokens_to_ids(t) for t in vision.VISION_TOKENS] if self.sees_images else []
        self.banned_ids = [i for i in banned if isinstance(i, int) and 0 <= i < len(tokenizer)]
        self.cache_name = kv_cache_name(model)

    def count_tokens(self, text):
        """Tokens in `text` under this tokenizer (the analyzer prompt's budget)."""
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @property
    def device(self):
        return next(self.model.parameters()).device


def pick_device_dtype(device=None, dtype=None):
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype is None:
        dtype = "bfloat16" if str(device).startswith("cuda") and torch.cuda.is_bf16_supported() else "float32"
    return torch.device(device), getattr(torch, dtype) if isinstance(dtype, str) else dtype


def load_policy(name_or_path, device=None, dtype=None, gradient_checkpointing=False):
    """Any HF causal LM or Qwen2-VL folder or hub name -> Policy on `device` in `dtype`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    device, dtype = pick_device_dtype(device, dtype)
    if vision.is_vlm(name_or_path):  # Qwen2-VL / Qwen2.5-VL: the image processor rides on the tokenizer
        model, tokenizer = vision.load_vlm(name_or_path, dtype)
    else:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = model.to(device)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    return Policy(model, tokenizer)


def save_policy(policy, folder):
    """Model, tokenizer and (a VLM's) image processor into `folder`, an ordinary Hugging Face folder that
    load_policy reads back."""
    policy.model.save_pretrained(folder)
    policy.tokenizer.save_pretrained(folder)
    if getattr(policy.tokenizer, "image_processor", None) is not None:  # a VLM's processor rides on its tokenizer
        policy.tokenizer.image_processor.save_pretrained(folder)


def parameter_groups(model, lr, vision_lr_scale=1.0):
    """AdamW parameter groups: a Qwen2-VL's vision tower (model.model.visual) at lr * vision_lr_scale, the rest
    at lr (one group when the model has no tower)."""
    tower = getattr(getattr(model, "model", None), "visual", None)
    tower_ids = {id(p) for p in tower.parameters()} if tower is not None else set()
    groups = [{"params": [p for p in model.parameters() if id(p) not in tower_ids], "lr": lr}]
    if tower_ids:
        groups.append({"params": list(tower.parameters()), "lr": lr * vision_lr_scale})
    return groups
