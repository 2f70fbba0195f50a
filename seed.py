"""
seed.py: the SEED algorithm around a policy -- rollouts, self-analysis, re-scoring, the update.

What is here (no training loop, no argument parsing; train.py drives these):
  * the policy: any Hugging Face causal LM with its chat template, or `tiny`, a few-M-parameter Qwen2
    built from a config with a BPE tokenizer trained in-process (no download, runs on a laptop CPU);
  * prompts in the verl-agent ALFWorld format and the `<action>...</action>` parser;
  * `sample`: batched generation over all live envs (left-padded batch, KV cache) that records the
    sampled tokens, their mask and their log-probs;
  * `rollout`: N tasks x G rollouts stepped together; `analyze`: the SAME weights turn every finished
    trajectory into a hindsight skill (skills.analyzer_prompt -> generate -> skills.parse_skill);
  * `response_logprobs`: re-scores given response tokens under any prompts, padded or packed layout
    (packed rows run per-sequence varlen attention and are scored on their flat response logits);
  * `policy_update`: micro-batched PPO-clip + SEED loss (loss.seed_loss) with gradient accumulation, and
    `ppo_update`: K such optimizer steps on random parts of the rows (verl's PPO mini-batches);
  * env calls guarded by a timeout: an env that raises or hangs is rebuilt and its trajectory dropped.

Layout convention: every per-token tensor is response-aligned, (B, R) with R the longest response of
the batch, and `mask` is 1 exactly on policy-sampled tokens. The mask is made by the sampler (tokens it
emitted before and including end-of-turn); prompts, observations and skill text never enter these
tensors, so student and teacher rows align token for token whatever their prompt lengths.

Departures from the paper: the invalid-format penalty is added to the episode score before GRPO (as in
verl-agent); one PPO epoch over the batch is the only mode (the authors' setting), split into
mini-batches as verl does; `trajectory_advantages` can also scale by one std over the whole update
(`--advantage-norm batch`, the tiny model's default). Command: see train.py.
"""
import contextlib
import inspect
import json
import math
import os
import re
import signal
import threading

import torch
from tqdm.auto import tqdm

import loss as L
import skills
import vlm

# ----------------------------------------------------------------------------- prompts and actions

HEADERS = {  # first line of the agent prompt per env family (verl-agent templates)
    "household": "You are an expert agent operating in the ALFRED Embodied Environment.",
    "alfworld": "You are an expert agent operating in the ALFRED Embodied Environment.",
    "webshop": "You are an expert autonomous agent operating in the WebShop e-commerce environment.",
    "vision": "You are an expert agent operating a web page from its screenshot.",
    "miniwob": "You are an expert agent operating a web page from its screenshot.",
}
INSTRUCTION = ("Now it's your turn to take an action.\n"
               "You should first reason step-by-step about the current situation. This reasoning process "
               "MUST be enclosed within <think> </think> tags.\n"
               "Once you've finished your reasoning, you should choose an admissible action for current step "
               "and present it within <action> </action> tags.")


def render_prompt(task, history, observation, admissible, history_window=5, env_name="household"):
    """The user message for one step. history: list of (observation, action) of the previous steps."""
    header = HEADERS.get(env_name, HEADERS["household"])
    lines = [f"{header} Your task is to: {task}"]
    if history:
        recent = history[-history_window:] if history_window > 0 else []
        start = len(history) - len(recent)
        records = " ".join(f"[Observation {start + i + 1}: '{o}', Action {start + i + 1}: '{a}']"
                           for i, (o, a) in enumerate(recent))
        lines.append(f"Prior to this step, you have already taken {len(history)} step(s). Below are the most "
                     f"recent {len(recent)} observations and the corresponding actions you took: {records}")
    lines.append(f"You are now at step {len(history) + 1} and your current observation is: {observation}")
    actions = ", ".join(f"'{a}'" for a in admissible)
    lines.append(f"Your admissible actions of the current situation are: [{actions}].")
    return "\n".join(lines) + "\n\n" + INSTRUCTION


def parse_action(response):
    """The text inside the first <action>...</action>, stripped; None when there is no such tag. Two str.find
    calls, not the regex <action>(.*?)</action>, which is quadratic on a response of many <action> without a close."""
    start = response.find("<action>")
    end = response.find("</action>", start + len("<action>")) if start >= 0 else -1
    return response[start + len("<action>"):end].strip() if end >= 0 else None


def encode_chat(tokenizer, user_text):
    """Token ids of one user turn plus the assistant header, through the model's own chat template. A message
    with a screenshot (vlm.ImageText) gives ids carrying the pixels (vlm.ImageIds)."""
    if getattr(user_text, "image", None) is not None:
        return vlm.encode_image_chat(tokenizer, user_text)
    text = tokenizer.apply_chat_template([{"role": "user", "content": user_text}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------- the policy

class Policy:
    """A causal LM, its tokenizer and the ids that end a turn. Acts, analyzes and is trained."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        stops = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
        self.stop_ids = sorted(i for i in stops if isinstance(i, int) and 0 <= i < len(tokenizer))
        # transformers 5.x renamed past_key_values -> cache; accept both so 4.x users are not locked out
        self.cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        # a VLM never samples its vision tokens: an <|image_pad|> in a response would be read as a missing image
        vision = [tokenizer.convert_tokens_to_ids(t) for t in vlm.VISION_TOKENS] if vlm.is_vlm_model(model) else []
        self.banned_ids = [i for i in vision if isinstance(i, int) and 0 <= i < len(tokenizer)]

    @property
    def device(self):
        return next(self.model.parameters()).device


def pick_device_dtype(device=None, dtype=None):
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype is None:
        dtype = "bfloat16" if str(device).startswith("cuda") and torch.cuda.is_bf16_supported() else "float32"
    return torch.device(device), getattr(torch, dtype) if isinstance(dtype, str) else dtype


def load_policy(name_or_path, device=None, dtype=None, gradient_checkpointing=False):
    """Any HF causal LM folder or hub name (already on disk / in the HF cache: nothing is downloaded
    unless the user's environment allows it). bf16 on CUDA, fp32 on CPU unless told otherwise."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    device, dtype = pick_device_dtype(device, dtype)
    if vlm.is_vlm(name_or_path):  # Qwen2-VL / Qwen2.5-VL: the image processor rides on the tokenizer
        model, tokenizer = vlm.load_vlm(name_or_path, dtype)
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
    model = Qwen2ForCausalLM(config)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return load_policy(out_dir, device="cpu", dtype="float32")


# ----------------------------------------------------------------------------- generation

def left_pad(sequences, pad_id, device):
    """list of id lists -> ids (B, P), attention mask (B, P), position ids (B, P), left-padded."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
        attention[row, width - len(seq):] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), attention.to(device), positions.to(device)


@torch.no_grad()
def sample(policy, prompts, max_new_tokens, temperature=1.0, batch_size=64, desc=None, generator=None):
    """Generate one response per prompt (list of id lists). temperature 0 is greedy.
    Returns (responses, logps): per row the sampled ids up to and including the first stop token, and
    the log-prob of each under softmax(logits / temperature) (greedy: temperature 1). `generator` (a
    torch.Generator on the model's device) keeps evaluation from consuming the training RNG."""
    responses, logps = [None] * len(prompts), [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths pad less
    model, device = policy.model, policy.device
    was_training = model.training
    model.eval()
    stop = torch.tensor(policy.stop_ids, device=device)
    bar = tqdm(total=len(prompts), desc=desc, leave=False, disable=desc is None)
    for first in range(0, len(order), batch_size):
        rows = order[first:first + batch_size]
        ids, attention, positions = left_pad([prompts[i] for i in rows], policy.pad_id, device)
        images = vlm.image_inputs(model, [prompts[i] for i in rows], ids, attention)  # {} for text prompts
        positions = images.pop("position_ids", positions)                         # (B, P) or M-RoPE (3, B, P)
        cache, step_input, step_positions = None, ids, positions
        alive = torch.ones(len(rows), dtype=torch.bool, device=device)           # (b,)
        tokens, token_logps, token_alive = [], [], []
        for _ in range(max_new_tokens):
            out = model(input_ids=step_input, attention_mask=attention, position_ids=step_positions,
                        use_cache=True, logits_to_keep=1, **{policy.cache_kwarg: cache}, **images)
            images = {}  # the pixels go in with the prompt only
            cache = out["cache"] if "cache" in out else out["past_key_values"]
            logits = out.logits[:, -1].float()                                     # (b, V)
            logits = torch.nan_to_num(logits, nan=0.0, posinf=1e4, neginf=-1e4)  # NaN/inf: sample, let the update skip
            logprobs = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
            # banned ids (a VLM's vision tokens) are never drawn; the recorded log-probs stay the model's own, as
            # re-scoring computes them (the banned share of the mass is ~0 once the model is trained)
            allowed = logprobs.index_fill(-1, torch.tensor(policy.banned_ids, dtype=torch.long, device=device),
                                          float("-inf")) if policy.banned_ids else logprobs
            if temperature > 0:
                token = torch.multinomial(allowed.exp(), 1, generator=generator).squeeze(-1)  # (b,)
            else:
                token = allowed.argmax(-1)
            token = torch.where(alive, token, torch.full_like(token, policy.pad_id))
            tokens.append(token)
            token_logps.append(logprobs.gather(-1, token[:, None]).squeeze(-1))
            token_alive.append(alive.clone())                                      # mask made here
            alive &= ~torch.isin(token, stop)
            if not alive.any():
                break
            step_input = token[:, None]
            step_positions = step_positions[..., -1:] + 1
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
        tokens, token_logps, token_alive = (torch.stack(x, 1).cpu() for x in (tokens, token_logps, token_alive))
        for j, i in enumerate(rows):
            n = int(token_alive[j].sum())
            responses[i] = tokens[j, :n].tolist()
            logps[i] = token_logps[j, :n].tolist()
        bar.update(len(rows))
    bar.close()
    model.train(was_training)
    return responses, logps


# ----------------------------------------------------------------------------- rollouts and analysis

class EnvFailure(Exception):
    """An env raised or hung: the rollout drops that trajectory and rebuilds the env."""


def call_env(method, argument, timeout=None):
    """method(argument), an env's reset or step, under a wall-clock limit of `timeout` seconds (None or 0: none).
    Any exception, or a hang past the limit, becomes EnvFailure(reason). The limit is a SIGALRM timer, which
    interrupts an env stuck in Python code or in a blocking call; it needs Unix and the main thread, elsewhere
    the call runs without a limit (an env stuck inside C code that holds the GIL cannot be interrupted)."""
    timed = bool(timeout) and hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()

    def on_alarm(signum, frame):
        raise TimeoutError(f"no answer within {timeout:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm) if timed else None
    try:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, timeout)
        return method(argument)
    except Exception as error:
        name = getattr(method, "__name__", "call")
        raise EnvFailure(f"env.{name} failed: {type(error).__name__}: {error}"[:300]) from error
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def restart_env(envs, index, env_factory=None, timeout=None):
    """Close the broken envs[index] (its errors ignored) and put env_factory(index) in its place. Without a
    factory the env stays, and its next reset decides whether it still works."""
    if env_factory is None:
        return
    if hasattr(envs[index], "close"):
        try:
            call_env(lambda _: envs[index].close(), None, timeout)
        except EnvFailure:
            pass
    envs[index] = env_factory(index)


def rollout(policy, envs, task_seeds, group_size, max_steps, max_new_tokens=64, temperature=1.0,
            history_window=5, invalid_penalty=0.1, max_prompt_tokens=2048, batch_size=64, env_name="household",
            desc="rollout", generator=None, env_factory=None, env_timeout=None):
    """Play len(task_seeds) tasks x group_size rollouts together; envs must hold that many envs.
    Returns trajectories (the dict of skills.py's contract plus per-step 'prompt', 'prompt_ids',
    'response_ids', 'sampled_logp', 'truncated', and per trajectory 'group' = index of its task).
    An env that raises or hangs past env_timeout seconds ends its trajectory with 'dropped' = the reason
    (callers leave those out) and is replaced in `envs` by env_factory(index) (see call_env, restart_env)."""
    assert len(envs) >= len(task_seeds) * group_size, "need one env per rollout"
    trajectories, live = [], []
    for task_index, task_seed in enumerate(task_seeds):
        for g in range(group_size):
            index = len(trajectories)
            trajectories.append({"task": "", "task_type": None, "won": False, "reward": 0.0, "steps": [], "gt": None,
                                 "group": task_index, "seed": task_seed})
            live.append(None)
            try:
                observation, info = call_env(envs[index].reset, task_seed, env_timeout)
            except EnvFailure as failure:
                trajectories[-1]["dropped"] = str(failure)
                restart_env(envs, index, env_factory, env_timeout)
                continue
            trajectories[-1].update(task=info["task"], task_type=info.get("task_type"))
            live[-1] = {"env": envs[index], "index": index, "obs": observation, "info": info, "history": []}
    truncated = 0
    bar = tqdm(total=max_steps, desc=desc, leave=False)
    for _ in range(max_steps):
        active = [i for i, state in enumerate(live) if state is not None]
        if not active:
            break
        prompts, prompt_ids, cut = [], [], []
        for i in active:
            state = live[i]
            text = vlm.user_message(render_prompt(trajectories[i]["task"], state["history"],
                                                  vlm.observation_text(state["obs"]),
                                                  state["info"].get("admissible", []), history_window, env_name),
                                    state["obs"])
            ids = encode_chat(policy.tokenizer, text)
            # keep the end: the current observation and the instruction (an image prompt is never cut: its image
            # tokens open it)
            cut.append(len(ids) > max_prompt_tokens and not vlm.has_images([ids]))
            if cut[-1]:
                ids, truncated = ids[-max_prompt_tokens:], truncated + 1
            prompts.append(text)
            prompt_ids.append(ids)
        responses, logps = sample(policy, prompt_ids, max_new_tokens, temperature, batch_size, generator=generator)
        for i, text, ids, response, logp, was_cut in zip(active, prompts, prompt_ids, responses, logps, cut):
            state, trajectory = live[i], trajectories[i]
            response_text = policy.tokenizer.decode(response, skip_special_tokens=True)
            action = parse_action(response_text)
            try:
                observation, reward, done, info = call_env(state["env"].step, action if action is not None else "",
                                                           env_timeout)
            except EnvFailure as failure:
                trajectory["dropped"], live[i] = str(failure), None
                restart_env(envs, state["index"], env_factory, env_timeout)
                continue
            if info.get("browser_restarted"):  # MiniWoB lost its browser mid-episode (and restarted it itself)
                trajectory["dropped"], live[i] = "env.step: the browser died; the env restarted it", None
                continue
            reward -= invalid_penalty if action is None else 0.0
            trajectory["steps"].append({"observation": vlm.observation_text(state["obs"]), "response": response_text,
                                        "action": action or "", "reward": float(reward),
                                        "valid": bool(info.get("valid", True)) and action is not None,
                                        "prompt": text, "prompt_ids": ids, "response_ids": response,
                                        "sampled_logp": logp, "truncated": was_cut})
            trajectory["reward"] += float(reward)
            state["history"].append((vlm.observation_text(state["obs"]), action or ""))
            state["obs"], state["info"] = observation, info
            if done or len(trajectory["steps"]) >= max_steps:
                trajectory["won"] = bool(info.get("won", False))
                trajectory["gt"] = info.get("gt")
                live[i] = None
        bar.update(1)
    bar.close()
    for trajectory in trajectories:
        trajectory["truncated_prompts"] = truncated
    return trajectories


def analyze(policy, trajectories, max_prompt_tokens=1024, max_new_tokens=128, temperature=0.0,
            batch_size=32, desc="analyze"):
    """The current policy writes one hindsight skill per finished trajectory.
    Returns (skills, raw_outputs); a skill is None where the output could not be parsed."""
    count = lambda text: len(policy.tokenizer(text, add_special_tokens=False)["input_ids"])
    prompts = [encode_chat(policy.tokenizer, skills.analyzer_prompt(t, max_tokens=max_prompt_tokens,
                                                                     count_tokens=count))
               for t in trajectories]
    outputs, _ = sample(policy, prompts, max_new_tokens, temperature, batch_size, desc=desc)
    texts = [policy.tokenizer.decode(o, skip_special_tokens=True) for o in outputs]
    return [skills.parse_skill(text, task=t["task"]) for text, t in zip(texts, trajectories)], texts


# ----------------------------------------------------------------------------- re-scoring

def response_mask(responses, device="cpu"):
    """(B, R) float mask, 1 on the first len(response) positions: the tokens the sampler emitted."""
    width = max([1] + [len(r) for r in responses])
    lengths = torch.tensor([len(r) for r in responses], device=device, dtype=torch.long)
    return (torch.arange(width, device=device)[None, :] < lengths[:, None]).float()


VARLEN_ATTENTION = "seed_varlen"


def varlen_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, cu_seq_lens_q=None, **kwargs):
    """Causal attention of each packed sequence with itself only, one SDPA call per sequence: sum(L_i^2) work and no
    mask, where a packed row through HF's eager / SDPA paths gets an (N, N) block-diagonal mask (N^2 time and
    memory; 4 GB of attention weights per layer at N = 16k). query (1, H, N, D), key/value (1, KV, N, D),
    cu_seq_lens_q (S + 1,) sequence starts -> (1, N, H, D), the layout of HF's attention functions."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)  # (1, H, N, D)
    bounds = cu_seq_lens_q.tolist()
    out = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], dropout_p=dropout, is_causal=True, scale=scaling)
        for a, b in zip(bounds[:-1], bounds[1:])], dim=2)                            # (1, H, N, D)
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def packed_attention(model):
    """Run the model's attention as varlen_attention inside the block (flash attention already reads packed
    sequences from the cu_seq_lens kwargs, so it is left alone)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    config, previous = model.config, model.config._attn_implementation
    if str(previous).startswith("flash"):
        yield
        return
    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention)
    AttentionMaskInterface.register(VARLEN_ATTENTION, lambda *args, **kwargs: None)  # no (N, N) mask is built
    config._attn_implementation = VARLEN_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = previous


def packed_logits(model, prompts, responses):
    """All rows in one (1, N) sequence (per-sequence position ids, varlen attention), the LM head only on the
    positions that predict a response token. Returns (logits (n, V), targets (n,), rows (n,), columns (n,)):
    n = total response tokens, (rows, columns) where each lands in a (B, R) response-aligned tensor."""
    if vlm.has_images(prompts):
        raise ValueError("the packed layout does not carry images: use --layout padded with a vision env")
    device = next(model.parameters()).device
    ids, positions, keep, slots, starts = [], [], [], [], [0]
    for row, (prompt, response) in enumerate(zip(prompts, responses)):
        start = len(ids)
        ids += list(prompt) + list(response)
        positions += list(range(len(prompt) + len(response)))
        keep += range(start + len(prompt) - 1, start + len(prompt) + len(response) - 1)
        slots += [(row, t) for t in range(len(response))]
        starts.append(len(ids))
    bounds = torch.tensor(starts, device=device, dtype=torch.int32)                  # (S + 1,)
    longest = max(b - a for a, b in zip(starts[:-1], starts[1:]))
    with packed_attention(model):
        out = model(input_ids=torch.tensor([ids], device=device), position_ids=torch.tensor([positions], device=device),
                    attention_mask=None, use_cache=False, logits_to_keep=torch.tensor(keep, device=device),
                    cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=longest, max_length_k=longest)
    targets = torch.tensor([t for r in responses for t in r], dtype=torch.long, device=device)  # (n,)
    rows, cols = (torch.tensor(x, dtype=torch.long, device=device) for x in zip(*slots)) if slots else (targets, targets)
    return out.logits[0], targets, rows, cols


def forward_logits(model, prompts, responses, pad_id, layout="padded"):
    """Logits that predict each response token. Returns (logits (B, R, V), targets (B, R)).
    padded: prompts left-padded, responses right-padded, position_ids = cumsum(mask) - 1, and only the
    R+1 last positions go through the LM head. packed: packed_logits re-padded to (B, R, V) (forward_logprobs
    scores packed rows without that tensor)."""
    device = next(model.parameters()).device
    width = max(1, max(len(r) for r in responses))
    targets = torch.full((len(responses), width), pad_id, dtype=torch.long)
    for row, response in enumerate(responses):
        targets[row, :len(response)] = torch.tensor(response, dtype=torch.long)
    targets = targets.to(device)                                                    # (B, R)
    if layout == "padded":
        prompt_ids, prompt_attention, _ = left_pad(prompts, pad_id, device)         # (B, P)
        mask = response_mask(responses, device).long()                              # (B, R)
        ids = torch.cat([prompt_ids, targets], dim=1)                               # (B, P + R)
        attention = torch.cat([prompt_attention, mask], dim=1)                      # (B, P + R)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        images = vlm.image_inputs(model, prompts, ids, attention)                   # {} for text prompts
        positions = images.pop("position_ids", positions)                           # (B, P + R) or (3, B, P + R)
        logits = model(input_ids=ids, attention_mask=attention, position_ids=positions,
                       use_cache=False, logits_to_keep=width + 1, **images).logits[:, :-1]  # (B, R, V)
        return logits, targets
    if layout != "packed":
        raise ValueError(f"layout must be 'padded' or 'packed', got {layout!r}")
    flat, _, rows, cols = packed_logits(model, prompts, responses)                 # (n, V)
    logits = flat.new_zeros(len(responses), width, flat.shape[-1])                  # (B, R, V)
    return logits.index_put((rows, cols), flat), targets


def forward_logprobs(model, prompts, responses, pad_id, temperature=1.0, layout="padded", entropy=False):
    """Differentiable per-token log-probs (B, R) of the responses at the temperature, and their entropies (B, R)
    when asked (else None). The packed layout scores the flat (n, V) logits of the n response tokens and places
    the results, never building forward_logits' mostly-padding (B, R, V) tensor."""
    if layout == "packed":
        flat, targets, rows, cols = packed_logits(model, prompts, responses)        # (n, V), (n,)
        place = lambda x: x.new_zeros(len(responses), max(1, max(map(len, responses)))).index_put((rows, cols), x)
        logp = place(L.token_logprobs(flat, targets, temperature))                  # (B, R)
        return logp, place(L.entropy_from_logits(flat, temperature)) if entropy else None
    logits, targets = forward_logits(model, prompts, responses, pad_id, layout)     # (B, R, V)
    logp = L.token_logprobs(logits, targets, temperature)                           # (B, R)
    return logp, L.entropy_from_logits(logits, temperature) if entropy else None


def response_logprobs(model, prompts, responses, pad_id, temperature=1.0, layout="padded", max_batch_tokens=16384,
                      desc=None):
    """Log-probs (B, R) of given response tokens under given prompts, without gradient, in micro-batches of
    about max_batch_tokens tokens. Row i of the result lines up with responses[i] (0 past its end)."""
    result = torch.zeros(len(responses), max([1] + [len(r) for r in responses]))
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for rows in tqdm(micro_batches(prompts, responses, max_batch_tokens), desc=desc, leave=False,
                         disable=desc is None):
            logp, _ = forward_logprobs(model, [prompts[i] for i in rows], [responses[i] for i in rows], pad_id,
                                       temperature, layout)                         # (b, r)
            result[rows, :logp.shape[1]] = logp.float().cpu()
    model.train(was_training)
    return result * response_mask(responses)


def micro_batches(prompts, responses, max_batch_tokens):
    """Lists of row indices, rows of similar length together, each list about max_batch_tokens tokens
    when padded (always at least one row)."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) + len(responses[i]))
    batches, current, width = [], [], 0
    for i in order:
        length = len(prompts[i]) + len(responses[i])
        if current and max(width, length) * (len(current) + 1) > max_batch_tokens:
            batches.append(current)
            current, width = [], 0
        current.append(i)
        width = max(width, length)
    return batches + ([current] if current else [])


# ----------------------------------------------------------------------------- advantages and the update

def step_rows(trajectories, skill_per_trajectory=None):
    """Flatten trajectories into one training row per step. Returns a dict of lists:
    prompts (ordinary prompt ids), responses, sampled_logp (the behaviour policy's log-probs recorded while
    sampling), teacher_prompts (None where the trajectory has no skill), trajectory index."""
    rows = {"prompts": [], "responses": [], "sampled_logp": [], "teacher_prompts": [], "trajectory": []}
    for index, trajectory in enumerate(trajectories):
        skill = skill_per_trajectory[index] if skill_per_trajectory else None
        for step in trajectory["steps"]:
            rows["prompts"].append(step["prompt_ids"])
            rows["responses"].append(step["response_ids"])
            rows["sampled_logp"].append(step["sampled_logp"])
            # a prompt cut to --max-prompt-tokens lost its task line: no teacher context that matches it; the
            # teacher sees the same screenshot (if any) with the skill in its text
            no_teacher = skill is None or step.get("truncated", False)
            rows["teacher_prompts"].append(
                None if no_teacher else vlm.same_image(step["prompt"], skills.with_skill(step["prompt"], skill)))
            rows["trajectory"].append(index)
    return rows


def rescore(policy, rows, temperature=1.0, layout="padded", max_batch_tokens=16384, reference=None, need_old=True):
    """Old (ordinary prompt), teacher (skill prompt) and reference log-probs, (B, R) each, of the rows'
    response tokens under the current, not yet updated weights, and has_teacher (B,) bool. Teacher rows
    without a skill hold the old log-probs (delta exactly 0); ref is None without a reference model.
    need_old=False skips the student pass (old is then None): with one PPO epoch the update's own forward
    pass runs on these same weights, so policy_update takes old = logp.detach() for free; the teacher
    rows without a skill are then zeros, and has_teacher keeps them out of the loss."""
    score = lambda model, prompts, responses, desc: response_logprobs(
        model, prompts, responses, policy.pad_id, temperature, layout, max_batch_tokens, desc)
    old = score(policy.model, rows["prompts"], rows["responses"], "re-score student") if need_old else None
    teacher = old.clone() if need_old else response_mask(rows["responses"]) * 0.0    # (B, R)
    with_skill = [i for i, text in enumerate(rows["teacher_prompts"]) if text is not None]
    if with_skill:
        prompts = [encode_chat(policy.tokenizer, rows["teacher_prompts"][i]) for i in with_skill]
        scored = score(policy.model, prompts, [rows["responses"][i] for i in with_skill], "re-score teacher")
        teacher[with_skill, :scored.shape[1]] = scored
    ref = None if reference is None else score(reference, rows["prompts"], rows["responses"], "re-score reference")
    has_teacher = torch.tensor([text is not None for text in rows["teacher_prompts"]], dtype=torch.bool)
    return old, teacher, ref, has_teacher


def trajectory_advantages(trajectories, norm="group"):
    """GRPO over the episode scores (outcome reward + invalid penalties) of each task's G rollouts: (N,).
    norm: "group" divides by each group's std (GRPO, the paper); "batch" by the std of all centred scores of
    the update, so a group whose rollouts all failed and differ only by a 0.1 format penalty keeps advantages
    near 0 instead of being blown up to +-1 (which rewards its failed rollouts); "none": Dr. GRPO."""
    scores = torch.tensor([t["reward"] for t in trajectories], dtype=torch.float32)
    groups = torch.tensor([t["group"] for t in trajectories])
    centered = L.grpo_advantages(scores, groups, norm_std=norm == "group")  # (N,)
    if norm == "batch":
        return centered / (centered.std() + 1e-6) if centered.numel() > 1 else centered
    return centered


def skip_reason(prompts, advantages, old_logp=None, teacher_logp=None, ref_logp=None):
    """Why an update must not run on these inputs (no rows; NaN/inf in an advantage or a re-scored log-prob,
    which would reach the weights), or None. Past the inputs, policy_update skips on a non-finite loss or
    gradient norm."""
    if not prompts:
        return "no rows to train on (every trajectory was dropped)"
    for name, value in (("advantages", advantages), ("old log-probs", old_logp), ("teacher log-probs", teacher_logp),
                        ("reference log-probs", ref_logp)):
        if value is not None and not torch.isfinite(value).all():
            rows = (~torch.isfinite(value)).reshape(len(value), -1).any(-1).sum()
            return f"non-finite {name} in {int(rows)} of {len(value)} rows"
    return None


def policy_update(policy, optimizer, prompts, responses, advantages, old_logp, teacher_logp=None, ref_logp=None,
                  has_teacher=None, loss_kwargs=None, temperature=1.0, layout="padded", max_batch_tokens=16384,
                  grad_clip=1.0, desc="update", distributed=False):
    """One optimizer step over all rows with gradient accumulation.
    advantages (B,) per row; old/teacher/ref log-probs (B, R) response-aligned (old None: this forward
    pass's own detached log-probs, exact for one PPO epoch on unchanged weights); has_teacher (B,) bool marks
    the rows whose trajectory got a skill (the others get no distillation term). Micro-batch losses are weighted so the
    sum equals the full-batch loss: token-mean by the micro-batch's share of valid tokens, seq-mean-* by
    its share of rows. distributed (torchrun): the rows are this rank's share; the weights use the token (row)
    count of all ranks and the gradients and metrics are summed over ranks (all_reduce_update), so every rank
    takes the single-process step of the whole batch. Returns (metrics, skipped_reason or None)."""
    loss_kwargs = dict(loss_kwargs or {})
    model = policy.model
    model.train()
    mask = response_mask(responses)                                                 # (B, R)
    aggregation = loss_kwargs.get("agg", "token-mean")
    total = mask.sum() if aggregation == "token-mean" else (mask.sum(1) > 0).sum()
    totals, skipped = {}, skip_reason(prompts, advantages, old_logp, teacher_logp, ref_logp)
    optimizer.zero_grad(set_to_none=True)
    device = policy.device
    if distributed:  # normalise by the whole batch: the tokens (rows) of every rank
        total = total.to(device)
        torch.distributed.all_reduce(total)
    # a skip still reaches all_reduce_update below, so every torchrun rank skips together
    for rows in [] if skipped else tqdm(micro_batches(prompts, responses, max_batch_tokens), desc=desc, leave=False):
        width = max(1, max(len(responses[i]) for i in rows))
        pick = lambda x: None if x is None else x[rows, :width].to(device)
        micro_mask = mask[rows, :width].to(device)                                  # (b, r)
        weight = (micro_mask.sum() if aggregation == "token-mean" else (micro_mask.sum(1) > 0).sum()) / total.clamp(min=1)
        logp, entropy = forward_logprobs(model, [prompts[i] for i in rows], [responses[i] for i in rows],
                                         policy.pad_id, temperature, layout,
                                         entropy=bool(loss_kwargs.get("entropy_coef", 0)))  # (b, r) each
        taught = None if has_teacher is None else micro_mask * has_teacher[rows].to(device)[:, None]  # (b, r)
        old = logp.detach() if old_logp is None else pick(old_logp)  # same weights: ratio exactly 1
        loss, metrics = L.seed_loss(logp, old, advantages[rows].to(device)[:, None], micro_mask,
                                    teacher_logp=pick(teacher_logp), ref_logp=pick(ref_logp), entropy=entropy,
                                    teacher_mask=taught, **loss_kwargs)
        if not torch.isfinite(loss):
            skipped = f"non-finite loss {loss.item()}"
            break
        (loss * weight).backward()
        for key, value in metrics.items():
            totals[key] = totals.get(key, 0.0) + value * float(weight)
    if distributed:
        skipped = all_reduce_update(model, totals, skipped, device)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip) if skipped is None else None
    if skipped is None and not torch.isfinite(grad_norm):
        skipped = f"non-finite gradient norm {grad_norm.item()}"
    if skipped is None:
        optimizer.step()
        totals["grad_norm"] = float(grad_norm)
    optimizer.zero_grad(set_to_none=True)
    return totals, skipped


def padded_logprobs(rows):
    """Per-token log-prob lists -> (B, R) tensor, zeros past each row's end (the response mask's layout)."""
    width = max([1] + [len(row) for row in rows])
    return torch.tensor([row + [0.0] * (width - len(row)) for row in rows], dtype=torch.float32).reshape(-1, width)


def ppo_update(policy, optimizer, rows, advantages, teacher_logp=None, ref_logp=None, has_teacher=None,
               mini_batches=1, generator=None, **update_kwargs):
    """PPO over one rollout batch: the rows are shuffled into `mini_batches` parts and each part is one
    optimizer step (policy_update), as verl's ppo_mini_batch_size does. One part: old = the update's own
    detached log-probs (same weights). Several: later parts run on moved weights, so the ratio needs the
    behaviour policy's log-probs, which sampling recorded (rows['sampled_logp']). Returns (metrics averaged
    over the parts, skipped reasons joined or None)."""
    count = len(rows["prompts"])
    # tensor_split gives exactly that many parts (chunk can give fewer: 6 rows in 4 chunks are 3 of 2), so
    # the steps are the ones asked for and torchrun ranks with different row counts take the same number
    parts = torch.randperm(count, generator=generator).tensor_split(max(1, min(mini_batches, count))) \
        if mini_batches > 1 else [torch.arange(count)]
    old_logp = padded_logprobs(rows["sampled_logp"]) if mini_batches > 1 else None  # (B, R)
    pick = lambda x, part: None if x is None else x[part]
    totals, reasons = {}, []
    for part in parts:
        indices = part.tolist()
        metrics, skipped = policy_update(
            policy, optimizer, [rows["prompts"][i] for i in indices], [rows["responses"][i] for i in indices],
            advantages[part], pick(old_logp, part), pick(teacher_logp, part), pick(ref_logp, part),
            pick(has_teacher, part), **update_kwargs)
        reasons += [skipped] if skipped else []
        for key, value in metrics.items():
            totals[key] = totals.get(key, 0.0) + value / len(parts)
    return totals, ("; ".join(reasons) or None)


def all_reduce_update(model, totals, skipped, device):
    """torchrun: sum the gradients and the metric totals over ranks (each rank's are already weighted by its
    share of the whole batch, so the sums are the whole batch's); a skip on any rank skips the step on all.
    Returns the skip reason. An explicit all_reduce rather than DistributedDataParallel: DDP averages over
    ranks, which weighs a token of a short share more than a token of a long one."""
    import torch.distributed as dist
    flag = torch.tensor([float(skipped is not None)], device=device)
    dist.all_reduce(flag)
    if flag.item() > 0:
        return skipped or "skipped on another rank"
    for parameter in model.parameters():
        if parameter.grad is not None:  # the same parameters on every rank: all ran a backward pass
            dist.all_reduce(parameter.grad)
    values = torch.tensor([totals[key] for key in sorted(totals)], dtype=torch.float64, device=device)
    dist.all_reduce(values)
    totals.update(zip(sorted(totals), values.tolist()))
    return None


def supervised_step(policy, optimizer, examples, max_batch_tokens=16384, grad_clip=1.0, prompt_weight=0.0,
                    layout="padded"):
    """One SFT step (warm-up and stage 1) on (prompt_text, completion_text) pairs: token-mean negative
    log-likelihood of the completion plus end-of-turn. prompt_weight > 0 adds that times the token-mean
    language-modelling loss on the prompt tokens (the tiny model's stand-in for pretraining: every token is
    a training signal, which teaches it to read the task and copy names far sooner than the ~15 completion
    tokens alone). Returns the completion loss."""
    tokenizer, model = policy.tokenizer, policy.model
    stop = policy.stop_ids[0] if policy.stop_ids else tokenizer.eos_token_id
    prompts = [encode_chat(tokenizer, p) for p, _ in examples]
    completions = [tokenizer(c, add_special_tokens=False)["input_ids"] + [stop] for _, c in examples]
    prompt_part = torch.zeros(len(prompts), dtype=torch.long)  # leading scored tokens that belong to the prompt
    if prompt_weight > 0:  # score the whole sequence after its first token; weights split prompt/completion
        completions = [p[1:] + c for p, c in zip(prompts, completions)]
        prompt_part = torch.tensor([len(p) - 1 for p in prompts])
        prompts = [p[:1] for p in prompts]
    mask = response_mask(completions)                                               # (B, R)
    is_prompt = (torch.arange(mask.shape[1])[None, :] < prompt_part[:, None]).float()  # (B, R)
    answer = mask * (1 - is_prompt)                                                 # (B, R)
    weights = answer / answer.sum() + prompt_weight * is_prompt / is_prompt.sum().clamp(min=1)
    value = 0.0
    model.train()
    optimizer.zero_grad(set_to_none=True)
    for rows in micro_batches(prompts, completions, max_batch_tokens):
        logp, _ = forward_logprobs(model, [prompts[i] for i in rows], [completions[i] for i in rows],
                                   policy.pad_id, layout=layout)                    # (b, r)
        micro_loss = -(logp * weights[rows, :logp.shape[1]].to(logp.device)).sum()
        micro_loss.backward()
        value += float(-(logp.detach() * (answer[rows, :logp.shape[1]] / answer.sum()).to(logp.device)).sum())
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if math.isfinite(value) and torch.isfinite(grad_norm):  # a NaN/inf loss or gradient: skip the step
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return value


def save_metrics_line(path, record):
    """Append one JSON line and flush it to disk (a crash loses at most the line being written)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
