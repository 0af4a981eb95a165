#!/usr/bin/env python3
"""Make tiny GGUF models with random weights and real architectures, for fast exact unit tests.

The models run in real llama.cpp: a byte-level BPE tokenizer (GPT-2 byte alphabet, a few merges,
ChatML special tokens and template), `llama` or `qwen2` blocks, F32 or a quantized type. A draft
for a tiny target is made by `derive`-ing a prefix of its blocks with via_edge.slim; keeping the
residual branches small (`--block-scale`) makes later blocks perturb rather than replace the
earlier ones, so a prefix agrees with the whole model often but not always, as real slims do
(with the defaults, a 2-of-4-block prefix agrees with the target on 70-90% of greedy tokens).

    python tools/make_tiny_gguf.py out.gguf --arch qwen2 --blocks 4 --seed 1
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2.5-Coder's fill-in-the-middle tokens, by llama.cpp's metadata key (`fim=True`)
FIM_TOKENS = {"fim_pre": "<|fim_prefix|>", "fim_suf": "<|fim_suffix|>", "fim_mid": "<|fim_middle|>",
              "fim_pad": "<|fim_pad|>", "fim_rep": "<|repo_name|>", "fim_sep": "<|file_sep|>"}
MERGES = [
    ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("a", "n"), ("Ġ", "a"),
    ("o", "n"), ("r", "e"), ("Ġ", "s"), ("e", "n"), ("a", "t"), ("o", "r"), ("Ġ", "w"),
    ("Ġ", "c"), ("i", "s"), ("Ġ", "f"), ("e", "s"), ("i", "t"), ("Ġ", "b"),
]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (what byte-level BPE stores)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def vocabulary(extra_tokens: int = 0, fim: bool = False) -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types and merges: 256 bytes, merged pairs, filler, then the special tokens."""
    tokens = list(bytes_to_unicode().values())
    merges = []
    for a, b in MERGES:
        tokens.append(a + b)
        merges.append(f"{a} {b}")
    tokens += [f"<|filler_{i}|>" for i in range(extra_tokens)]
    types = [1] * len(tokens)
    special = SPECIAL_TOKENS + (list(FIM_TOKENS.values()) if fim else [])
    tokens += special
    types += [3] * len(special)
    return tokens, types, merges


def cyclic_head(embd: np.ndarray, rng: np.random.Generator, eos: int, n_eos_after: int) -> np.ndarray:
    """An LM head under which each token's successor is its neighbour on one long random cycle.

    A random head on a tiny model falls into fixed points (the same token forever); this one
    makes text that wanders through the whole vocabulary, perturbed by what the blocks add, and
    makes EOS the likely successor of `n_eos_after` tokens, so EOS turns up inside drafts.
    """
    n = embd.shape[0]
    order = rng.permutation([t for t in range(n) if t != eos])
    head = np.zeros_like(embd)
    for a, b in zip(order, np.roll(order, -1)):
        head[b] = embd[a]  # logit of b is high right after a
    head[eos] = 1.1 * embd[order[: n_eos_after]].sum(axis=0)
    return head


def make_tiny_gguf(
    path: str | Path,
    *,
    arch: str = "qwen2",
    blocks: int = 4,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    context_length: int = 512,
    seed: int = 0,
    block_scale: float = 1.0,
    block_scales: "list[float] | None" = None,
    tied: bool = False,
    dtype: str = "F32",
    extra_tokens: int = 0,
    eos_after: int = 3,
    fim: bool = False,
) -> Path:
    """Write a tiny model; weights depend only on `seed`, so equal seeds give equal files.

    `block_scales` sets each block's residual scale (default `block_scale` for all): near-zero
    blocks barely matter, large ones dominate, which plants a known best slim for search tests.
    `fim` adds Qwen2.5-Coder's fill-in-the-middle tokens and declares them in the metadata.
    """
    import gguf

    if arch not in ("llama", "qwen2"):
        raise ValueError("arch must be llama or qwen2")
    qtype = {"F32": gguf.GGMLQuantizationType.F32, "F16": gguf.GGMLQuantizationType.F16,
             "Q8_0": gguf.GGMLQuantizationType.Q8_0, "Q4_0": gguf.GGMLQuantizationType.Q4_0}[dtype]
    rng = np.random.default_rng(seed)
    tokens, types, merges = vocabulary(extra_tokens, fim)
    n_vocab = len(tokens)
    head_dim = n_embd // n_head
    n_kv = n_head_kv * head_dim

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), arch)
    w.add_name(f"tiny-{arch}-{blocks}b-s{seed}")
    w.add_context_length(context_length)
    w.add_embedding_length(n_embd)
    w.add_block_count(blocks)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "F32" else gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    if fim:
        for key, text in FIM_TOKENS.items():
            w.add_uint32(f"tokenizer.ggml.{key}_token_id", tokens.index(text))
    w.add_chat_template(CHATML_TEMPLATE)

    def add(name: str, shape: tuple[int, ...], scale: float, quantize: bool = True) -> None:
        data = (rng.standard_normal(shape) * scale).astype(np.float32)
        if quantize and len(shape) == 2 and qtype != gguf.GGMLQuantizationType.F32:
            if qtype == gguf.GGMLQuantizationType.F16:
                w.add_tensor(name, data.astype(np.float16))
            else:
                w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, data)

    def add_norm(name: str, size: int) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32))

    inv = 1.0 / np.sqrt(n_embd)
    embd = rng.standard_normal((n_vocab, n_embd)).astype(np.float32)
    w.add_tensor("token_embd.weight", embd)
    scales = list(block_scales) if block_scales is not None else [block_scale] * blocks
    if len(scales) != blocks:
        raise ValueError(f"block_scales needs {blocks} values")
    for i in range(blocks):
        p = f"blk.{i}."
        scale = scales[i]
        add_norm(p + "attn_norm.weight", n_embd)
        add(p + "attn_q.weight", (n_embd, n_embd), inv)
        add(p + "attn_k.weight", (n_kv, n_embd), inv)
        add(p + "attn_v.weight", (n_kv, n_embd), inv)
        if arch == "qwen2":
            add(p + "attn_q.bias", (n_embd,), 0.1)
            add(p + "attn_k.bias", (n_kv,), 0.1)
            add(p + "attn_v.bias", (n_kv,), 0.1)
        add(p + "attn_output.weight", (n_embd, n_embd), inv * scale)
        add_norm(p + "ffn_norm.weight", n_embd)
        add(p + "ffn_gate.weight", (n_ff, n_embd), inv)
        add(p + "ffn_up.weight", (n_ff, n_embd), inv)
        add(p + "ffn_down.weight", (n_embd, n_ff), scale / np.sqrt(n_ff))
    add_norm("output_norm.weight", n_embd)
    if not tied:
        w.add_tensor("output.weight", cyclic_head(embd, rng, eos=tokens.index("<|im_end|>"), n_eos_after=eos_after))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--arch", default="qwen2", choices=["llama", "qwen2"])
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--embd", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-scale", type=float, default=1.0)
    ap.add_argument("--dtype", default="F32", choices=["F32", "F16", "Q8_0", "Q4_0"])
    ap.add_argument("--tied", action="store_true", help="LM head tied to the embeddings (else cyclic_head)")
    ap.add_argument("--fim", action="store_true", help="add Qwen2.5-Coder's fill-in-the-middle tokens")
    a = ap.parse_args()
    make_tiny_gguf(a.out, arch=a.arch, blocks=a.blocks, n_embd=a.embd, seed=a.seed,
                   block_scale=a.block_scale, dtype=a.dtype, tied=a.tied, fim=a.fim)
    print(a.out)


if __name__ == "__main__":
    main()
