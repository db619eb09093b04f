"""`SPECPILOT_SGLANG_GDN` on SGLang's real classes, on the CPU: `HybridReqToTokenPool` (its `MambaPool` with the
speculative state), `GDNAttnBackend` built by its own constructor (hooked), `HybridLinearAttnBackend` over
torch_native, `RadixLinearAttention` layers, `ForwardBatch` and `EagleVerifyInput`. A target-verify forward and
`update_mamba_state_after_mtp_verify` commit, for chains and trees, the SSM and conv states of the accepted path:
equal to the fp64 recurrence (SSM, within twice the fp32 recurrence's error, and within twice the error of SGLang's
own snapshot path, run under the Triton interpreter) and to the conv window (bit for bit). The verify writes no
state; SGLang's snapshot buffers are released; bad inputs raise."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import gdn
from specpilot.testing import assert_close

H, HV, K, W = 2, 4, 16, 4  # key heads, value heads, head dim (K == V, as in Qwen3.5), conv width
D = 2 * H * K + HV * K
LAYERS = (0, 1, 2)  # GDN layers; layer 3 is the full-attention layer of the hybrid backend
ACT = torch.bfloat16


def _links(parents):
    """SGLang's retrieve_next_token / retrieve_next_sibling rows (first child, next sibling) of a parent list."""
    n = len(parents)
    nt, ns = [-1] * n, [-1] * n
    last = {}
    for i, p in enumerate(parents):
        if p < 0:
            continue
        if p in last:
            ns[last[p]] = i
        else:
            nt[p] = i
        last[p] = i
    return nt, ns


class Setup:
    """SGLang's hybrid pools and backends for 3 GDN layers, the plugin's hooks applied."""

    def __init__(self, sglang_tp1, n, topk, ssm_dtype=torch.float32, seed=0, max_reqs=6, backend_cls=None,
                 draft_worker=False):
        from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
        from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend
        from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend
        from sglang.srt.layers.attention.linear.utils import LinearAttnBackends, LinearAttnKernelBackend
        from sglang.srt.layers.radix_linear_attention import RadixLinearAttention
        from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool, MHATokenToKVPool

        self.g = torch.Generator().manual_seed(seed)
        self.n = n
        shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=HV * K, n_groups=H, num_heads=HV,
                                        head_dim=K, state_size=K, conv_kernel=W)
        params = Mamba2CacheParams(shape=shape, layers=list(LAYERS),
                                   dtype=Mamba2StateDType(conv=ACT, temporal=ssm_dtype))
        self.pool = HybridReqToTokenPool(size=max_reqs, mamba_size=max_reqs, mamba_spec_state_size=max_reqs,
                                         max_context_len=64, device="cpu", enable_memory_saver=False,
                                         cache_params=params, mamba_layer_ids=list(LAYERS),
                                         enable_mamba_extra_buffer=False, speculative_num_draft_tokens=n,
                                         speculative_eagle_topk=topk)
        self.snapshots = self.pool.mamba_pool.mamba_cache.intermediate_ssm.numel() * 4
        kv = MHATokenToKVPool(size=64, page_size=1, dtype=ACT, head_num=1, head_dim=64, layer_num=4, device="cpu",
                              enable_memory_saver=False)
        tk = LinearAttnKernelBackend.TRITON
        # The ModelRunner fields these backends' constructors read (ModelRunner itself needs a loaded model)
        runner = types.SimpleNamespace(device="cpu", use_mla_backend=False, server_args=sglang_tp1.server_args,
                                       linear_attn_backends=LinearAttnBackends(decode=tk, prefill=tk, verify=tk),
                                       is_draft_worker=draft_worker, req_to_token_pool=self.pool,
                                       token_to_kv_pool=kv)
        self.linear = (backend_cls or GDNAttnBackend)(runner)
        self.linear.topk = topk  # what --speculative-eagle-topk sets
        self.hybrid = HybridLinearAttnBackend(ATTENTION_BACKENDS["torch_native"](runner), self.linear, [3])
        cache = self.pool.mamba_pool.mamba_cache
        cache.temporal.copy_(torch.randn(cache.temporal.shape, generator=self.g) * 0.1)
        cache.conv[0].copy_(torch.randn(cache.conv[0].shape, generator=self.g).to(ACT))
        self.layers = []
        for lid in LAYERS:
            w = (torch.randn(D, W, generator=self.g) * 0.3).to(ACT)
            A_log = torch.randn(HV, generator=self.g) * 0.5
            dt = torch.randn(HV, generator=self.g) * 0.5
            self.layers.append(RadixLinearAttention(lid, H, H, HV, K, K, K, conv_weights=w, bias=None,
                                                    activation="silu", A_log=A_log, dt_bias=dt))

    def batch(self, trees, mamba_rows):
        """A TARGET_VERIFY ForwardBatch of len(trees) requests (their mamba slots `mamba_rows`)."""
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
        from sglang.srt.speculative.eagle_info import EagleVerifyInput

        B, n = len(trees), self.n
        req = torch.arange(1, B + 1)
        self.pool.req_index_to_mamba_index_mapping[req] = torch.tensor(mamba_rows, dtype=torch.int32)
        links = [_links(p) for p in trees]
        nt = torch.tensor([a for a, _ in links])
        ns = torch.tensor([b for _, b in links])
        seq = torch.full((B,), 7, dtype=torch.int64)
        spec = EagleVerifyInput(
            draft_token=torch.zeros(B * n, dtype=torch.int64),
            custom_mask=torch.ones(B * n * (7 + n), dtype=torch.bool),
            positions=torch.arange(n).repeat(B) + 7, retrieve_index=torch.arange(B * n).view(B, n),
            retrieve_next_token=nt, retrieve_next_sibling=ns, retrieve_cum_len=None, spec_steps=n - 1,
            topk=self.linear.topk, draft_token_num=n, capture_hidden_mode=CaptureHiddenMode.FULL,
            seq_lens_sum=7 * B, seq_lens_cpu=seq.clone())
        return ForwardBatch(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=B,
                            input_ids=torch.zeros(B * n, dtype=torch.int64), req_pool_indices=req, seq_lens=seq,
                            out_cache_loc=torch.arange(B * n), seq_lens_sum=7 * B, seq_lens_cpu=seq.clone(),
                            spec_info=spec)

    def inputs(self, T):
        x = torch.randn(T, D, generator=self.g).to(ACT)
        a = torch.randn(T, HV, generator=self.g).to(ACT)
        b = torch.randn(T, HV, generator=self.g).to(ACT)
        return x, a, b


def _expected(layer, x, a, b, conv0, state0, parents, dtype):
    """The recurrence of one request and layer in `dtype`: outputs [n, HV, V] and states [n, HV, K, V], from the
    conv outputs rounded to the activation dtype as SGLang's conv kernels write them."""
    from specpilot.sglang.gdn_verify import gates

    xc = gdn.conv_reference(x, conv0[None], layer.conv_weights, [parents], None, "silu", [0],
                            dtype=torch.float64).to(ACT)
    q, k, v = torch.split(xc, [H * K, H * K, HV * K], -1)
    g, beta = gates(layer.A_log, layer.dt_bias, a, b)
    n = x.shape[0]
    return gdn.recurrent_reference(q.reshape(n, H, K), k.reshape(n, H, K), v.reshape(n, HV, K), g, beta,
                                   state0.transpose(-1, -2), parents=parents, use_qk_l2norm=True, return_states=True,
                                   dtype=dtype)


CASES = {
    "chain-n5-B1": ([[-1, 0, 1, 2, 3]], [3], [4], 1),
    "chain-n4-B2": ([[-1, 0, 1, 2]] * 2, [5, 2], [1, 3], 1),
    "tree-n6-B2": ([[-1, 0, 0, 1, 1, 2], [-1, 0, 1, 0, 3, 3]], [2, 6], [4, 5], 2),
    "tree-n7-B3": ([[-1, 0, 0, 0, 1, 2, 5], [-1, 0, 1, 2, 0, 4, 1], [-1, 0, 0, 1, 2, 3, 3]], [1, 4, 3], [6, 0, 4],
                   3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_commit_equals_fp64_recurrence(sglang_tp1, case, caplog):
    trees, rows, last, topk = CASES[case]
    n = len(trees[0])
    with caplog.at_level(logging.WARNING, logger="specpilot.sglang"):
        s = Setup(sglang_tp1, n, topk)
    cache = s.pool.mamba_pool.mamba_cache
    assert cache.intermediate_ssm is None and cache.intermediate_conv_window == []
    assert any("released SGLang's per-draft-token snapshot buffers" in r.message for r in caplog.records)
    assert s.linear._sp_gdn is True
    t0, c0 = cache.temporal.clone(), cache.conv[0].clone()
    fb = s.batch(trees, rows)
    s.hybrid.init_forward_metadata(fb)
    T = len(trees) * n
    from specpilot.sglang.gdn_verify import calls

    before = dict(calls)
    feeds = [s.inputs(T) for _ in LAYERS]
    outs = [s.hybrid.forward_extend(layer, fb, mixed_qkv=x, a=a, b=b)
            for layer, (x, a, b) in zip(s.layers, feeds)]
    assert torch.equal(cache.temporal, t0) and torch.equal(cache.conv[0], c0), "verify wrote a committed state"
    assert s.linear._sp_gdn_step.parents == trees  # the tree read from SGLang's links (topk > 1) or a chain
    s.hybrid.update_mamba_state_after_mtp_verify(torch.tensor(last), None, None, None,
                                                 req_pool_indices=fb.req_pool_indices)
    assert s.linear._sp_gdn_step is None
    assert calls["verify"] - before["verify"] == len(LAYERS) and calls["commit"] - before["commit"] == 1
    assert calls["sglang_verify"] == before["sglang_verify"] and calls["sglang_commit"] == before["sglang_commit"]
    for li, (layer, (x, a, b), out) in enumerate(zip(s.layers, feeds, outs)):
        assert out.shape == (1, T, HV, K)
        for r, (parents, row, j) in enumerate(zip(trees, rows, last)):
            sl = slice(r * n, (r + 1) * n)
            args = (layer, x[sl], a[sl], b[sl], c0[li, row], t0[li, row], parents)
            o64, s64 = _expected(*args, torch.float64)
            o32, s32 = _expected(*args, torch.float32)
            # outputs in v's dtype (bf16): the baseline is the fp32 recurrence rounded the same way
            assert_close(out[0, sl], o64, o32.to(ACT), msg=f"{case} layer {li} request {r} outputs")
            assert_close(cache.temporal[li, row].transpose(-1, -2), s64[j], s32[j],
                         msg=f"{case} layer {li} request {r} committed state")
            path = gdn.reference.root_path(parents, j)
            want_conv = torch.cat([c0[li, row], x[sl][path].T], 1)[:, -(W - 1):]
            assert torch.equal(cache.conv[0][li, row], want_conv), (case, li, r)
        others = [i for i in range(cache.temporal.shape[1]) if i not in rows]
        assert torch.equal(cache.temporal[li, others], t0[li, others])
        assert torch.equal(cache.conv[0][li, others], c0[li, others])


def test_equals_sglang_snapshot_path(sglang_tp1):
    """Against SGLang's own snapshot path for the SSM state: its verify kernel, as its GDNKernelDispatcher picks it
    (the recurrent Triton kernel writing one state per draft token into `intermediate_ssm`), run on the CPU under
    the Triton interpreter in a subprocess (TRITON_INTERPRET=1 must be set before the kernels are defined), then
    SGLang's scatter of each request's last accepted snapshot (`_scatter_speculative_state_with_mask`, the CPU form
    of the fused scatter, which refuses CPU tensors). Both sides take the conv output of gdn.tree_conv1d: SGLang's
    conv kernel gives NaN under the interpreter. The gdn path (its kernels under the interpreter too): verify
    outputs and committed SSM states within twice SGLang's own error against the fp64 recurrence."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        root = Path(__file__).resolve().parents[1]
        r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-x",
                            f"{Path(__file__).relative_to(root)}::test_equals_sglang_snapshot_path"],
                           env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=root, capture_output=True, text=True,
                           timeout=900)
        assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]
        return
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend

    trees, rows, last = [[-1, 0, 0, 1, 1, 2], [-1, 0, 1, 2, 3, 4], [-1, 0, 1, 0, 3, 3]], [2, 4, 5], [4, 3, 5]
    B, n, T = 3, 6, 18
    ours = Setup(sglang_tp1, n, 2)
    theirs = Setup(sglang_tp1, n, 2, draft_worker=True)  # a draft worker's backend keeps SGLang's path
    assert ours.linear._sp_gdn and not theirs.linear._sp_gdn
    cache, ref = ours.pool.mamba_pool.mamba_cache, theirs.pool.mamba_pool.mamba_cache
    assert torch.equal(cache.temporal, ref.temporal) and torch.equal(cache.conv[0], ref.conv[0])  # one seed
    t0, c0 = cache.temporal.clone(), cache.conv[0].clone()
    fb = ours.batch(trees, rows)
    ours.hybrid.init_forward_metadata(fb)
    feeds = [ours.inputs(T) for _ in LAYERS]
    o_sp = [ours.hybrid.forward_extend(layer, fb, mixed_qkv=x, a=a, b=b) for layer, (x, a, b) in
            zip(ours.layers, feeds)]
    ours.hybrid.update_mamba_state_after_mtp_verify(torch.tensor(last), None, None, None)
    plan = gdn.build_tree_plan(trees)
    rows32 = torch.tensor(rows, dtype=torch.int32)
    parents = torch.tensor([[max(p, 0) for p in t] for t in trees], dtype=torch.int32)  # the root's is not read
    o_sg = []
    for li, (layer, (x, a, b)) in enumerate(zip(theirs.layers, feeds)):
        xc = gdn.tree_conv1d(x, ref.conv[0][li], layer.conv_weights, plan, conv_state_indices=rows32)
        q, k, v = torch.split(xc, [H * K, H * K, HV * K], -1)
        o_sg.append(theirs.linear.kernel_dispatcher.target_verify(
            A_log=layer.A_log, dt_bias=layer.dt_bias, q=q.reshape(1, T, H, K), k=k.reshape(1, T, H, K),
            v=v.reshape(1, T, HV, K), a=a, b=b, ssm_states=ref.temporal[li], cache_indices=rows32,
            query_start_loc=torch.arange(0, T + 1, n, dtype=torch.int32),
            intermediate_states_buffer=ref.intermediate_ssm[li],
            intermediate_state_indices=torch.arange(B, dtype=torch.int32), cache_steps=n,
            retrieve_parent_token=parents))
    HybridLinearAttnBackend._scatter_speculative_state_with_mask(ref.temporal, ref.intermediate_ssm, rows32,
                                                                 torch.tensor(last))
    for li, (layer, (x, a, b)) in enumerate(zip(ours.layers, feeds)):
        for r, (ps, row, j) in enumerate(zip(trees, rows, last)):
            sl = slice(r * n, (r + 1) * n)
            o64, s64 = _expected(layer, x[sl], a[sl], b[sl], c0[li, row], t0[li, row], ps, torch.float64)
            assert_close(o_sp[li][0, sl], o64, o_sg[li].reshape(1, T, HV, K)[0, sl],
                         msg=f"layer {li} request {r} outputs")
            assert_close(cache.temporal[li, row].transpose(-1, -2), s64[j], ref.temporal[li, row].transpose(-1, -2),
                         msg=f"layer {li} request {r} committed state")


def test_nothing_accepted_leaves_the_state(sglang_tp1):
    s = Setup(sglang_tp1, 3, 1)
    cache = s.pool.mamba_pool.mamba_cache
    t0, c0 = cache.temporal.clone(), cache.conv[0].clone()
    fb = s.batch([[-1, 0, 1]], [2])
    s.hybrid.init_forward_metadata(fb)
    for layer in s.layers:
        x, a, b = s.inputs(3)
        s.hybrid.forward_extend(layer, fb, mixed_qkv=x, a=a, b=b)
    s.hybrid.update_mamba_state_after_mtp_verify(torch.tensor([-1]), None, None, None)
    assert torch.equal(cache.temporal, t0) and torch.equal(cache.conv[0], c0)


def test_snapshot_bytes_released_match_sglang_buffers(sglang_tp1, caplog):
    from specpilot.sglang.gdn_verify import snapshot_bytes

    with caplog.at_level(logging.WARNING, logger="specpilot.sglang"):
        s = Setup(sglang_tp1, 5, 2)
    # [layers, requests + 1, draft tokens, HV, V, K] fp32: what SGLang's MambaPool allocated for snapshots
    assert s.snapshots == len(LAYERS) * 7 * 5 * HV * K * K * 4
    msg = next(r.message for r in caplog.records if "released" in r.message)
    assert f"intermediate_ssm {s.snapshots / 2 ** 30:.3f} GiB" in msg
    kept = types.SimpleNamespace(intermediate_ssm=torch.zeros(2, 3), intermediate_conv_window=[torch.zeros(4)])
    assert snapshot_bytes(kept) == (24, 16)


def test_bf16_ssm_pool_keeps_sglang_path(sglang_tp1, caplog):
    with caplog.at_level(logging.WARNING, logger="specpilot.sglang"):
        s = Setup(sglang_tp1, 3, 1, ssm_dtype=torch.bfloat16)
    assert s.linear._sp_gdn is False
    assert s.pool.mamba_pool.mamba_cache.intermediate_ssm is not None
    assert any("SGLang's verify and commit stay" in r.message and "bfloat16" in r.message for r in caplog.records)


def test_backend_overriding_forward_extend_keeps_sglang_path(sglang_tp1, caplog):
    """A GDN backend class whose forward_extend is its own (a vendor's, say) is not reached by the verify hook, so
    its snapshots stay and SGLang's commit runs."""
    from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend

    class OwnExtend(GDNAttnBackend):
        def forward_extend(self, *args, **kwargs):
            return super().forward_extend(*args, **kwargs)

    with caplog.at_level(logging.WARNING, logger="specpilot.sglang"):
        s = Setup(sglang_tp1, 3, 1, backend_cls=OwnExtend)
    assert s.linear._sp_gdn is False
    assert s.pool.mamba_pool.mamba_cache.intermediate_ssm is not None
    assert any("OwnExtend overrides forward_extend" in r.message for r in caplog.records)


def test_bad_tree_links_raise(sglang_tp1):
    s = Setup(sglang_tp1, 4, 2)
    fb = s.batch([[-1, 0, 0, 1]], [1])
    fb.spec_info.retrieve_next_token[0, 3] = 1  # token 3's first child is token 1, which token 0 already links
    s.hybrid.init_forward_metadata(fb)
    x, a, b = s.inputs(4)
    with pytest.raises(ValueError, match=r"^specpilot\.sglang\.gdn: request 0: the draft tree links reach token 1 "
                                         r"twice .*; retrieve_next_token"):
        s.hybrid.forward_extend(s.layers[0], fb, mixed_qkv=x, a=a, b=b)
    fb2 = s.batch([[-1, 0, 0, 1]], [1])
    fb2.spec_info.retrieve_next_sibling[0, 1] = -1  # token 2 is no longer reached
    s.hybrid.init_forward_metadata(fb2)
    with pytest.raises(ValueError, match=r"^specpilot\.sglang\.gdn: request 0: draft token 2 is not reached"):
        s.hybrid.forward_extend(s.layers[0], fb2, mixed_qkv=x, a=a, b=b)


def test_bad_commits_raise(sglang_tp1):
    s = Setup(sglang_tp1, 3, 1)
    with pytest.raises(RuntimeError, match=r"^specpilot\.sglang\.gdn: a commit after verify with no verified step"):
        s.hybrid.update_mamba_state_after_mtp_verify(torch.tensor([0]), None, None, None)
    fb = s.batch([[-1, 0, 1]], [2])
    s.hybrid.init_forward_metadata(fb)
    x, a, b = s.inputs(3)
    s.hybrid.forward_extend(s.layers[0], fb, mixed_qkv=x, a=a, b=b)
    with pytest.raises(RuntimeError, match=r"^specpilot\.sglang\.gdn: .* no verify inputs of pool layers \[1, 2\]"):
        s.hybrid.update_mamba_state_after_mtp_verify(torch.tensor([1]), None, None, None)
    s.hybrid.init_forward_metadata(fb)
    for layer in s.layers:
        s.hybrid.forward_extend(layer, fb, mixed_qkv=x, a=a, b=b)
    with pytest.raises(ValueError, match=r"^specpilot\.sglang\.gdn: request 0: last_correct_step_indices names "
                                         r"draft token 3, outside its 3 draft tokens; pass"):
        s.hybrid.update_mamba_state_after_mtp_verify(torch.tensor([3]), None, None, None)
    s.hybrid.init_forward_metadata(fb)
    for layer in s.layers:
        s.hybrid.forward_extend(layer, fb, mixed_qkv=x, a=a, b=b)
    with pytest.raises(ValueError, match=r"^specpilot\.sglang\.gdn: mamba_track_indices without "):
        s.hybrid.update_mamba_state_after_mtp_verify(torch.tensor([1]), torch.tensor([4]), None, None)
    padded = s.batch([[-1, 0, 1]] * 2, [0, 0])  # two rows on SGLang's padding slot 0
    s.hybrid.init_forward_metadata(padded)
    for layer in s.layers:
        x2, a2, b2 = s.inputs(6)
        s.hybrid.forward_extend(layer, padded, mixed_qkv=x2, a=a2, b=b2)
    with pytest.raises(ValueError, match=r"^specpilot\.sglang\.gdn: the verified requests' state rows \[0, 0\] .*; "
                                         r"gdn.commit writes one row per request"):
        s.hybrid.update_mamba_state_after_mtp_verify(torch.tensor([1, 1]), None, None, None)


def test_track_slots_get_the_prefix_state(sglang_tp1):
    """The radix cache's Mamba track slots (mamba_track_indices / mamba_steps_to_track): the states after the root
    path of the tracked draft token, as SGLang's scatter of that token's snapshot writes them; -1 tracks nothing."""
    trees, rows, last = [[-1, 0, 0, 1, 2], [-1, 0, 1, 1, 3]], [2, 5], [3, 4]
    track, steps = [1, 4], [1, -1]
    s = Setup(sglang_tp1, 5, 2)
    cache = s.pool.mamba_pool.mamba_cache
    t0, c0 = cache.temporal.clone(), cache.conv[0].clone()
    fb = s.batch(trees, rows)
    s.hybrid.init_forward_metadata(fb)
    feeds = [s.inputs(10) for _ in LAYERS]
    for layer, (x, a, b) in zip(s.layers, feeds):
        s.hybrid.forward_extend(layer, fb, mixed_qkv=x, a=a, b=b)
    s.hybrid.update_mamba_state_after_mtp_verify(torch.tensor(last), torch.tensor(track), torch.tensor(steps), None)
    for li, (layer, (x, a, b)) in enumerate(zip(s.layers, feeds)):
        args = (layer, x[:5], a[:5], b[:5], c0[li, 2], t0[li, 2], trees[0])
        _, s64 = _expected(*args, torch.float64)
        _, s32 = _expected(*args, torch.float32)
        for row, j in ((1, 1), (2, 3)):  # the track slot (token 1) and the request's own row (token 3)
            assert_close(cache.temporal[li, row].transpose(-1, -2), s64[j], s32[j], msg=f"layer {li} row {row}")
            path = gdn.reference.root_path(trees[0], j)
            assert torch.equal(cache.conv[0][li, row], torch.cat([c0[li, 2], x[:5][path].T], 1)[:, -(W - 1):])
        assert torch.equal(cache.temporal[li, 4], t0[li, 4]) and torch.equal(cache.conv[0][li, 4], c0[li, 4])


def test_fp32_pool_required_by_the_layer_path():
    from specpilot.sglang.gdn_verify import GDNStep, verify_layer

    parents = [[-1, 0]]
    step = GDNStep(meta=None, plan=gdn.build_tree_plan(parents), parents=parents, rows=torch.tensor([0]))
    x = torch.zeros(2, D, dtype=ACT)
    ab = torch.zeros(2, HV, dtype=ACT)
    with pytest.raises(TypeError, match=r"^specpilot\.sglang\.gdn: the SSM state pool is torch\.bfloat16; .* "
                                        r"--mamba-ssm-dtype float32"):
        verify_layer(step, 0, x, ab, ab, torch.zeros(D, W, dtype=ACT), None, "silu", torch.zeros(HV),
                     torch.zeros(HV), torch.zeros(1, D, W - 1, dtype=ACT), torch.zeros(1, HV, K, K, dtype=ACT),
                     (H, H, HV, K, K))


def test_hooks_applied(sglang_tp1):
    from sglang.srt.plugins.hook_registry import HookRegistry

    from specpilot.sglang import gdn_verify

    assert sglang_tp1.status["gdn"] == "ok"
    assert all(t in HookRegistry._patched for t in gdn_verify.TARGETS)
