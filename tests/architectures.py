"""The architecture matrix: tiny random-init causal LMs of many model families (no download), for
the tests that check a code path on every architecture rlpipe supports."""

from __future__ import annotations

H, FFN, LAYERS, HEADS = 32, 64, 2, 2
ROPE = dict(hidden_size=H, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
             num_key_value_heads=1, max_position_embeddings=128)
#: name -> (transformers Config class, its size arguments, whether the tokenizer has a pad token)
ARCHITECTURES = {
    "llama": ("LlamaConfig", ROPE, True),
    "qwen2": ("Qwen2Config", ROPE, True),
    "qwen3": ("Qwen3Config", dict(ROPE, head_dim=16), True),
    "mistral": ("MistralConfig", dict(ROPE, sliding_window=None), True),
    "gemma": ("GemmaConfig", dict(ROPE, head_dim=16), True),
    "gemma2": ("Gemma2Config", dict(ROPE, head_dim=16, sliding_window=64, query_pre_attn_scalar=16), True),
    "phi3": ("Phi3Config", ROPE, True),
    "gpt2": ("GPT2Config", dict(n_embd=H, n_layer=LAYERS, n_head=HEADS, n_positions=128), False),
    "gpt_neox": ("GPTNeoXConfig", dict(hidden_size=H, intermediate_size=FFN, num_hidden_layers=LAYERS,
                                       num_attention_heads=HEADS, max_position_embeddings=128), False),
    "opt": ("OPTConfig", dict(hidden_size=H, ffn_dim=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                              max_position_embeddings=128, word_embed_proj_dim=H), True),
    "bloom": ("BloomConfig", dict(hidden_size=H, n_layer=LAYERS, n_head=HEADS), False),  # ALiBi: no context length
    "qwen2_moe": ("Qwen2MoeConfig", dict(ROPE, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                         num_experts=4, num_experts_per_tok=2), True),
    "mixtral": ("MixtralConfig", dict(ROPE, num_local_experts=4, num_experts_per_tok=2), True),
    "olmoe": ("OlmoeConfig", dict(ROPE, num_experts=4, num_experts_per_tok=2), True),
}
#: Architectures whose configs default to dropout 0.1 (GPT-2: resid/embd/attn_pdrop; OPT: dropout).
DROPOUT = {"gpt2", "opt"}


def build_model(name: str, tokenizer, seed: int = 0):
    """A random-init causal LM of architecture `name` over `tokenizer` (seeded)."""
    import torch
    import transformers

    config_class, sizes, _ = ARCHITECTURES[name]
    config = getattr(transformers, config_class)(
        **sizes, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config)
