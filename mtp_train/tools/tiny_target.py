"""Build the tiny default target that ships in ``recipes/tiny/target/``.

Reproduce it with::

    .venv/bin/python -m mtp_train.tools.tiny_target --out recipes/tiny/target

Steps, all seeded and CPU-only:

1. Train a byte-level BPE tokenizer (vocab 4096) on the SGD train split (``data/sgd``).
2. Render every SGD dialogue with the chat template below, pack the token stream
   into fixed windows and train a small Llama from scratch for a fixed token budget.
3. Measure the quality bar on the SGD dev split (loss, greedy replies, distinct-2)
   and write it to ``quality.json`` beside the model, together with the greedy
   token ids that the tests compare against.

The chat template marks assistant turns with ``{% generation %}`` so that
``apply_chat_template(return_assistant_tokens_mask=True)`` yields a loss mask.

The tiny DeepSeek-V2 target (:mod:`mtp_train.tools.tiny_deepseek`) reuses this tokenizer and the data, training
(``train_lm``) and quality (``measure_quality``) functions below.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
SGD_DIR = REPO / "data" / "sgd"

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
END_OF_TURN = "<|eot|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
SPECIAL_TOKENS = [BOS, EOS, PAD, END_OF_TURN, *ROLE_TOKENS.values()]

# Each turn is "<|role|>" + content + "<|eot|>"; the assistant's content and its
# end-of-turn token are inside {% generation %}, so they form the loss mask.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|assistant|>' }}{% generation %}{{ message['content'] }}{{ '<|eot|>' }}{% endgeneration %}"
    "{% elif message['role'] in ['system', 'user'] %}"
    "{{ '<|' + message['role'] + '|>' }}{{ message['content'] }}{{ '<|eot|>' }}"
    "{% else %}"
    "{{ raise_exception('unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

# Three fixed prompts for the quality bar: one per common SGD domain.
QUALITY_PROMPTS = [
    "I am feeling hungry so I would like to find a place to eat.",
    "I need to book a flight to Seattle next Friday.",
    "Can you help me find a movie to watch this weekend?",
]

SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


def read_sgd(split: str) -> list[list[dict[str, str]]]:
    """Return the SGD ``split`` ("train" or "dev") as OpenAI-style message lists."""
    path = SGD_DIR / f"sgd_{split}_sharegpt.jsonl.gz"
    dialogues = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            dialogues.append(
                [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in row["conversations"]]
            )
    return dialogues


def train_tokenizer(dialogues: list[list[dict[str, str]]], vocab_size: int):
    """Train a byte-level BPE on the raw turn texts and wrap it for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((m["content"] for d in dialogues for m in d), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=END_OF_TURN,
        pad_token=PAD,
        additional_special_tokens=[EOS, *ROLE_TOKENS.values()],
        model_max_length=2048,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def encode_dialogues(tokenizer, dialogues: list[list[dict[str, str]]]) -> list[list[int]]:
    """Render each dialogue with the chat template and tokenize it: a list of token id lists."""
    texts = tokenizer.apply_chat_template(dialogues, tokenize=False)
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def pack(docs: list[list[int]], seq_len: int) -> torch.Tensor:
    """Concatenate documents and cut into windows: ``[num_windows, seq_len + 1]`` int64."""
    stream = torch.tensor([t for d in docs for t in d], dtype=torch.long)
    n = (stream.numel() - 1) // seq_len
    starts = torch.arange(n) * seq_len
    return torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])


def make_config(vocab_size: int, tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids(END_OF_TURN),
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% of ``peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


@torch.no_grad()
def dev_loss(model, windows: torch.Tensor, batch_size: int) -> float:
    """Mean next-token cross-entropy (nats) over all tokens of ``windows`` ``[N, S+1]``."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        w = windows[i : i + batch_size]
        logits = model(input_ids=w[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum"
        )
        total += loss.item()
        count += w[:, 1:].numel()
    model.train()
    return total / count


def batches(windows: torch.Tensor, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless epochs over ``windows``, reshuffled each epoch from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(windows.shape[0], generator=gen)
        for i in range(0, order.numel() - batch_size + 1, batch_size):
            yield windows[order[i : i + batch_size]]


def distinct_n(token_lists: list[list[int]], n: int = 2) -> float:
    """Unique n-grams over total n-grams, pooled over all lists."""
    grams = [tuple(t[i : i + n]) for t in token_lists for i in range(len(t) - n + 1)]
    return len(set(grams)) / max(1, len(grams))


def max_repeat_fraction(tokens: list[int], n: int = 4) -> float:
    """Share of n-grams that are repeats; near 1 means the text loops."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return 1.0 - len(set(grams)) / max(1, len(grams))


@torch.no_grad()
def greedy_replies(model, tokenizer, prompts: list[list[dict[str, str]]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuation ids (without the prompt) for each chat ``prompts`` entry."""
    model.eval()
    out = []
    for messages in prompts:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
            "input_ids"
        ]
        gen = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
        )
        out.append(gen[0, ids.shape[1] :].tolist())
    return out


def train_lm(model, train: torch.Tensor, batch_size: int, epochs: float, lr: float, seed: int, t0: float) -> int:
    """Train ``model`` on the windows ``train`` ``[N, S+1]`` for ``epochs`` passes: AdamW (weight decay 0.1 on
    matrices only, betas 0.9/0.95), 2% linear warmup, cosine decay, gradient clipping at 1. Returns the steps."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )
    total_steps = int(epochs * train.shape[0] / batch_size)
    warmup = max(1, total_steps // 50)
    model.train()
    data = batches(train, batch_size, seed)
    for step in range(total_steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total_steps, lr, warmup)
        w = next(data)
        logits = model(input_ids=w[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == total_steps - 1:
            rate = (step + 1) * w[:, 1:].numel() / (time.time() - t0)
            print(f"step {step}/{total_steps} loss {loss.item():.3f} ({rate:,.0f} tok/s so far)", flush=True)
    return total_steps


def measure_quality(model, tokenizer, dev: torch.Tensor, dev_dialogues, seed: int, train_tokens_seen: int) -> dict:
    """The quality bar: dev loss over all of ``dev``, distinct-2 of greedy replies to 50 seeded dev prompts, and
    the fixed prompts' greedy ids and replies (``train_seconds`` is left to the caller)."""
    loss = dev_loss(model, dev, batch_size=32)
    print(f"dev loss {loss:.4f}")

    fixed = greedy_replies(model, tokenizer, [[{"role": "user", "content": q}] for q in QUALITY_PROMPTS], 48)
    rng = random.Random(seed)
    dev_prompts = [d[:1] for d in rng.sample(dev_dialogues, 50)]
    continuations = greedy_replies(model, tokenizer, dev_prompts, 48)
    return {
        "seed": seed,
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_tokens_seen": train_tokens_seen,
        "dev_loss": round(loss, 4),
        "distinct_2_of_50_greedy": round(distinct_n(continuations, 2), 4),
        "fixed_prompts": [
            {
                "prompt": q,
                "greedy_ids": ids,
                "reply": tokenizer.decode(ids, skip_special_tokens=True),
                "repeat_4gram_fraction": round(max_repeat_fraction(ids), 4),
            }
            for q, ids in zip(QUALITY_PROMPTS, fixed)
        ],
    }


def print_quality(quality: dict) -> None:
    print(json.dumps({k: v for k, v in quality.items() if k != "fixed_prompts"}, indent=2))
    for item in quality["fixed_prompts"]:
        print(f"> {item['prompt']}\n< {item['reply']}")


def add_training_args(p: argparse.ArgumentParser, epochs: float) -> None:
    """The training options both tiny targets' builders take (``--epochs`` defaults to ``epochs``)."""
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--epochs", type=float, default=epochs, help="training budget in passes over the train split")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)


def seed_and_threads(args: argparse.Namespace) -> None:
    """Seed torch and ``random`` with ``--seed`` and set torch's threads to ``--threads``."""
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.set_num_threads(args.threads)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "recipes" / "tiny" / "target")
    p.add_argument("--vocab-size", type=int, default=4096)
    add_training_args(p, epochs=1.5)
    args = p.parse_args(argv)

    from transformers import LlamaForCausalLM

    seed_and_threads(args)
    t0 = time.time()

    train_dialogues, dev_dialogues = read_sgd("train"), read_sgd("dev")
    tokenizer = train_tokenizer(train_dialogues, args.vocab_size)
    train = pack(encode_dialogues(tokenizer, train_dialogues), args.seq_len)
    dev = pack(encode_dialogues(tokenizer, dev_dialogues), args.seq_len)
    print(f"tokenizer: {len(tokenizer)} tokens; train {train.numel():,} tokens, dev {dev.numel():,} tokens")

    config = make_config(len(tokenizer), tokenizer)
    model = LlamaForCausalLM(config)
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters")
    total_steps = train_lm(model, train, args.batch_size, args.epochs, args.lr, args.seed, t0)
    quality = measure_quality(
        model, tokenizer, dev, dev_dialogues, args.seed, total_steps * args.batch_size * args.seq_len
    )
    quality["train_seconds"] = round(time.time() - t0, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = [config.eos_token_id, tokenizer.convert_tokens_to_ids(EOS)]
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    (args.out / "quality.json").write_text(json.dumps(quality, indent=2) + "\n")
    print_quality(quality)


if __name__ == "__main__":
    main()
