"""Builds the tiny model the real-engine tests serve (vLLM's and SGLang's)
with no download: a byte-level BPE tokenizer trained here on a few
sentences, and a random 2-layer Llama with a fixed seed. The build is deterministic; the weights' SHA-256 is checked
against ``TINY_MODEL_SHA256`` so a changed builder or library shows at once.

    python make_tiny_model.py DIR        (skips the build if DIR holds it)
"""

import hashlib
import os
import sys

#: SHA-256 of model.safetensors as this builder makes it: the same in the
#: vLLM venv (torch 2.13.0, transformers 5.19.0) and the SGLang venv (torch
#: 2.14.1, transformers 5.24.0), tokenizers 0.23.3 in both.
TINY_MODEL_SHA256 = "0ad600743a6ec9d9b732bcadcabd8acde56156b24e21c3287516fefcd91d221b"

CORPUS = [
    "A prefill worker computes the key and value cache of a prompt.",
    "A decode worker pulls those blocks and generates the next tokens.",
    "No block returns to the free list while a network card may still read it.",
    "Two small engines share one machine with two cores and a little memory.",
    "Greedy decoding gives the same tokens when the cache arrives intact.",
    "An aborted request keeps its blocks until a proof says they are free.",
]


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build(out: str) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 16, trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    hf_tok.save_pretrained(out)

    torch.manual_seed(20261204)
    cfg = LlamaConfig(
        vocab_size=len(hf_tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # head_dim 32; the CPU KV block is 2 heads x 32 tokens x 64 floats
        max_position_embeddings=1024,
        bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id,
        tie_word_embeddings=False,
        # Peaky logits: greedy argmax with few near-ties, so a token that
        # differs means the KV differed, not rounding.
        initializer_range=0.2,
        torch_dtype="float32",
    )
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)


def main() -> int:
    out = sys.argv[1]
    weights = os.path.join(out, "model.safetensors")
    if not os.path.exists(weights):
        build(out)
    got = sha256(weights)
    if got != TINY_MODEL_SHA256:
        print(f"tiny model {weights}: sha256 {got}, expected {TINY_MODEL_SHA256}", file=sys.stderr)
        return 1
    print(f"tiny model {out}: sha256 {got}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
