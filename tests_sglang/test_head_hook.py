"""The certified greedy head behind SGLang's real `LogitsProcessor`: taken on the argmax-only path (greedy, no
grammar, penalties or logprobs), where its logits' argmax is the exact fp32 head's argmax; the stock head
everywhere else."""

from __future__ import annotations

import types

import pytest
import torch

V, H = 250, 128  # V pads to 256 rows in SGLang's ParallelLMHead


def _sampling(M, greedy=True, **over):
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    kw = dict(temperatures=torch.ones(M, 1), top_ps=torch.ones(M), top_ks=torch.ones(M, dtype=torch.int32),
              min_ps=torch.zeros(M), is_all_greedy=greedy, is_any_greedy=greedy, need_top_p_sampling=False,
              need_top_k_sampling=False, need_min_p_sampling=False, vocab_size=V, device="cpu")
    kw.update(over)
    return SamplingBatchInfo(**kw)


def _batch(M, mode="DECODE", **over):
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

    fb = ForwardBatch(forward_mode=getattr(ForwardMode, mode), batch_size=M, input_ids=torch.zeros(M, dtype=torch.int64),
                      req_pool_indices=torch.arange(M), seq_lens=torch.full((M,), 4), out_cache_loc=torch.arange(M),
                      seq_lens_sum=4 * M, sampling_info=over.pop("sampling_info", _sampling(M)),
                      capture_hidden_mode=CaptureHiddenMode.NULL)
    for k, v in over.items():
        setattr(fb, k, v)
    return fb


@pytest.fixture(scope="module")
def head_setup(sglang_tp1):
    from sglang.srt.layers.logits_processor import LogitsProcessor
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

    g = torch.Generator().manual_seed(0)
    lm_head = ParallelLMHead(V, H, params_dtype=torch.bfloat16, prefix="lm_head")
    W = (torch.randn(V, H, generator=g) * 0.05).to(torch.bfloat16)
    lm_head.weight_loader(lm_head.weight, W)  # SGLang's loader: this rank's rows, padding rows untouched
    lm_head.weight.data[V:] = 0
    lp = LogitsProcessor(types.SimpleNamespace(vocab_size=V))
    return lp, lm_head, W


def _hidden(M, seed=1):
    return torch.randn(M, H, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_greedy_decode_takes_the_certified_head(head_setup):
    from specpilot.sglang import greedy_head

    lp, lm_head, W = head_setup
    h = _hidden(7)
    before = greedy_head.calls["certified"]
    out = lp(torch.zeros(7, dtype=torch.int64), h, lm_head, _batch(7))
    assert greedy_head.calls["certified"] == before + 1
    logits = out.next_token_logits
    ids = logits.argmax(-1)
    exact = greedy_head.head_for(lm_head).head.logits(h)  # the certified head's exact fp32 logits
    assert torch.equal(ids, exact.argmax(-1))
    assert torch.equal(ids, (h.double() @ W.double().T).argmax(-1))  # and fp64's, on these random rows
    assert torch.equal(logits.gather(1, ids[:, None])[:, 0], exact.gather(1, ids[:, None])[:, 0])
    assert int(torch.isfinite(logits).sum()) == 7  # one finite logit per row: nothing else can be sampled


def test_target_verify_and_extend_take_it_too(head_setup):
    from specpilot.sglang import greedy_head

    lp, lm_head, W = head_setup
    for mode in ("TARGET_VERIFY", "EXTEND"):
        before = greedy_head.calls["certified"]
        M = 5
        fb = _batch(M, mode, extend_seq_lens=torch.ones(M, dtype=torch.int32), extend_seq_lens_cpu=[1] * M,
                    extend_logprob_start_lens_cpu=[1] * M, extend_num_tokens=M)
        h = _hidden(M, seed=2)
        out = lp(torch.zeros(M, dtype=torch.int64), h, lm_head, fb)
        assert greedy_head.calls["certified"] == before + 1, mode
        assert torch.equal(out.next_token_logits.argmax(-1), (h.double() @ W.double().T).argmax(-1))


@pytest.mark.parametrize("case", ["sampling", "logprob", "grammar", "penalty", "logit_bias", "draft_model",
                                  "custom_processor"])
def test_other_paths_keep_the_stock_head(head_setup, case):
    from specpilot.sglang import greedy_head

    lp, lm_head, W = head_setup
    M = 3
    over = {}
    if case == "sampling":
        over["sampling_info"] = _sampling(M, greedy=False)
    elif case == "logprob":
        over["return_logprob"] = True
    elif case == "grammar":
        over["sampling_info"] = _sampling(M, grammars=[None, object(), None])
    elif case == "penalty":
        over["sampling_info"] = _sampling(M, penalizer_orchestrator=types.SimpleNamespace(is_required=True))
    elif case == "logit_bias":
        over["sampling_info"] = _sampling(M, logit_bias=torch.zeros(M, V))
    elif case == "draft_model":
        over["spec_info"] = object()  # a draft model's decode carries its speculative input
    elif case == "custom_processor":
        over["sampling_info"] = _sampling(M, has_custom_logit_processor=True)
    h = _hidden(M, seed=3)
    before = dict(greedy_head.calls)
    fb = _batch(M, **over)
    if case == "logprob":  # decode with logprobs: the processor's own path, no extend fields needed
        fb.top_logprobs_nums, fb.token_ids_logprobs = [0] * M, [None] * M
    out = lp(torch.zeros(M, dtype=torch.int64), h, lm_head, fb)
    assert greedy_head.calls["certified"] == before["certified"], case
    assert greedy_head.calls["stock"] == before["stock"] + 1, case
    logits = out.next_token_logits
    assert bool(torch.isfinite(logits).all())
    assert torch.equal(logits[:, :V], torch.matmul(h, lm_head.weight.T)[:, :V].to(logits.dtype))


def test_near_tie_follows_the_exact_head(head_setup):
    """Two tokens whose logits round to the same BF16 value: the stock head's BF16 logits tie (argmax: the lower
    id); the certified head answers the larger exact logit."""
    from specpilot.sglang.greedy_head import certified_logits, head_for, invalidate

    lp, lm_head, W = head_setup
    w = lm_head.weight.data
    saved = w.clone()
    try:
        base = torch.zeros(H, dtype=torch.bfloat16)
        base[:8] = 1.0
        w[10] = base
        w[20] = base
        w[20, 8] = 2.0 ** -9  # logit of token 20 = 8 + 2^-9: rounds to 8.0 in BF16, like token 10
        h = torch.zeros(1, H, dtype=torch.bfloat16)
        h[0, :9] = 1.0
        stock = torch.matmul(h, w.T)
        assert stock[0, 10] == stock[0, 20] and int(stock.argmax(-1)) == 10
        invalidate()  # written through .data, outside SGLang's loaders: the screen tables must be rebuilt
        head = head_for(lm_head)
        assert int(certified_logits(head, h, w.shape[0]).argmax(-1)) == 20
    finally:
        w.copy_(saved)
        invalidate()


def test_weight_updates_rebuild_the_head(head_setup):
    """SGLang ends the initial load and every weight update with DefaultModelLoader.postprocess_weights: the hook
    on it drops the certified head's tables, so an updated head is never answered from stale ones."""
    from sglang.srt.model_loader.loader import DefaultModelLoader

    from specpilot.sglang.greedy_head import head_for

    lp, lm_head, W = head_setup
    first = head_for(lm_head)
    assert head_for(lm_head) is first
    DefaultModelLoader.postprocess_weights(torch.nn.ModuleList([lm_head]), torch.device("cpu"))
    assert head_for(lm_head) is not first
