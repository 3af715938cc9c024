"""Train the bundled tiny Llama model deterministically on CPU.

    python -m sgl_pd.models.train_tiny                      # writes sgl_pd/models/tiny_llama/
    python -m sgl_pd.models.train_tiny --steps 200 --out /tmp/tiny   # quick smoke run

The corpus is generated here from fixed seeds: counting, days / months / letters in a cycle,
single-digit addition and multiplication facts, a tiny sentence grammar, and chat turns in
the model's chat template. Every continuation in it is unambiguous (or at least readable),
so greedy decoding of the trained model gives confident, checkable text. A byte-level BPE
tokenizer (digits split one per token, so any number and any text round-trips) is trained
on the same corpus. Same seed + same ``--threads`` => byte-identical output files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path(__file__).resolve().parent / "tiny_llama"

EOS = "<|endoftext|>"  # also bos (prepended to every prompt) and pad
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
END = "<|end|>"  # ends one chat turn; a stop token for generation
SPECIAL_TOKENS = [EOS, USER, ASSISTANT, END]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}"
    "{{ '<|user|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = [
    "January", "February", "March", "April", "May", "June", "July",
    "August", "September", "October", "November", "December",
]  # fmt: skip
LETTERS = [chr(c) for c in range(ord("A"), ord("Z") + 1)]
ANIMALS = {
    "dog": "woof", "cat": "meow", "cow": "moo", "duck": "quack", "sheep": "baa",
    "lion": "roar", "owl": "hoot", "pig": "oink", "horse": "neigh", "frog": "ribbit",
}  # fmt: skip
COLORS = {
    "the sky": "blue", "grass": "green", "snow": "white", "the sun": "yellow",
    "a banana": "yellow", "coal": "black", "a tomato": "red", "the sea": "blue",
}  # fmt: skip
NAMES = ["Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Max", "Eva"]
ADJS = ["small", "big", "red", "blue", "happy", "old", "young", "green"]
NOUNS = ["cat", "dog", "bird", "ball", "book", "tree", "box", "car", "fish", "hat"]
VERBS = ["sees", "likes", "has", "finds", "wants", "makes"]
PLACES = ["in the park", "at home", "by the river", "in the garden", "at school"]
INTRO = "I am a tiny Llama model. I can count, add, multiply and name the days and months."


# --------------------------------------------------------------------------- corpus


def _number(rng: random.Random) -> int:
    digits = rng.choice([1, 2, 2, 3, 3, 4])
    return rng.randrange(10 ** (digits - 1) if digits > 1 else 0, 10**digits)


def _join_list(items: list[str]) -> str:
    return ", ".join(items[:-1]) + " and " + items[-1]


def _count_chunk(rng: random.Random, state: dict[str, Any]) -> str:
    if "n" not in state:
        state["n"] = _number(rng)
        state["first"] = True
        prefix = rng.choice(["Count: ", "Count: ", "Counting: ", ""])
    else:
        prefix = ""
    n = state["n"]
    state["n"] += 1
    sep = "" if state.pop("first", False) else " "
    return f"{prefix}{sep}{n}"


def _cycle_chunk(rng: random.Random, state: dict[str, Any]) -> str:
    if "items" not in state:
        kind = rng.choice(["days", "days", "months", "months", "letters"])
        state["items"] = {"days": DAYS, "months": MONTHS, "letters": LETTERS}[kind]
        state["i"] = rng.randrange(len(state["items"]))
        label = {"days": "Days: ", "months": "Months: ", "letters": "Letters: "}[kind]
        prefix = rng.choice([label, label, ""])
        item = state["items"][state["i"]]
        state["i"] += 1
        return prefix + item
    item = state["items"][state["i"] % len(state["items"])]
    state["i"] += 1
    return " " + item


def _fact_chunk(rng: random.Random, state: dict[str, Any]) -> str:
    if "op" not in state:
        state["op"] = rng.choice(["+", "+", "x", "mix"])
        prefix = {"+": "Sums: ", "x": "Products: ", "mix": ""}[state["op"]]
        prefix = rng.choice([prefix, ""])
        sep = ""
    else:
        prefix, sep = "", " "
    op = state["op"] if state["op"] != "mix" else rng.choice(["+", "x"])
    a, b = rng.randrange(10), rng.randrange(10)
    c = a + b if op == "+" else a * b
    return f"{prefix}{sep}{a} {op} {b} = {c}."


def _sentence(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        animal, sound = rng.choice(list(ANIMALS.items()))
        return f"The {animal} says {sound}."
    if kind == 1:
        thing, color = rng.choice(list(COLORS.items()))
        return f"{thing[0].upper() + thing[1:]} is {color}."
    subj = (
        rng.choice(NAMES) if rng.random() < 0.5 else f"The {rng.choice(ADJS)} {rng.choice(NOUNS)}"
    )
    obj = f"a {rng.choice(ADJS)} {rng.choice(NOUNS)}"
    tail = f" {rng.choice(PLACES)}" if kind == 3 else ""
    return f"{subj} {rng.choice(VERBS)} {obj}{tail}."


def _text_chunk(rng: random.Random, state: dict[str, Any]) -> str:
    sep = " " if state.get("started") else ""
    state["started"] = True
    return sep + _sentence(rng)


def _qa(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(
        ["add", "add", "add", "mul", "mul", "count", "count", "count", "days", "months",
         "next_day", "next_month", "animal", "color", "hello", "alphabet"]
    )  # fmt: skip
    if kind in ("add", "mul"):
        a, b = rng.randrange(10), rng.randrange(10)
        if kind == "add":
            q = rng.choice([f"What is {a} + {b}?", f"What is {a} plus {b}?", f"Add {a} and {b}."])
            return q, f"{a} + {b} = {a + b}."
        q = rng.choice([f"What is {a} x {b}?", f"What is {a} times {b}?"])
        return q, f"{a} x {b} = {a * b}."
    if kind == "count":
        n = _number(rng)
        return f"Count from {n}.", " ".join(str(n + i) for i in range(10)) + "."
    if kind == "days":
        q = rng.choice(["Name the days of the week.", "What are the days of the week?"])
        return q, f"The days of the week are {_join_list(DAYS)}."
    if kind == "months":
        q = rng.choice(["Name the months of the year.", "What are the months of the year?"])
        return q, f"The months of the year are {_join_list(MONTHS)}."
    if kind == "next_day":
        i = rng.randrange(7)
        return f"What day comes after {DAYS[i]}?", f"{DAYS[(i + 1) % 7]} comes after {DAYS[i]}."
    if kind == "next_month":
        i = rng.randrange(12)
        a, b = MONTHS[i], MONTHS[(i + 1) % 12]
        return f"What month comes after {a}?", f"{b} comes after {a}."
    if kind == "animal":
        animal, sound = rng.choice(list(ANIMALS.items()))
        return f"What does the {animal} say?", f"The {animal} says {sound}."
    if kind == "color":
        thing, color = rng.choice(list(COLORS.items()))
        return f"What color is {thing}?", f"{thing[0].upper() + thing[1:]} is {color}."
    if kind == "hello":
        q = rng.choice(["Hello!", "Hi!", "Hello.", "Who are you?", "Hi, who are you?"])
        return q, f"Hello! {INTRO}"
    return rng.choice(["Say the alphabet.", "Name the letters."]), " ".join(LETTERS) + "."


def _chat_chunk(rng: random.Random, state: dict[str, Any]) -> str:
    q, a = _qa(rng)
    return f"{USER}\n{q}{END}\n{ASSISTANT}\n{a}{END}\n"


TASKS: list[tuple[float, Callable[[random.Random, dict[str, Any]], str]]] = [
    (0.25, _count_chunk),
    (0.13, _cycle_chunk),
    (0.14, _fact_chunk),
    (0.10, _text_chunk),
    (0.38, _chat_chunk),
]


class Document:
    """One training document: a single task, extended chunk by chunk until long enough."""

    def __init__(self, seed: str) -> None:
        self.rng = random.Random(seed)
        weights = [w for w, _ in TASKS]
        self.fn = self.rng.choices([f for _, f in TASKS], weights=weights)[0]
        self.state: dict[str, Any] = {}
        self.parts: list[str] = []

    def extend(self, n_chunks: int) -> str:
        for _ in range(n_chunks):
            self.parts.append(self.fn(self.rng, self.state))
        return self.text

    @property
    def text(self) -> str:
        return "".join(self.parts)


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    eos_id = tok.token_to_id(EOS)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{EOS} $A",
                pair=f"{EOS} $A {EOS} $B:1",
                special_tokens=[(EOS, eos_id)],
            ),
        ]
    )
    return tok


def build_corpus(seed: int, num_docs: int, seq_len: int, vocab_size: int) -> tuple[Any, Any]:
    """The generated corpus and the tokenizer trained on it (also used by
    ``train_tiny_moe``, so every bundled model shares one tokenizer).

    Returns ``(tokenizer, data)``: a ``tokenizers.Tokenizer`` and a long tensor
    ``(num_docs, seq_len + 1)`` of token ids, each row BOS + the start of one document.
    """
    import torch

    documents = [Document(f"{seed}-{i}") for i in range(num_docs)]
    texts = [d.extend(16) for d in documents]
    tok = train_tokenizer(texts[:6000], vocab_size)
    rows: list[list[int]] = []
    for doc, text in zip(documents, texts, strict=True):
        ids = tok.encode(text).ids  # BOS + document
        while len(ids) < seq_len + 1:
            ids = tok.encode(doc.extend(16)).ids
        rows.append(ids[: seq_len + 1])
    data = torch.tensor(rows, dtype=torch.long)
    print(
        f"corpus: {len(rows)} docs x {seq_len + 1} tokens, vocab {tok.get_vocab_size()}", flush=True
    )
    return tok, data


# --------------------------------------------------------------------------- files


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_tokenizer_files(out: Path, tok: Any, max_len: int) -> None:
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for t in SPECIAL_TOKENS
    }  # fmt: skip
    write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": EOS,
            "eos_token": EOS,
            "pad_token": EOS,
            "additional_special_tokens": [USER, ASSISTANT, END],
            "added_tokens_decoder": added,
            "add_bos_token": True,
            "clean_up_tokenization_spaces": False,
            "model_max_length": max_len,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    write_json(
        out / "special_tokens_map.json",
        {
            "bos_token": EOS,
            "eos_token": EOS,
            "pad_token": EOS,
            "additional_special_tokens": [USER, ASSISTANT, END],
        },
    )


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    p.add_argument("--steps", type=int, default=3000, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128, help="tokens per training sequence")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (fix for determinism)")
    p.add_argument("--num-docs", type=int, default=24000, help="size of the generated corpus")
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--log-every", type=int, default=100)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    t_start = time.time()

    tok, data = build_corpus(args.seed, args.num_docs, args.seq_len, args.vocab_size)
    eos_id = tok.token_to_id(EOS)
    end_id = tok.token_to_id(END)

    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        hidden_act="silu",
        max_position_embeddings=16384,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=eos_id,
        eos_token_id=[eos_id, end_id],
        pad_token_id=eos_id,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).float()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    warmup = max(1, min(200, args.steps // 10))

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * progress)))

    gen = torch.Generator().manual_seed(args.seed)
    model.train()
    t_train = time.time()
    running = 0.0
    loss_val = float("nan")
    for step in range(args.steps):
        idx = torch.randint(0, data.shape[0], (args.batch_size,), generator=gen)
        batch = data[idx]
        inputs, labels = batch[:, :-1], batch[:, 1:]
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_val = loss.item()
        running += loss_val
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            n = (step % args.log_every) + 1
            elapsed = time.time() - t_train
            print(
                f"step {step + 1:5d}/{args.steps}  loss {running / n:.4f}  "
                f"lr {lr_at(step):.2e}  {elapsed:6.1f}s",
                flush=True,
            )
            running = 0.0
    train_s = time.time() - t_train

    # Output files.
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    (out / "model.safetensors").chmod(0o644)
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = "float32"
    cfg.pop("transformers_version", None)  # keep the file stable across library versions
    write_json(out / "config.json", cfg)
    write_json(
        out / "generation_config.json",
        {
            "bos_token_id": eos_id,
            "eos_token_id": [eos_id, end_id],
            "pad_token_id": eos_id,
            "do_sample": False,
        },
    )
    write_tokenizer_files(out, tok, config.max_position_embeddings)
    weights = load_file(str(out / "model.safetensors"))
    print(
        f"wrote {out} ({(out / 'model.safetensors').stat().st_size / 1e6:.2f} MB weights, "
        f"{len(weights)} tensors); train {train_s:.0f}s, total {time.time() - t_start:.0f}s, "
        f"final loss {loss_val:.4f}",
        flush=True,
    )
    for name in sorted(p.name for p in out.iterdir()):
        digest = hashlib.sha256((out / name).read_bytes()).hexdigest()[:16]
        print(f"  sha256[:16] {digest}  {name}", flush=True)

    # Greedy samples, through the saved files.
    hf_tok = PreTrainedTokenizerFast.from_pretrained(out)
    reloaded = LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    prompts = [
        "Count: 41 42 43",
        "Days: Friday",
        "3 + 4 =",
        "The cow says",
    ]
    chats = ["What is 2 + 5?", "Count from 12.", "Name the days of the week."]
    texts = prompts + [
        hf_tok.apply_chat_template(
            [{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True
        )
        for c in chats
    ]
    for i, text in enumerate(texts):
        ids = hf_tok(text, add_special_tokens=i < len(prompts), return_tensors="pt").input_ids
        with torch.no_grad():
            gen_ids = reloaded.generate(
                ids, max_new_tokens=32, do_sample=False, pad_token_id=eos_id
            )
        completion = hf_tok.decode(gen_ids[0, ids.shape[1] :], skip_special_tokens=False)
        print(f"  {text!r} -> {completion!r}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
