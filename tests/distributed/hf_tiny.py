"""Tiny Hugging Face models from configs (no downloads), their batches and loss: shared by the
HF test files. Import it after `pytest.importorskip("transformers")`."""

from __future__ import annotations

import torch
import transformers

STRATEGIES = {  # strategy -> bucketing, so every bucketing runs too
    "FULL_SHARD": "BLOCK",
    "SHARD_GRAD_OP": "LAYER",
    "NO_SHARD": "NONE",
    "HYBRID_SHARD": "BLOCK",
}
STEPS, ROWS_PER_RANK, SEQ, VOCAB = 3, 2, 8, 64


def gpt2() -> torch.nn.Module:
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16, bos_token_id=0,
        eos_token_id=0, pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(cfg)


def bert() -> torch.nn.Module:
    cfg = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=2,
        vocab_size=VOCAB, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=0,
    )
    return transformers.BertForMaskedLM(cfg)


def t5() -> torch.nn.Module:
    cfg = transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2,
        num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )
    return transformers.T5ForConditionalGeneration(cfg)


MODELS = {"gpt2": (gpt2, "GPT2Block"), "llama": (llama, "LlamaDecoderLayer"),
          "bert": (bert, "BertEmbeddings + 2 x BertLayer")}


def batches(name: str, world: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(1, VOCAB, (world * ROWS_PER_RANK, SEQ), generator=g)
        # Causal LMs shift labels inside; BERT's MLM labels every position (no -100), so
        # every rank averages over the same number of tokens and the mean of the rank
        # means is the global mean.
        labels = ids if name != "bert" else torch.randint(1, VOCAB, ids.shape, generator=g)
        out.append({"input_ids": ids, "labels": labels})
    return out


def hf_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss
