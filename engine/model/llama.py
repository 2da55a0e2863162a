"""The decoder of every supported family over one flat batch of tokens: no padding, no batch
dimension; positions and KV slots come per token.

A Llama (Llama 1-3, Mistral, SmolLM2, TinyLlama; Qwen2's qkv bias; Phi-3's checkpoint fuses
qkv and gate/up, which is this layout already) plus the options of ``engine.model.families``:
Qwen3's q/k norms, Gemma 2/3's (1 + w) norms around attention and MLP, scaled embeddings, GeGLU,
soft-capping and sliding layers, Phi-4-mini's partial RoPE. Numerics follow transformers'
implementation op for op (RMSNorm in float32, RoPE tables in float32 cast to the model dtype,
rotate-half RoPE), so that float32 greedy decoding is token-identical.

Paths: one layer loop, :meth:`LlamaForCausalLM.forward`, over swappable elementwise ops
(``engine.model.layer_ops``): a Llama (``ModelConfig.is_plain_llama``) on CPU takes the fused
kernels (Qwen3's q/k norms included) and, in bf16, the native decode stack where a step
qualifies; every other model takes the reference ops. :meth:`LlamaForCausalLM.forward_path`
names the one taken.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.model import fused
from engine.model.config import ModelConfig
from engine.model.families import checkpoint_names, text_weights
from engine.model.layer_ops import FusedOps, ReferenceOps, soft_cap
from engine.model.linear import PackedWeight, linear, pack_weight
from engine.model.native_forward import NativeForward

LINEAR_WEIGHTS = ("qkv", "o", "gate_up", "down")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, qkv = cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.input_norm = param(h)
        self.q_norm = param(cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = param(cfg.head_dim) if cfg.qk_norm else None
        self.attn_out_norm = param(h) if cfg.sandwich_norm else None
        self.mlp_out_norm = param(h) if cfg.sandwich_norm else None
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
        self.scale = cfg.attention_scale
        # Whether the fused and native CPU paths cover this model (read on every step).
        self.plain_llama = cfg.is_plain_llama
        # Keyword options of each layer's attention call beyond a Llama's (sliding window,
        # soft-capping); empty for a Llama, so that every backend serves it.
        self.attn_options: list[dict[str, float | int]] = [
            {
                k: v
                for k, v in (("window", cfg.layer_window(i)), ("softcap", cfg.attn_softcap))
                if v is not None
            }
            for i in range(cfg.num_layers)
        ]
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
        # Tables of the sliding layers where they have their own RoPE (cfg.local_rope).
        self.register_buffer("local_rope_cos", None, persistent=False)
        self.register_buffer("local_rope_sin", None, persistent=False)

    def set_rope_tables(
        self,
        cos: torch.Tensor,
        sin: torch.Tensor,
        local: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """float32 ``[max_pos, rope_dim // 2]`` tables; ``local``: the sliding layers' own."""
        if self.cfg.local_rope and local is None:
            raise ValueError("model: this model's sliding layers need RoPE tables of their own")
        self.rope_cos, self.rope_sin = cos, sin
        if local is not None:
            self.local_rope_cos, self.local_rope_sin = local

    def forward_path(self) -> str:
        """Which forward this model takes on its device and dtype: ``native`` (the whole
        decode stack in one call, where a step qualifies; else ``fused``), ``fused`` (native
        elementwise kernels around the linear layers) or ``reference`` (PyTorch ops)."""
        if not (self.use_fused and self.plain_llama and fused.enabled(self.embed)):
            return "reference"
        return "native" if self.native_forward is not None and self.use_native_forward else "fused"

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Returns the final hidden states ``[T, hidden]`` (normed): the native stack's where
        the step qualifies, else one layer loop over the path's ops (``engine.model.layer_ops``:
        fused kernels or the reference PyTorch ops).

        ``keep``: the token rows whose hidden states the caller reads (those it samples from);
        the result is then ``[len(keep), hidden]``, in ``keep``'s order. Every layer still
        writes every token's K/V (later steps attend to them), but no later layer reads the last
        layer's output of a token, so its attention output projection and MLP run for the kept
        rows only: a prompt chunk of T tokens that samples one saves ~3% of its FLOPs."""
        path = self.forward_path()
        if path == "native":
            hidden = self.native_forward.run(input_ids, positions, kv_caches, meta)
            if hidden is not None:
                return hidden if keep is None else hidden[keep]
        cfg = self.cfg
        x = F.embedding(input_ids, self.embed)
        if cfg.embed_scale is not None:
            x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
        rope = (self.rope_cos, self.rope_sin)
        ops: ReferenceOps | FusedOps
        if path == "reference":
            local = None
            if self.local_rope_cos is not None:
                local = (self.local_rope_cos, self.local_rope_sin)
            ops = ReferenceOps(cfg, rope, local, positions, x.dtype)
        else:
            ops = FusedOps(cfg, rope, positions)
        t = x.shape[0]
        last = len(self.layers) - 1
        delta: torch.Tensor | None = None
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            packed = layer.packed
            x, h = ops.add_norm(x, delta, layer.input_norm)
            qkv = linear(h, layer.qkv, layer.qkv_bias, packed["qkv"])
            q, k, v = ops.qkv_heads(qkv, layer.q_norm, layer.k_norm, i)
            attn = self.backend.forward(
                q, k, v, k_cache, v_cache, meta, self.scale, **self.attn_options[i]
            ).reshape(t, cfg.q_size)
            if i == last and keep is not None:
                if keep.numel() == 0:
                    return x[:0]
                attn, x = attn[keep], x[keep]
            o = linear(attn, layer.o, layer.o_bias, packed["o"])
            x, h = ops.add_norm(x, ops.out_norm(o, layer.attn_out_norm), layer.post_norm)
            act = ops.mlp_act(h, layer.gate_up, layer.gate_up_bias, packed["gate_up"])
            d = linear(act, layer.down, layer.down_bias, packed["down"])
            delta = ops.out_norm(d, layer.mlp_out_norm)
        return ops.add_norm(x, delta, self.norm)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype (the sampler converts when it needs float32)."""
        logits = linear(hidden, self.lm_head, None, self.lm_head_packed)
        if self.cfg.final_softcap is not None:
            logits = soft_cap(logits, self.cfg.final_softcap)
        return logits

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
        native = self.cfg.is_plain_llama and not self.cfg.qk_norm and NativeForward.supported(self)
        self.native_forward = NativeForward(self) if native else None
        return True

    # -- weights ---------------------------------------------------------------------------------
    @torch.no_grad()
    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy a Hugging Face state dict of a supported family in, fusing q/k/v and gate/up
        (Phi-3's checkpoint has them fused already)."""
        cfg = self.cfg
        weights = text_weights(weights)
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

        def fused_or_cat(fused_name: str, parts: list[str]) -> torch.Tensor:
            if fused_name in weights:
                return weights[fused_name]
            return torch.cat([take(n) for n in parts], dim=0)

        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            for attr, name in checkpoint_names(i, cfg.sandwich_norm).items():
                getattr(layer, attr).copy_(take(name))
            attn = p + "self_attn."
            if cfg.qk_norm:
                layer.q_norm.copy_(take(attn + "q_norm.weight"))
                layer.k_norm.copy_(take(attn + "k_norm.weight"))
            layer.qkv.copy_(
                fused_or_cat(attn + "qkv_proj.weight", [attn + f"{n}_proj.weight" for n in "qkv"])
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
                fused_or_cat(
                    mlp + "gate_up_proj.weight", [mlp + "gate_proj.weight", mlp + "up_proj.weight"]
                )
            )
            if layer.gate_up_bias is not None:
                layer.gate_up_bias.copy_(
                    torch.cat([take(mlp + "gate_proj.bias"), take(mlp + "up_proj.bias")], dim=0)
                )
            layer.down.copy_(take(mlp + "down_proj.weight"))
            if layer.down_bias is not None:
                layer.down_bias.copy_(take(mlp + "down_proj.bias"))
