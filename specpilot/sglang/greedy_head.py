"""The certified greedy head inside SGLang's `LogitsProcessor`, on the argmax-only path.

Two AROUND hooks (HookRegistry):

* `LogitsProcessor.forward`: decides from the `ForwardBatch` whether the logits will only feed a
  greedy argmax (`argmax_only`): every request greedy; no grammar, penalties, logit bias, custom
  logit processor, sampling masks or watermark; no logprobs; a decode, target-verify, extend or mixed
  forward of the target model (not a draft model's forward); no logit scale or soft-capping; no
  DP-attention LM head; not inside CUDA-graph capture (a captured graph is replayed for batches
  whose sampling it did not see). The decision holds for that call only (a context variable).
* `LogitsProcessor._compute_lm_head`: on that path, this rank's shard of the head is answered by
  `lmhead.CertifiedHead.topk(hidden, 1)` (certified: the largest exact fp32 logit of the shard and
  its lowest id) and returned as fp32 logits that are -inf everywhere except that winner, which holds
  its exact value. SGLang's own all-gather of the shards and the sampler's `torch.argmax` then pick
  the largest winner over the ranks, ties to the lowest id: the exact combine. Off that path, the
  stock head runs untouched.

What the answer equals: the argmax of the exact fp32 logits (`CertifiedHead.logits`, fp32
accumulation in one fixed order). SGLang's stock head rounds logits to BF16 before the argmax, so on
rows whose top two logits round to the same BF16 value the two can differ; the certified answer is
the one the unrounded head gives.
"""

from __future__ import annotations

import contextvars
import logging

import torch

from .head import ShardedCertifiedHead

logger = logging.getLogger("specpilot.sglang")

__all__ = ["argmax_only", "forward_hook", "compute_lm_head_hook", "weights_loaded_hook", "invalidate", "head_for",
           "TARGETS", "calls"]

TARGETS = (
    "sglang.srt.layers.logits_processor.LogitsProcessor.forward",
    "sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head",
    "sglang.srt.model_loader.loader.DefaultModelLoader.postprocess_weights",
)
# The certified head keeps screen tables built from the head's weights. In-place writes through `.data` (how
# SGLang's weight loaders write) do not move a tensor's version counter, so the tables are rebuilt whenever
# SGLang finishes loading or updating weights (DefaultModelLoader.postprocess_weights, at the end of the initial
# load and of every update_weights_from_* between begin_weight_update and end_weight_update), and on `invalidate()`.
_GENERATION = [0]
_ARGMAX_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("specpilot_argmax_only", default=False)
_MODES = ("DECODE", "TARGET_VERIFY", "EXTEND", "MIXED")
calls = {"certified": 0, "stock": 0}  # forwards that took each path (for tests and the self-check)


def _sampling_is_greedy_only(info) -> bool:
    if info is None or not getattr(info, "is_all_greedy", False):
        return False
    if getattr(info, "has_custom_logit_processor", False):
        return False
    grammars = getattr(info, "grammars", None)
    if grammars is not None and any(g is not None for g in grammars):
        return False
    for name in ("grammar_mask", "logit_bias", "acc_linear_penalties", "acc_additive_penalties",
                 "acc_scaling_penalties", "sampling_mask_batch_indices", "watermark_enabled"):
        if getattr(info, name, None) is not None:
            return False
    if getattr(info, "has_watermark_candidates", False):
        return False
    pen = getattr(info, "penalizer_orchestrator", None)
    return pen is None or not getattr(pen, "is_required", False)


def argmax_only(processor, forward_batch) -> bool:
    """Whether SGLang will use these logits for a greedy argmax only (see the module docstring)."""
    mode = getattr(forward_batch, "forward_mode", None)
    if mode is None or getattr(mode, "name", None) not in _MODES:
        return False
    if getattr(forward_batch, "return_logprob", False):
        return False
    if getattr(forward_batch, "spec_info", None) is not None and not mode.is_target_verify():
        return False  # a speculative draft model's forward: its logits feed top-k drafting
    if processor.logit_scale is not None or processor.final_logit_softcapping:
        return False
    if processor.use_attn_tp_group or processor.do_tensor_parallel_all_gather_dp_attn:
        return False
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    return _sampling_is_greedy_only(getattr(forward_batch, "sampling_info", None))


def _real_rows(lm_head) -> int | None:
    """Rows of this rank's head shard that hold real tokens (None: a layout the hook does not take)."""
    idx = getattr(lm_head, "shard_indices", None)
    if idx is None:
        return lm_head.weight.shape[0]
    if idx.added_vocab_end_index != idx.added_vocab_start_index:
        return None  # LoRA-added vocabulary
    return idx.org_vocab_end_index - idx.org_vocab_start_index


def head_for(lm_head) -> ShardedCertifiedHead | None:
    """The certified head over this rank's real rows of `lm_head` (built once per weight, cached on it)."""
    w = getattr(lm_head, "weight", None)
    if w is None or w.dim() != 2 or w.dtype != torch.bfloat16 or hasattr(lm_head, "set_lora"):
        return None
    qm = getattr(lm_head, "quant_method", None)
    if qm is not None and type(qm).__name__ != "UnquantizedEmbeddingMethod":
        return None
    rows = _real_rows(lm_head)
    if not rows or rows <= 0:
        return None
    key = (w.data_ptr(), w._version, rows, _GENERATION[0])
    cached = getattr(lm_head, "_specpilot_head", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    head = ShardedCertifiedHead(w.data[:rows], 0)
    lm_head._specpilot_head = (key, head)
    return head


def invalidate() -> None:
    """Rebuild every certified head before its next use: call it after writing a head's weights in place outside
    SGLang's weight loading and update paths."""
    _GENERATION[0] += 1


def weights_loaded_hook(original, *args, **kwargs):
    try:
        return original(*args, **kwargs)
    finally:
        invalidate()


def forward_hook(original, self, input_ids, hidden_states, lm_head, logits_metadata, *args, **kwargs):
    ok = False
    try:
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch

        ok = isinstance(logits_metadata, ForwardBatch) and argmax_only(self, logits_metadata)
    except Exception:  # the decision must never break a forward: the stock head runs
        logger.exception("specpilot.sglang: the argmax-only check failed; the stock LM head runs")
    token = _ARGMAX_ONLY.set(ok)
    try:
        return original(self, input_ids, hidden_states, lm_head, logits_metadata, *args, **kwargs)
    finally:
        _ARGMAX_ONLY.reset(token)


def certified_logits(head: ShardedCertifiedHead, hidden: torch.Tensor, width: int, out=None) -> torch.Tensor:
    """fp32 [M, width]: -inf except each row's certified winner in this shard, at its exact value."""
    vals, ids = head.local_best(hidden.to(torch.bfloat16))
    M = vals.shape[0]
    if out is None or tuple(out.shape) != (M, width) or out.dtype != torch.float32:
        out = torch.empty((M, width), dtype=torch.float32, device=hidden.device)
    out.fill_(float("-inf"))
    out.scatter_(1, ids.view(M, 1), vals.view(M, 1))
    return out


def compute_lm_head_hook(original, self, hidden_states, lm_head, embedding_bias=None, *args, **kwargs):
    if _ARGMAX_ONLY.get() and embedding_bias is None:
        head = head_for(lm_head)
        if head is not None and hidden_states.dim() == 2 and hidden_states.shape[-1] == head.head.H:
            calls["certified"] += 1
            return certified_logits(head, hidden_states, lm_head.weight.shape[0], kwargs.get("out"))
    calls["stock"] += 1
    return original(self, hidden_states, lm_head, embedding_bias, *args, **kwargs)
