"""Variable-length attention over packed rows, registered with transformers' AttentionInterface
so a BERT-family encoder or a Qwen2/Qwen3/Mistral decoder (causal within each row) runs a packed
stream (embedserve.model.batches) unchanged: the model is loaded
with `attn_implementation=NAME`, called with input_ids and position_ids of shape [1, T], and the
row bounds travel as transformers' own packed-sequence keywords (cu_seq_lens_q/k,
max_length_q/k), which BertModel hands down to every attention call. transformers builds no
mask for an implementation it has no mask function for (masking_utils returns None early), so
nothing of size T x T is ever made.

Kernels: bf16/fp16 on CUDA → torch.nn.attention.varlen.varlen_attn (FlashAttention-2 built
into torch); fp32 on CUDA → the memory-efficient kernel's varlen mode, as torch's own
nested-tensor attention calls it (FlashAttention has no fp32). Both read the row bounds from
device memory and take the longest row as a host integer: no synchronisation, so they replay
inside a CUDA graph. On CPU, a reference: SDPA row by row (reads the bounds on the host)."""

from __future__ import annotations

import functools
import inspect

import numpy as np
import torch
import torch.nn.functional as F

NAME = "embedserve_varlen"

# Model types whose embeddings take per-token position_ids and whose attention goes through
# AttentionInterface (checked by tests/server/model/test_varlen.py on a tiny model of each),
# → the first position id of a row: RoBERTa numbers positions from padding_idx + 1.
POSITION_OFFSET = {
    "bert": lambda config: 0,
    "roberta": lambda config: config.pad_token_id + 1,
    "xlm-roberta": lambda config: config.pad_token_id + 1,
    "camembert": lambda config: config.pad_token_id + 1,
    # Decoders served as embedders (gte-Qwen2, Qwen3-Embedding, e5-mistral): causal attention
    # within each row (their attention modules say is_causal), rotary positions from 0.
    "qwen2": lambda config: 0,
    "qwen3": lambda config: 0,
    "mistral": lambda config: 0,
}
CAUSAL = ("qwen2", "qwen3", "mistral")
HALF = (torch.float16, torch.bfloat16)
# Other decoders: not checked here (tests/server/model/test_varlen.py), so not packed.
DECODER_TYPES = ("llama", "gemma", "gemma2", "gemma3_text", "phi3")


def unsupported(config, task: str, device_type: str, dtype: torch.dtype,
                capability: tuple[int, int] | None = None, longest: int = 512) -> str | None:
    """Why this model cannot run packed rows on this device (None: it can); `longest`: the longest
    row served (the largest bucket). Pure."""
    architectures = getattr(config, "architectures", None) or []
    # An LLM reranker reads its rows' last tokens, as last-token pooling does (embedserve.model.llm_rerank).
    llm_reranker = task == "rerank" and any(a.endswith("ForCausalLM") for a in architectures)
    if task not in ("embed", "bgem3") and not llm_reranker:  # bgem3: its heads read packed rows (model.m3)
        head = {"classify": "a classifier's head", "sparse": "SPLADE's masked-LM head"}.get(task, f"a {task} head")
        return f"packed rows serve embeddings; {head} reads padded rows"
    kind = getattr(config, "model_type", "")
    if kind not in CAUSAL and (kind in DECODER_TYPES or any(a.endswith("ForCausalLM") for a in architectures)):
        return (f"model type {kind!r} is a decoder this server does not pack (packed rows: "
                f"{', '.join(POSITION_OFFSET)})")
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if kind in CAUSAL and window and window < longest:
        return f"a sliding attention window ({window} tokens) shorter than the longest row ({longest}): not packed"
    if kind not in POSITION_OFFSET:
        return (f"model type {kind!r} is not one whose attention this server replaces "
                f"(packed rows: {', '.join(POSITION_OFFSET)})")
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        return "a decoder or cross-attention configuration, not a bidirectional encoder"
    if getattr(config, "position_embedding_type", "absolute") not in (None, "absolute"):
        return f"position_embedding_type {config.position_embedding_type!r} (packed rows need absolute positions)"
    head_dim = head_size(config)
    if device_type == "cuda" and dtype in HALF:
        if capability is not None and capability < (8, 0):
            return f"FlashAttention-2 needs compute capability 8.0 or newer (this GPU: {capability[0]}.{capability[1]})"
        if head_dim % 8 or head_dim > 256:
            return f"FlashAttention-2 needs a head size that is a multiple of 8, at most 256 (this model: {head_dim})"
    return None


def head_size(config) -> int:
    """Each attention head's width (decoders may declare one apart from hidden_size / heads)."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def is_causal(config) -> bool:
    return getattr(config, "model_type", "") in CAUSAL


def position_offset(config) -> int:
    return int(POSITION_OFFSET[config.model_type](config))


def register() -> None:
    """Make NAME a valid attn_implementation (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_attention)


def varlen_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                     scaling: float | None = None, dropout: float = 0.0, cu_seq_lens_q: torch.Tensor | None = None,
                     cu_seq_lens_k: torch.Tensor | None = None, max_length_q: int | None = None,
                     max_length_k: int | None = None, **_) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query/key/value [1, heads, T, head_dim] → ([1, T, heads,
    head_dim], no weights). The rows are cu_seq_lens_q[i]:cu_seq_lens_q[i + 1]; attention never
    crosses them."""
    if cu_seq_lens_q is None or max_length_q is None:
        raise ValueError(f"attn_implementation {NAME!r} runs packed rows only: pass cu_seq_lens_q/k and max_length_q/k")
    cu_k = cu_seq_lens_q if cu_seq_lens_k is None else cu_seq_lens_k
    max_k = max_length_q if max_length_k is None else max_length_k
    # [1, H, T, D] is a transposed view of the projection's [1, T, H, D]: this view is contiguous.
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    if k.shape[1] != q.shape[1]:  # grouped-query attention: key/value head j serves query heads j·n … (j+1)·n - 1
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    causal = bool(getattr(module, "is_causal", False))  # a decoder's rows attend to what precedes
    if not q.is_cuda:
        out = reference_attention(q, k, v, cu_seq_lens_q, scaling, causal)
    else:
        out = cuda_kernel(q, k, v, cu_seq_lens_q, cu_k, max_length_q, max_k, scaling, causal)
    return out.unsqueeze(0), None


def cuda_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                max_q: int, max_k: int, scale: float | None, causal: bool = False) -> torch.Tensor:
    """[T, H, D] rows → [T, H, D]: FlashAttention-2 in half precision, else the memory-efficient
    kernel; `causal`: each token attends to its row's tokens up to itself."""
    if q.dtype in HALF:
        from torch.nn.attention.varlen import varlen_attn

        # The default scale is passed as none at all: older torch releases have no `scale`.
        custom = scale is not None and abs(scale * q.shape[-1] ** 0.5 - 1.0) > 1e-6
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **({"scale": scale} if custom else {}),
                           **(_causal_keyword() if causal else {}))
    # custom_mask_type 1: causal from the top left of each row (queries and keys are the same row).
    return torch.ops.aten._efficient_attention_forward(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), None, cu_q, cu_k, max_q, max_k, 0.0, int(causal), False,
        scale=scale)[0][0]


@functools.cache
def _causal_keyword() -> dict:
    """How this torch's varlen_attn is told to be causal: window_size (-1, 0) (left unbounded,
    nothing to the right: torch 2.13), or is_causal in the releases before it."""
    from torch.nn.attention.varlen import varlen_attn

    return {"window_size": (-1, 0)} if "window_size" in inspect.signature(varlen_attn).parameters else {"is_causal": True}


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                        scale: float | None, causal: bool = False) -> torch.Tensor:
    """[T, H, D] → [T, H, D], SDPA over each row alone. Reads the bounds on the host: for CPU
    and for tests, never inside a graph. Tokens outside every row come back as zeros."""
    out = torch.zeros_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds, bounds[1:]):
        if end > start:
            rows = (x[start:end].transpose(0, 1) for x in (q, k, v))  # [H, n, D]
            out[start:end] = F.scaled_dot_product_attention(*rows, scale=scale, is_causal=causal).transpose(0, 1)
    return out


def self_check(device: torch.device, dtype: torch.dtype, heads: int, head_dim: int, graphs: bool,
               kernel=cuda_kernel, causal: bool = False) -> str | None:
    """Run the kernel on a stream laid out as served (rows of random lengths, the padding tail
    cut into rows, empty rows at the end, the longest row pinned above the real ones) against
    the reference, eagerly and, when the server uses CUDA graphs, replayed from a graph on fresh
    inputs. None: it agrees; else why not. At start-up, before the model trusts the kernel: a
    torch build or GPU whose kernel fails or differs gets padded rows (ATTENTION=auto) instead
    of wrong vectors or a crash loop."""
    from embedserve.model.batches import PackSpec, layout

    spec = PackSpec(max_len=128, max_rows=8, ladder=(256,))
    cu_host, _, _, size = layout(np.array([5, 37, 1, 90]), spec)
    cu = torch.from_numpy(cu_host).to(device)
    gen = torch.Generator().manual_seed(0)

    def rows():
        return [torch.randn(size, heads, head_dim, generator=gen).to(device, dtype) for _ in range(3)]

    def error(inputs, got) -> float:
        want = reference_attention(*(x.float() for x in inputs), cu, None, causal)
        return float((got.float() - want).abs().max())

    def run(inputs):
        return kernel(*inputs, cu, cu, spec.max_len, spec.max_len, None, **({"causal": True} if causal else {}))

    tolerance = 2e-2 if dtype in HALF else 1e-4
    try:
        inputs = rows()
        errors = [error(inputs, run(inputs))]
        if graphs:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                run(inputs)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = run(inputs)
            fresh = rows()
            for static, new in zip(inputs, fresh):
                static.copy_(new)
            graph.replay()
            errors.append(error(fresh, out))
    except Exception as e:  # noqa: BLE001 - any failure means "not on this device"
        return f"the varlen kernel fails here ({type(e).__name__}: {e})"
    if not all(e <= tolerance for e in errors):  # NaN fails too
        worst = float("nan") if any(e != e for e in errors) else max(errors)
        return f"the varlen kernel differs from the reference attention by {worst:.3g} (> {tolerance})"
    return None
