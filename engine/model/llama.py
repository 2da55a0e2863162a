"""A Llama-family decoder (Llama 1-3, Mistral, SmolLM2, TinyLlama; Qwen2's qkv bias) over one
flat batch of tokens: no padding, no batch dimension; positions and KV slots come per token.

Numerics follow transformers' implementation op for op (RMSNorm in float32, RoPE tables in float32
cast to the model dtype, rotate-half RoPE), so that float32 greedy decoding is token-identical.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.model import fused
from engine.model.config import ModelConfig
from engine.model.linear import PackedWeight, linear, pack_weight, silu_mul_linear
from engine.model.native_forward import NativeForward


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, heads, D]``; ``cos``/``sin [T, 1, D/2]`` in x's dtype."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


LINEAR_WEIGHTS = ("qkv", "o", "gate_up", "down")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, qkv = cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.input_norm = param(h)
        self.qkv = param(qkv, h)
        self.qkv_bias = param(qkv) if cfg.qkv_bias else None
        self.o = param(h, cfg.q_size)
        self.o_bias = param(h) if cfg.o_bias else None
        self.post_norm = param(h)
        self.gate_up = param(2 * cfg.intermediate_size, h)
        self.gate_up_bias = param(2 * cfg.intermediate_size) if cfg.mlp_bias else None
        self.down = param(h, cfg.intermediate_size)
        self.down_bias = param(h) if cfg.mlp_bias else None
        # Packed copies of the weights for the CPU kernels (plain attributes, not parameters),
        # or None.
        self.packed: dict[str, PackedWeight | None] = dict.fromkeys(LINEAR_WEIGHTS)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        self.backend = backend
        self.embed = nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.lm_head = (
            self.embed
            if cfg.tie_word_embeddings
            else nn.Parameter(
                torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False
            )
        )
        self.scale = cfg.head_dim**-0.5
        self.lm_head_packed: PackedWeight | None = None
        # Fused native elementwise kernels on CPU (engine.model.fused); a switch so
        # tests can compare against the reference ops.
        self.use_fused = True
        # The whole stack of a decode step in one native call where it applies (set up by
        # prepack_linear_weights; None otherwise); use_native_forward switches it off for tests.
        self.native_forward: NativeForward | None = None
        self.use_native_forward = True
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)

    def set_rope_tables(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.rope_cos, self.rope_sin = cos, sin

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Returns the final hidden states ``[T, hidden]`` (normed)."""
        if self.use_fused and fused.enabled(self.embed):
            if self.native_forward is not None and self.use_native_forward:
                hidden = self.native_forward.run(input_ids, positions, kv_caches, meta)
                if hidden is not None:
                    return hidden
            return self._forward_fused(input_ids, positions, kv_caches, meta)
        cfg = self.cfg
        x = F.embedding(input_ids, self.embed)
        dtype = x.dtype
        cos = self.rope_cos[positions].to(dtype).unsqueeze(1)
        sin = self.rope_sin[positions].to(dtype).unsqueeze(1)
        t = x.shape[0]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            packed = layer.packed
            qkv = linear(h, layer.qkv, layer.qkv_bias, packed["qkv"])
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = apply_rope(q.view(t, cfg.num_heads, cfg.head_dim), cos, sin)
            k = apply_rope(k.view(t, cfg.num_kv_heads, cfg.head_dim), cos, sin)
            v = v.view(t, cfg.num_kv_heads, cfg.head_dim)
            attn = self.backend.forward(q, k, v, k_cache, v_cache, meta, self.scale)
            x = x + linear(attn.reshape(t, cfg.q_size), layer.o, layer.o_bias, packed["o"])
            h = rms_norm(x, layer.post_norm, cfg.rms_norm_eps)
            gate_up = linear(h, layer.gate_up, layer.gate_up_bias, packed["gate_up"])
            gate, up = gate_up.chunk(2, dim=-1)
            x = x + linear(F.silu(gate) * up, layer.down, layer.down_bias, packed["down"])
        return rms_norm(x, self.norm, cfg.rms_norm_eps)

    def _forward_fused(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``forward`` with the elementwise ops fused (on CPU): each residual add is folded
        into the next RMSNorm, RoPE rotates q and k in place inside the qkv output."""
        cfg = self.cfg
        eps, q_size, kv_size = cfg.rms_norm_eps, cfg.q_size, cfg.kv_size
        x = F.embedding(input_ids, self.embed)
        t = x.shape[0]
        positions = positions.contiguous()
        delta: torch.Tensor | None = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            packed = layer.packed
            h = fused.add_rms_norm(x, delta, layer.input_norm, eps)
            qkv = linear(h, layer.qkv, layer.qkv_bias, packed["qkv"])
            fused.rope_(
                qkv,
                positions,
                self.rope_cos,
                self.rope_sin,
                cfg.num_heads + cfg.num_kv_heads,
                cfg.head_dim,
            )
            q = qkv[:, :q_size].view(t, cfg.num_heads, cfg.head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(t, cfg.num_kv_heads, cfg.head_dim)
            v = qkv[:, q_size + kv_size :].view(t, cfg.num_kv_heads, cfg.head_dim)
            attn = self.backend.forward(q, k, v, k_cache, v_cache, meta, self.scale)
            o = linear(attn.reshape(t, q_size), layer.o, layer.o_bias, packed["o"])
            h = fused.add_rms_norm(x, o, layer.post_norm, eps)
            act = silu_mul_linear(h, layer.gate_up, layer.gate_up_bias, packed["gate_up"])
            if act is None:
                gate_up = linear(h, layer.gate_up, layer.gate_up_bias, packed["gate_up"])
                act = fused.silu_mul(gate_up)
            delta = linear(act, layer.down, layer.down_bias, packed["down"])
        return fused.add_rms_norm(x, delta, self.norm, eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype (the sampler converts when it needs float32)."""
        return linear(hidden, self.lm_head, None, self.lm_head_packed)

    @torch.no_grad()
    def prepack_linear_weights(self) -> bool:
        """Pack every linear weight for the CPU kernels (oneDNN; in bf16 the decode kernels' tiles
        too, AMX or AVX512-BF16). Call after
        loading weights and moving the model; returns whether packing is in use. The original
        parameters stay (the embedding shares the LM head's weight; reloading weights needs
        them) and are what other inputs use."""
        self.lm_head_packed = pack_weight(self.lm_head)
        if self.lm_head_packed is None:
            return False
        for layer in self.layers:
            layer.packed = {
                name: pack_weight(getattr(layer, name), gated=name == "gate_up")
                for name in LINEAR_WEIGHTS
            }
        self.native_forward = NativeForward(self) if NativeForward.supported(self) else None
        return True

    # -- weights ---------------------------------------------------------------------------------
    @torch.no_grad()
    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy a Hugging Face Llama/Qwen2 state dict in, fusing q/k/v and gate/up."""
        cfg = self.cfg
        # Packed copies would go stale: drop them (prepack again after loading).
        self.lm_head_packed = None
        self.native_forward = None
        for layer in self.layers:
            layer.packed = dict.fromkeys(LINEAR_WEIGHTS)

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"model: checkpoint lacks weight {name!r}")
            return weights[name]

        self.embed.copy_(take("model.embed_tokens.weight"))
        self.norm.copy_(take("model.norm.weight"))
        if not cfg.tie_word_embeddings:
            self.lm_head.copy_(take("lm_head.weight"))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer.input_norm.copy_(take(p + "input_layernorm.weight"))
            layer.post_norm.copy_(take(p + "post_attention_layernorm.weight"))
            attn = p + "self_attn."
            layer.qkv.copy_(
                torch.cat([take(attn + f"{n}_proj.weight") for n in ("q", "k", "v")], dim=0)
            )
            if layer.qkv_bias is not None:
                layer.qkv_bias.copy_(
                    torch.cat([take(attn + f"{n}_proj.bias") for n in ("q", "k", "v")], dim=0)
                )
            layer.o.copy_(take(attn + "o_proj.weight"))
            if layer.o_bias is not None:
                layer.o_bias.copy_(take(attn + "o_proj.bias"))
            mlp = p + "mlp."
            layer.gate_up.copy_(
                torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")], dim=0)
            )
            if layer.gate_up_bias is not None:
                layer.gate_up_bias.copy_(
                    torch.cat([take(mlp + "gate_proj.bias"), take(mlp + "up_proj.bias")], dim=0)
                )
            layer.down.copy_(take(mlp + "down_proj.weight"))
            if layer.down_bias is not None:
                layer.down_bias.copy_(take(mlp + "down_proj.bias"))
