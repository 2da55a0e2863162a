"""The decoder stack of a decode step in one native call (``csrc/llama_forward.c``), in bf16 or
float32.

The layer loop of :meth:`LlamaForCausalLM.forward` over ``layer_ops.FusedOps`` calls ~9 native
kernels per layer; at decode batch sizes the Python around them (wrappers, ctypes crossings, a
fresh tensor per output) and the idle OpenMP threads between them cost a sixth of a step at
batch 64, a third of that with one call (docs/performance.md, "Figures behind the code").
:class:`NativeForward` describes the model to C once (shapes, and per layer pointers to the norm
weights, the packed weights and the KV cache) and then runs a step's whole stack in one call:
the same kernels in the same order, so the hidden states are bit for bit those of the Python
loop (tested).

It applies only where every piece of that loop would have taken the native path, on CPU with
the fused kernels and without biases:

* bf16: weights packed for the decode linear kernel (AMX, or AVX512-BF16 on CPUs without AMX
  such as AMD Zen 4; ``csrc/decode_linear.c`` picks the same kind as
  ``native.decode_linear_kind``), at most ``decode_max_rows()`` tokens;
* float32: weights packed for the float32 kernel (``csrc/f32_linear.c``, where
  ``native.f32_linear_preferred``), at most ``F32_MAX_ROWS`` tokens.

Where the attention backend's step is one native call over the whole batch
(``AttentionBackend.native_step``) the whole stack is one call; otherwise (a shared-prefix split,
prompt chunks on SDPA) each layer is two native calls around the backend's attention. Anything
else returns None from :meth:`run` and the caller takes the Python loop.

Invariant: a description holds raw pointers into tensors it does not own; it keeps them alive
by reference (the packed weights, the norm weights, the rope tables and the KV cache tensors)
and is rebuilt whenever the KV cache list changes identity.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.kernels import native
from engine.model.config import ModelConfig
from engine.model.fused import SUFFIX
from engine.model.linear import PackedWeight, decode_max_rows


class LlamaForCausalLM(Protocol):
    """What the native stack reads of ``engine.model.llama.LlamaForCausalLM`` (named by shape,
    not imported: that module imports this one)."""

    cfg: ModelConfig
    backend: AttentionBackend
    embed: torch.Tensor
    norm: torch.Tensor
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    scale: float
    attn_options: list[dict[str, float | int]]

    @property
    def layers(self) -> Iterable[Any]: ...


_PTRS = ctypes.POINTER(ctypes.c_void_p)
# The most tokens of a float32 step the stack takes. Its kernel has no row limit, but past
# decode sizes one call saves little against the loop, which also runs the last layer's output
# projection and MLP for the sampled rows only (``forward(keep=...)``): a prompt chunk stays there.
F32_MAX_ROWS = 128


def _packed(weight: PackedWeight, dtype: torch.dtype) -> torch.Tensor | None:
    """The copy of ``weight`` the dtype's kernel reads: the decode tiles (bf16) or the float32
    panels."""
    return weight.decode if dtype == torch.bfloat16 else weight.f32


class _Model(ctypes.Structure):
    _fields_ = [  # noqa: RUF012 (ctypes reads this class attribute)
        ("num_layers", ctypes.c_int32),
        ("hidden", ctypes.c_int32),
        ("num_heads", ctypes.c_int32),
        ("num_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("intermediate", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("input_norm", _PTRS),
        ("post_norm", _PTRS),
        ("qkv", _PTRS),
        ("o", _PTRS),
        ("gate_up", _PTRS),
        ("down", _PTRS),
        ("k_cache", _PTRS),
        ("v_cache", _PTRS),
        ("final_norm", ctypes.c_void_p),
        ("rope_cos", ctypes.c_void_p),
        ("rope_sin", ctypes.c_void_p),
    ]


def _pointers(tensors: list[torch.Tensor]) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))


class NativeForward:
    """One model's description for ``llama_forward_bf16`` / ``_f32``, built on first use."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self._key: tuple[int, int] | None = None
        self._desc: _Model | None = None
        self._keep: list[object] = []

    @staticmethod
    def supported(model: LlamaForCausalLM) -> bool:
        """Whether the model's weights allow the native stack at all."""
        dtype = model.embed.dtype
        if dtype not in SUFFIX or model.embed.device.type != "cpu":
            return False
        if model.rope_cos.dtype != torch.float32:
            return False
        kind = native.decode_linear_kind() if dtype == torch.bfloat16 else None
        if dtype == torch.bfloat16 and kind is None:
            return False
        for layer in model.layers:
            if any(
                b is not None
                for b in (layer.qkv_bias, layer.o_bias, layer.gate_up_bias, layer.down_bias)
            ):
                return False
            packed = layer.packed
            for p in packed.values():
                if p is None or _packed(p, dtype) is None:
                    return False
                if dtype == torch.bfloat16 and p.kind != kind:
                    return False
            if not packed["gate_up"].gated:
                return False
        return True

    def _describe(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> _Model:
        key = (id(kv_caches), kv_caches[0][0].data_ptr() if kv_caches else 0)
        if self._desc is not None and self._key == key:
            return self._desc
        m, cfg = self.model, self.model.cfg
        layers = list(m.layers)
        per_layer = {
            "input_norm": [layer.input_norm for layer in layers],
            "post_norm": [layer.post_norm for layer in layers],
            **{
                name: [_packed(layer.packed[name], m.embed.dtype) for layer in layers]
                for name in ("qkv", "o", "gate_up", "down")
            },
            "k_cache": [k for k, _ in kv_caches],
            "v_cache": [v for _, v in kv_caches],
        }
        arrays = {name: _pointers(ts) for name, ts in per_layer.items()}
        desc = _Model(
            num_layers=cfg.num_layers,
            hidden=cfg.hidden_size,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            intermediate=cfg.intermediate_size,
            block_size=kv_caches[0][0].shape[1],
            eps=cfg.rms_norm_eps,
            scale=m.scale,
            final_norm=m.norm.data_ptr(),
            rope_cos=m.rope_cos.data_ptr(),
            rope_sin=m.rope_sin.data_ptr(),
            **{name: ctypes.cast(arr, _PTRS) for name, arr in arrays.items()},
        )
        self._keep = [per_layer, arrays, m.norm, m.rope_cos, m.rope_sin, kv_caches]
        self._key, self._desc = key, desc
        return desc

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        """The final normed hidden states ``[T, hidden]``, or None where the step does not
        qualify (the caller runs the Python loop)."""
        t, dtype = input_ids.shape[0], self.model.embed.dtype
        if t == 0 or len(kv_caches) != self.model.cfg.num_layers:
            return None
        if t > (decode_max_rows() if dtype == torch.bfloat16 else F32_MAX_ROWS):
            return None
        lib = native.load()
        if lib is None:
            return None
        positions = positions.contiguous()
        slots = meta.slot_mapping.contiguous()
        if positions.dtype != torch.int64 or slots.dtype != torch.int64:
            return None
        seqs = self.model.backend.native_step(meta)
        if seqs is None:
            return self._run_layers(lib, input_ids, positions, kv_caches, meta)
        tables, seq_lens, starts, qlens = seqs
        x = torch.nn.functional.embedding(input_ids, self.model.embed).contiguous()
        out = torch.empty_like(x)
        rc = getattr(lib, f"llama_forward_{SUFFIX[dtype]}")(
            ctypes.byref(self._describe(kv_caches)),
            x.data_ptr(),
            t,
            positions.data_ptr(),
            slots.data_ptr(),
            tables.data_ptr(),
            tables.stride(0),
            seq_lens.data_ptr(),
            starts.data_ptr(),
            qlens.data_ptr(),
            seq_lens.shape[0],
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"native llama forward failed ({rc})")
        return out

    def _run_layers(
        self,
        lib: ctypes.CDLL,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """A step whose attention is not one native call (a shared-prefix split, prompt chunks
        on SDPA): each layer's work before and after its attention is one native call each, and
        the attention is the backend's, as in the Python loop (which writes the layer's K/V
        first). The same kernels in the same order as that loop, so the same hidden states."""
        m, cfg = self.model, self.model.cfg
        desc = ctypes.byref(self._describe(kv_caches))
        t, threads = input_ids.shape[0], torch.get_num_threads()
        x = torch.nn.functional.embedding(input_ids, m.embed).contiguous()
        dtype = x.dtype
        pre, post, final = (
            getattr(lib, f"llama_{name}_{SUFFIX[dtype]}")
            for name in ("layer_pre", "layer_post", "final_norm")
        )
        h = torch.empty(t, cfg.hidden_size, dtype=dtype)
        delta = torch.empty(t, cfg.hidden_size, dtype=dtype)
        act = torch.empty(t, cfg.intermediate_size, dtype=dtype)
        qkv = torch.empty(t, cfg.q_size + 2 * cfg.kv_size, dtype=dtype)
        q = qkv[:, : cfg.q_size].view(t, cfg.num_heads, cfg.head_dim)
        k = qkv[:, cfg.q_size : cfg.q_size + cfg.kv_size].view(t, cfg.num_kv_heads, cfg.head_dim)
        v = qkv[:, cfg.q_size + cfg.kv_size :].view(t, cfg.num_kv_heads, cfg.head_dim)
        for i, (k_cache, v_cache) in enumerate(kv_caches):
            rc = pre(
                desc,
                i,
                x.data_ptr(),
                delta.data_ptr() if i else None,
                t,
                positions.data_ptr(),
                None,
                h.data_ptr(),
                qkv.data_ptr(),
                threads,
            )
            attn = (
                m.backend.forward(q, k, v, k_cache, v_cache, meta, m.scale, **m.attn_options[i])
                .reshape(t, cfg.q_size)
                .contiguous()
            )
            rc |= post(
                desc,
                i,
                x.data_ptr(),
                attn.data_ptr(),
                delta.data_ptr(),
                h.data_ptr(),
                act.data_ptr(),
                t,
                threads,
            )
            if rc != 0:
                raise RuntimeError(f"native llama layer {i} failed ({rc})")
        out = torch.empty_like(x)
        final(desc, x.data_ptr(), delta.data_ptr(), t, out.data_ptr(), threads)
        return out
