"""models/tiny.py: the embedded default model, built offline -- a few-M-parameter Qwen2 (or Qwen2-VL for the
screenshot envs) from a config, with a byte-level BPE tokenizer trained in-process on the environment's text.

Nothing is downloaded: the model starts from random weights and learns in the warm-up (warmup/) what a
pretrained instruct model would bring. Saved as ordinary Hugging Face folders, so everything downstream loads
it like any other model. Departure from the paper: the paper starts from Qwen2.5-Instruct.
"""
import os

import torch

from models.policy import Policy, load_policy, save_policy
from models.vision import IMAGE_PAD, VISION_END, VISION_START, VISION_TOKENS

# the tiny model's chat template: string content, or Qwen2-VL's list of {"type": "image"} / {"type": "text"} parts
TINY_VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TINY_VISION = dict(depth=2, embed_dim=96, num_heads=4, mlp_ratio=2, patch_size=14, spatial_merge_size=2,
                   temporal_patch_size=2, in_channels=3)
TINY_PIXELS = (112 * 112, 224 * 224)  # min and max pixels: the vision env's 112x112 stays 4x4 merged tokens
# pixel normalisation: white -> 0. CLIP's statistics map a white page to about 2 in every pixel; measured, that
# common mode swamps the few pixels that differ: the vision tower's gradient fell 50x within 25 steps at lr 1e-3
# and a colour probe stayed at chance (docs/vision.md; tests/test_vision.py guards it)
TINY_PIXEL_MEAN, TINY_PIXEL_STD = [1.0, 1.0, 1.0], [0.5, 0.5, 0.5]

TINY_SIZES = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen2's own pre-tokenizer regex: a tiny tokenizer saved with it reloads identically as Qwen2Tokenizer
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def build_tiny_tokenizer(corpus, vocab_size=2048, extra_special=(), chat_template=None):
    """A byte-level BPE tokenizer trained on `corpus` (iterable of str), Qwen2's specials plus extra_special."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *extra_special]
    markup = ["<think>", "</think>", "<action>", "</action>"]  # single tokens: the format is cheap to learn
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.add_tokens(markup)
    tokenizer.chat_template = chat_template or CHAT_TEMPLATE
    return tokenizer


def build_tiny_policy(corpus, out_dir, vocab_size=2048, seed=0, **sizes):
    """Train a byte-level BPE tokenizer on `corpus` (iterable of str), build a small Qwen2 model from a
    config, save both as an ordinary HF folder in out_dir and return them reloaded from there."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    tokenizer = build_tiny_tokenizer(corpus, vocab_size)
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), max_position_embeddings=4096, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=None, **{**TINY_SIZES, **sizes})
    os.makedirs(out_dir, exist_ok=True)
    save_policy(Policy(Qwen2ForCausalLM(config), tokenizer), out_dir)
    return load_policy(out_dir, device="cpu", dtype="float32")


def build_tiny_vlm(corpus, out_dir, vocab_size=2048, seed=0, **sizes):
    """A small Qwen2-VL from a config: BPE tokenizer trained on `corpus` with Qwen2-VL's vision tokens, the
    text sizes of TINY_SIZES, a 2-block vision tower and a PIL image processor; saved as an ordinary HF
    folder in out_dir and returned reloaded from there (load_policy)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil
    tokenizer = build_tiny_tokenizer(corpus, vocab_size, VISION_TOKENS, TINY_VL_TEMPLATE)
    text = {**TINY_SIZES, **sizes}
    half_head = text["hidden_size"] // text["num_attention_heads"] // 2
    sections = [half_head - 2 * (half_head * 3 // 8), half_head * 3 // 8, half_head * 3 // 8]  # t, h, w: sum = half
    token = tokenizer.convert_tokens_to_ids
    torch.manual_seed(seed)
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), max_position_embeddings=4096, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": sections},
                         **text),
        vision_config=dict(TINY_VISION, hidden_size=text["hidden_size"]),
        image_token_id=token(IMAGE_PAD), video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token(VISION_START), vision_end_token_id=token(VISION_END), tie_word_embeddings=True)
    tokenizer.image_processor = Qwen2VLImageProcessorPil(min_pixels=TINY_PIXELS[0], max_pixels=TINY_PIXELS[1],
                                                         image_mean=TINY_PIXEL_MEAN, image_std=TINY_PIXEL_STD)
    os.makedirs(out_dir, exist_ok=True)
    save_policy(Policy(Qwen2VLForConditionalGeneration(config), tokenizer), out_dir)
    return load_policy(out_dir, device="cpu", dtype="float32")
