"""Train the bundled tiny MoE models deterministically on CPU.

    python -m sgl_pd.models.train_tiny_moe --arch deepseek_v3   # -> tiny_deepseek_v3/
    python -m sgl_pd.models.train_tiny_moe --arch qwen3_moe     # -> tiny_qwen3_moe/
    python -m sgl_pd.models.train_tiny_moe --arch mellum        # -> tiny_mellum/
    python -m sgl_pd.models.train_tiny_moe --arch gemma3        # -> tiny_gemma3/
    python -m sgl_pd.models.train_tiny_moe --arch qwen3_next    # -> tiny_qwen3_next/
    python -m sgl_pd.models.train_tiny_moe --arch deepseek_v3 --steps 100 --out /tmp/ds

Same corpus and tokenizer as the tiny Llama (``train_tiny.build_corpus``). DeepSeek-V3 (MLA,
MoE, one NextN/MTP layer) trains the main model and the MTP layer jointly: the MTP loss
sees the main model's hidden states and embeddings detached, so it does not change what
the main model learns. ``--steps 0`` writes seeded random weights. Same seed + same
``--threads`` + same library versions => byte-identical files.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from sgl_pd.models import MODELS_DIR
from sgl_pd.models.train_tiny import (
    END,
    EOS,
    build_corpus,
    write_json,
    write_tokenizer_files,
)

ARCHS = ("deepseek_v3", "qwen3_moe", "mellum", "gemma3", "qwen3_next")
DEFAULT_STEPS = {
    "deepseek_v3": 3000, "qwen3_moe": 1000, "mellum": 1000, "gemma3": 1000, "qwen3_next": 1000,
}  # fmt: skip
MAX_POSITIONS = 16384
# the sliding-window layers of Mellum and Gemma 3 see this many tokens (the token itself
# included): shorter than most test prompts, so that serving them exercises the window
SLIDING_WINDOW = 16


def model_config(arch: str, vocab_size: int, eos_id: int, end_id: int) -> dict[str, Any]:
    """The ``config.json`` written for `arch` (also what training builds the model from)."""
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "bos_token_id": eos_id,
        "eos_token_id": [eos_id, end_id],
        "pad_token_id": eos_id,
        "torch_dtype": "float32",
    }
    if arch == "deepseek_v3":
        return {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            **common,
            "intermediate_size": 256,
            "moe_intermediate_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "n_shared_experts": 1,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 1.0,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "norm_topk_prob": True,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "kv_lora_rank": 64,
            "q_lora_rank": 96,
            "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 32,
            "v_head_dim": 32,
            "num_nextn_predict_layers": 1,
            # SGLang's CPU RoPE only knows DeepSeek's yarn; factor 1 is plain RoPE, and an
            # original length equal to the maximum keeps its cos/sin cache full length
            "rope_scaling": {
                "type": "yarn",
                "factor": 1.0,
                "original_max_position_embeddings": MAX_POSITIONS,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            "rope_interleave": True,
            "attention_bias": False,
        }
    if arch == "mellum":
        # Qwen3-MoE's attention and experts, with sliding-window and full-attention layers
        # (SGLang keeps them in two pools: its hybrid SWA pool) and dense and MoE MLPs
        return {
            "architectures": ["MellumForCausalLM"],
            "model_type": "mellum",
            **{k: v for k, v in common.items() if k not in ("rope_theta", "torch_dtype")},
            "dtype": "float32",
            "intermediate_size": 256,
            "moe_intermediate_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "attention_bias": False,
            "sliding_window": SLIDING_WINDOW,
            "layer_types": [
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "sliding_attention",
            ],
            "mlp_layer_types": ["dense", "sparse", "dense", "sparse"],
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        }
    if arch == "gemma3":
        # Gemma 3's text model: five sliding-window layers, then a full-attention one.
        # SGLang serves it with its hybrid SWA pool off (one pool, the window applied in
        # attention); its loader ties the head to the embedding, so the model does too
        return {
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            **{k: v for k, v in common.items() if k not in ("rope_theta", "torch_dtype")},
            "dtype": "float32",
            "tie_word_embeddings": True,
            "hidden_activation": "gelu_pytorch_tanh",
            "intermediate_size": 256,
            "num_hidden_layers": 6,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "attention_bias": False,
            "sliding_window": SLIDING_WINDOW,
            "layer_types": [*(["sliding_attention"] * 5), "full_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        }
    if arch == "qwen3_next":
        # Qwen3-Next: three gated-DeltaNet (linear attention) layers, then a gated
        # full-attention one, every MLP a MoE with a shared expert (as SGLang builds it).
        # SGLang reads the layer pattern from full_attention_interval (transformers writes
        # only layer_types) and the RoPE base from a top-level rope_theta
        return {
            "architectures": ["Qwen3NextForCausalLM"],
            "model_type": "qwen3_next",
            **{k: v for k, v in common.items() if k != "torch_dtype"},
            "dtype": "float32",
            "num_hidden_layers": 4,
            "full_attention_interval": 4,
            "layer_types": [*(["linear_attention"] * 3), "full_attention"],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "partial_rotary_factor": 0.25,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "linear_conv_kernel_dim": 4,
            "intermediate_size": 256,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "attention_bias": False,
        }
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **common,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "attention_bias": False,
        "use_sliding_window": False,
        "rope_scaling": None,
    }


def build_model(arch: str, cfg: dict[str, Any]) -> tuple[Any, Any]:
    """(model, mtp layer or None), freshly initialized from the global torch seed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.for_model(**cfg)
    hf_cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(hf_cfg).float()
    if arch != "deepseek_v3":
        return model, None
    from sgl_pd.models.nextn_mtp import NextNLayer

    mtp = NextNLayer(model.config).float()
    for module in mtp.modules():  # the main model's initializer (experts start uninitialized)
        model._init_weights(module)
    return model, mtp


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--arch", choices=ARCHS, required=True)
    p.add_argument("--out", type=Path, default=None, help="default: sgl_pd/models/tiny_<arch>")
    p.add_argument("--steps", type=int, default=None, help=f"optimizer steps {DEFAULT_STEPS}")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128, help="tokens per training sequence")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--mtp-weight", type=float, default=1.0, help="weight of the MTP loss")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (fix for determinism)")
    p.add_argument("--num-docs", type=int, default=24000, help="size of the generated corpus")
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--log-every", type=int, default=100)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    steps = DEFAULT_STEPS[args.arch] if args.steps is None else args.steps
    out: Path = args.out or MODELS_DIR / f"tiny_{args.arch}"

    import torch
    import torch.nn.functional as F
    from safetensors.torch import save_file

    from sgl_pd.models.nextn_mtp import checkpoint_state_dict

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    t_start = time.time()

    tok, data = build_corpus(args.seed, args.num_docs, args.seq_len, args.vocab_size)
    eos_id, end_id = tok.token_to_id(EOS), tok.token_to_id(END)
    cfg = model_config(args.arch, tok.get_vocab_size(), eos_id, end_id)
    model, mtp = build_model(args.arch, cfg)
    params = list(model.parameters()) + (list(mtp.parameters()) if mtp is not None else [])
    n_main = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for p in mtp.parameters()) if mtp is not None else 0
    print(f"model: {n_main / 1e6:.2f}M parameters, MTP layer {n_mtp / 1e6:.2f}M", flush=True)

    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    warmup = max(1, min(200, steps // 10))

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return args.lr * (0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * progress)))

    def mtp_logits(batch_in: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """MTP logits (batch, seq - 1, vocab) for tokens t+2 from (h_t, token t+1); the
        target's hidden states, embedding and head enter detached."""
        assert mtp is not None
        positions = torch.arange(hidden.shape[1] - 1).unsqueeze(0)
        next_embeds = model.model.embed_tokens(batch_in[:, 1:]).detach()
        rope = model.model.rotary_emb(hidden, positions)
        y = mtp(next_embeds, hidden[:, :-1].detach(), rope)
        return F.linear(y, model.lm_head.weight.detach())

    gen = torch.Generator().manual_seed(args.seed)
    model.train()
    t_train = time.time()
    running = [0.0, 0.0]
    losses = [float("nan"), float("nan")]
    for step in range(steps):
        idx = torch.randint(0, data.shape[0], (args.batch_size,), generator=gen)
        batch = data[idx]
        inputs, labels = batch[:, :-1], batch[:, 1:]
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        hidden = model.model(input_ids=inputs).last_hidden_state  # (batch, seq, hidden), normed
        logits = model.lm_head(hidden)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        total = loss
        if mtp is not None:
            m_logits = mtp_logits(inputs, hidden)
            mtp_loss = F.cross_entropy(
                m_logits.reshape(-1, m_logits.shape[-1]), batch[:, 2:].reshape(-1)
            )
            total = loss + args.mtp_weight * mtp_loss
            losses[1] = mtp_loss.item()
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if mtp is not None:
            torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
        opt.step()
        losses[0] = loss.item()
        running = [r + v for r, v in zip(running, losses, strict=True)]
        if (step + 1) % args.log_every == 0 or step + 1 == steps:
            n = (step % args.log_every) + 1
            mtp_part = f"  mtp {running[1] / n:.4f}" if mtp is not None else ""
            print(
                f"step {step + 1:5d}/{steps}  loss {running[0] / n:.4f}{mtp_part}  "
                f"lr {lr_at(step):.2e}  {time.time() - t_train:6.1f}s",
                flush=True,
            )
            running = [0.0, 0.0]
    train_s = time.time() - t_train

    # Output files.
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    tensors = checkpoint_state_dict(model)
    if cfg["tie_word_embeddings"]:
        tensors.pop("lm_head.weight", None)  # (the embedding's: stored once)
    if mtp is not None:
        mtp.eval()
        tensors.update(mtp.checkpoint_tensors())
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    write_json(out / "config.json", cfg)
    write_json(
        out / "generation_config.json",
        {"bos_token_id": eos_id, "eos_token_id": [eos_id, end_id], "pad_token_id": eos_id,
         "do_sample": False},
    )  # fmt: skip
    write_tokenizer_files(out, tok, MAX_POSITIONS)
    print(
        f"wrote {out} ({(out / 'model.safetensors').stat().st_size / 1e6:.2f} MB weights, "
        f"{len(tensors)} tensors); train {train_s:.0f}s, total {time.time() - t_start:.0f}s, "
        f"final loss {losses[0]:.4f}" + (f", mtp loss {losses[1]:.4f}" if mtp else ""),
        flush=True,
    )
    for name in sorted(p.name for p in out.iterdir()):
        digest = hashlib.sha256((out / name).read_bytes()).hexdigest()[:16]
        print(f"  sha256[:16] {digest}  {name}", flush=True)
    report_samples(out, eos_id, model if mtp is not None else None, mtp_logits)
    return 0


def report_samples(out: Path, eos_id: int, model: Any, mtp_logits: Any) -> None:
    """Greedy samples through the saved files (transformers reloads them), and for
    DeepSeek how often the MTP layer's top-1 guess equals the main model's greedy token
    two steps ahead on those samples (an estimate of NEXTN chain acceptance)."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast.from_pretrained(out)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompts = ["Count: 41 42 43", "Days: Friday", "3 + 4 =", "The cow says"]
    chats = ["What is 2 + 5?", "Count from 12.", "Name the days of the week."]
    texts = prompts + [
        hf_tok.apply_chat_template(
            [{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True
        )
        for c in chats
    ]
    hits = total = 0
    for i, text in enumerate(texts):
        ids = hf_tok(text, add_special_tokens=i < len(prompts), return_tensors="pt").input_ids
        with torch.no_grad():
            gen_ids = reloaded.generate(
                ids, max_new_tokens=32, do_sample=False, pad_token_id=eos_id
            )
            if model is not None:
                hidden = model.model(input_ids=gen_ids).last_hidden_state
                guess = mtp_logits(gen_ids, hidden).argmax(-1)[0]  # guess[t] ~ token t+2
                # NEXTN's first draft guesses token L + 1 from (h_{L-1}, token L), L = len(prompt)
                n = ids.shape[1]
                hits += int((guess[n - 1 : -1] == gen_ids[0, n + 1 :]).sum())
                total += gen_ids.shape[1] - n - 1
        completion = hf_tok.decode(gen_ids[0, ids.shape[1] :], skip_special_tokens=False)
        print(f"  {text!r} -> {completion!r}", flush=True)
    if total:
        print(f"MTP top-1 agreement with greedy t+2 on the samples: {hits / total:.3f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
