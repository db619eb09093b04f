"""The `specpilot_tree` attention backend on SGLang's real classes, on the CPU: a target-verify forward through
`ForwardBatch`, `EagleVerifyInput`, `ReqToTokenPool`, `MHATokenToKVPool` and `RadixAttention` equals tree_attn's
fp64 reference for chains, trees, ragged batches, GQA and paged slots; other modes run SGLang's own backend
(torch_native, built by SGLang's registry); bad masks are refused; the graph runner's capture and padded replays of
target verify refill one fixed-buffer plan."""

from __future__ import annotations

import types

import pytest
import torch

from specpilot.testing import assert_close

D = 64  # a tree_attn head_dim; the CPU runs its torch path (variant=None)
DT = torch.bfloat16


def _anc(parents):
    """int64 ancestor-or-self bits of a tree given as parent indices (-1: root)."""
    out = []
    for i in range(len(parents)):
        b, a = 0, i
        while a >= 0:
            b |= 1 << a
            a = parents[a]
        out.append(b)
    return out


def _sglang_mask(trees, prefix_lens, layout):
    """SGLang's custom_mask for these trees: FULL_MASK [n, L + n] per request (prefix columns True), or
    QLEN_ONLY [n, n]; flattened and concatenated, as build_tree_kernel_efficient writes it."""
    parts = []
    for parents, L in zip(trees, prefix_lens):
        n = len(parents)
        bits = _anc(parents)
        tree = torch.tensor([[(bits[i] >> j) & 1 for j in range(n)] for i in range(n)], dtype=torch.bool)
        block = torch.cat([torch.ones(n, L, dtype=torch.bool), tree], 1) if layout == "full" else tree
        parts.append(block.reshape(-1))
    return torch.cat(parts)


class Setup:
    """SGLang's pools, one RadixAttention layer and the specpilot_tree backend over torch_native."""

    def __init__(self, H, Hkv, page_size=1, slots=256, max_reqs=8, ctx=128, layer_id=0, seed=0):
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
        from sglang.srt.layers.radix_attention import RadixAttention
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

        self.g = torch.Generator().manual_seed(seed)
        self.H, self.Hkv, self.page_size = H, Hkv, page_size
        self.req_pool = ReqToTokenPool(size=max_reqs, max_context_len=ctx, device="cpu", enable_memory_saver=False)
        self.kv_pool = MHATokenToKVPool(size=slots, page_size=page_size, dtype=DT, head_num=Hkv, head_dim=D,
                                        layer_num=layer_id + 1, device="cpu", enable_memory_saver=False)
        self.layer = RadixAttention(H, D, D ** -0.5 * 1.25, Hkv, layer_id)
        # The ModelRunner fields SGLang's backend factories read (torch_native's and ours). ModelRunner itself is
        # not built: its module imports the HTTP server stack (uvicorn), which the test environment leaves out.
        self.runner = types.SimpleNamespace(device="cpu", use_mla_backend=False, req_to_token_pool=self.req_pool,
                                            token_to_kv_pool=self.kv_pool)
        self.backend = ATTENTION_BACKENDS["specpilot_tree"](self.runner)
        # the prefix K/V already in the cache: random rows in every slot
        for buf in (self.kv_pool.get_key_buffer(layer_id), self.kv_pool.get_value_buffer(layer_id)):
            buf.copy_(torch.randn(buf.shape, generator=self.g).to(DT))
        self.free = self._slot_order(slots)

    def _slot_order(self, slots):
        """Token slots in allocation order: whole pages in a random order (slot 0's page is SGLang's padding)."""
        ps = self.page_size
        pages = (torch.randperm(slots // ps - 1, generator=self.g) + 1).tolist()
        return [p * ps + o for p in pages for o in range(ps)]

    def token_rows(self, buf):
        """A layer's cache as token-slot rows [slots, Hkv, D] (under SGLang's HND layout, [pages, Hkv, page, D])."""
        if self.kv_pool.use_hnd:
            buf = buf.permute(0, 2, 1, 3)
        return buf.reshape(-1, self.Hkv, D)

    def take(self, n):
        """n slots for one request, which starts on a fresh page as under SGLang's paged allocator."""
        used = -(-n // self.page_size) * self.page_size
        out, self.free = self.free[:n], self.free[used:]
        return out

    def verify_batch(self, trees, prefix_lens, layout="full", mask=None):
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
        from sglang.srt.speculative.eagle_info import EagleVerifyInput

        n = len(trees[0])
        assert all(len(t) == n for t in trees), "SGLang verifies the same number of draft tokens per request"
        B = len(trees)
        req_idx = torch.arange(1, B + 1)  # row 0 of req_to_token is SGLang's padding row
        prefix, draft = [], []
        for r, L in enumerate(prefix_lens):
            own = self.take(L + n)  # the prefix, then the draft tokens' slots on the same pages
            self.req_pool.req_to_token[int(req_idx[r]), :L + n] = torch.tensor(own, dtype=torch.int32)
            prefix.append(own[:L])
            draft += own[L:]
        seq_lens = torch.tensor(prefix_lens, dtype=torch.int64)
        spec = EagleVerifyInput(
            draft_token=torch.zeros(B * n, dtype=torch.int64),
            custom_mask=_sglang_mask(trees, prefix_lens, layout) if mask is None else mask,
            positions=torch.cat([torch.arange(n) + L for L in prefix_lens]),
            retrieve_index=torch.full((B, n), -1), retrieve_next_token=torch.full((B, n), -1),
            retrieve_next_sibling=torch.full((B, n), -1), retrieve_cum_len=None, spec_steps=n - 1, topk=1,
            draft_token_num=n, capture_hidden_mode=CaptureHiddenMode.FULL, seq_lens_sum=sum(prefix_lens),
            seq_lens_cpu=seq_lens.clone())
        fb = ForwardBatch(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=B, input_ids=torch.zeros(B * n,
                          dtype=torch.int64), req_pool_indices=req_idx, seq_lens=seq_lens,
                          out_cache_loc=torch.tensor(draft, dtype=torch.int64), seq_lens_sum=sum(prefix_lens),
                          seq_lens_cpu=seq_lens.clone(), spec_info=spec)
        return fb, prefix, draft

    def qkv(self, T):
        """q [T, H * D], k and v [T, Hkv, D]: what RadixAttention.forward hands a backend."""
        q = torch.randn(T, self.H * D, generator=self.g).to(DT)
        k = torch.randn(T, self.Hkv, D, generator=self.g).to(DT)
        v = torch.randn(T, self.Hkv, D, generator=self.g).to(DT)
        return q, k, v

    def reference(self, q, k, v, trees, prefix, dtype):
        """tree_attn's reference over the prefix slots this test allocated and the trees' own ancestor bits."""
        import tree_attn

        n, B = len(trees[0]), len(trees)
        i32 = {"dtype": torch.int32}
        kv_indptr = torch.tensor([0] + list(torch.cumsum(torch.tensor([len(p) for p in prefix]), 0)), **i32)
        kv_indices = torch.tensor([s for p in prefix for s in p], **i32)
        mask = torch.tensor([b for t in trees for b in _anc(t)], dtype=torch.int64)
        lid = self.layer.layer_id
        out, _ = tree_attn.tree_attention_reference(
            q.view(-1, self.H, D), self.token_rows(self.kv_pool.get_key_buffer(lid)),
            self.token_rows(self.kv_pool.get_value_buffer(lid)), kv_indptr,
            kv_indices, torch.arange(0, (B + 1) * n, n, **i32), mask, sm_scale=self.layer.scaling,
            k_new=k.view(-1, self.Hkv, D), v_new=v.view(-1, self.Hkv, D), dtype=dtype)
        return out

    def run_verify(self, trees, prefix_lens, layout="full"):
        from specpilot.sglang import tree_backend

        fb, prefix, draft = self.verify_batch(trees, prefix_lens, layout)
        q, k, v = self.qkv(fb.batch_size * len(trees[0]))
        self.backend.init_forward_metadata(fb)
        before = tree_backend.calls["tree_attn"]
        out = self.backend.forward(q, k, v, self.layer, fb)
        assert tree_backend.calls["tree_attn"] == before + 1
        assert out.shape == q.shape and out.dtype == DT
        lid = self.layer.layer_id
        slots = torch.tensor(draft)  # the draft tokens' K/V were written where SGLang's out_cache_loc says
        assert torch.equal(self.token_rows(self.kv_pool.get_key_buffer(lid))[slots], k)
        assert torch.equal(self.token_rows(self.kv_pool.get_value_buffer(lid))[slots], v)
        ref64 = self.reference(q, k, v, trees, prefix, torch.float64)
        ref32 = self.reference(q, k, v, trees, prefix, torch.float32)
        assert_close(out.view(-1, self.H, D), ref64, ref32.to(DT), factor=2.0)
        return out


@pytest.fixture
def tree_env(sglang_tp1, monkeypatch):
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    assert "specpilot_tree" in ATTENTION_BACKENDS, sglang_tp1.status
    monkeypatch.setenv("SPECPILOT_SGLANG_TREE_ATTN_INNER", "torch_native")


CHAIN5 = [-1, 0, 1, 2, 3]
TREE6 = [-1, 0, 0, 1, 1, 2]  # root, two children, three grandchildren (EAGLE topk=2 shaped)
TREE7 = [-1, 0, 1, 0, 3, 0, 2]


@pytest.mark.parametrize("layout", ["full", "qlen"])
def test_chain(tree_env, layout):
    Setup(H=4, Hkv=4).run_verify([CHAIN5], [37], layout)


@pytest.mark.parametrize("layout", ["full", "qlen"])
def test_tree(tree_env, layout):
    Setup(H=4, Hkv=4, seed=1).run_verify([TREE6], [23], layout)


def test_ragged_batch(tree_env):
    """Three requests, prefixes 1, 40 and 63, three different 7-node trees (one a chain)."""
    Setup(H=4, Hkv=2, seed=2).run_verify([TREE7, [-1, 0, 1, 2, 3, 4, 5], [-1, 0, 0, 0, 0, 0, 0]], [1, 40, 63])


@pytest.mark.parametrize("H,Hkv", [(6, 2), (8, 1)], ids=["H6-Hkv2", "H8-Hkv1"])
def test_gqa(tree_env, H, Hkv):
    Setup(H=H, Hkv=Hkv, seed=3).run_verify([TREE6, TREE6[:3] + [1, 2, 2]], [17, 9])


@pytest.mark.parametrize("page_size", [4, 16])
def test_paged_slots(tree_env, page_size):
    """A paged pool: slots are whole pages in a scrambled order, so prefixes and draft tokens straddle pages."""
    Setup(H=4, Hkv=2, page_size=page_size, slots=512, seed=4).run_verify([TREE7, TREE7], [29, 50])


def test_hnd_cache_layout(tree_env, monkeypatch):
    """SGLang's head-major paged cache (SGLANG_USE_HND_KVCACHE=1): [pages, Hkv, page_size, D] per layer."""
    monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", "1")
    s = Setup(H=4, Hkv=2, page_size=8, slots=504, seed=12)
    assert s.kv_pool.use_hnd and s.kv_pool.get_key_buffer(0).shape == (64, 2, 8, D)
    s.run_verify([TREE6, TREE6[:4] + [3, 0]], [21, 30])


def test_wrappers_calling_forward_extend_reach_it(tree_env):
    """SGLang's wrapper backends (HybridLinearAttnBackend of the hybrid GDN models, HybridAttnBackend) call the full
    attention backend's forward_extend directly: the verify runs tree_attn there too, with the same result."""
    from specpilot.sglang import tree_backend

    s = Setup(H=4, Hkv=2, seed=14)
    fb, _, _ = s.verify_batch([TREE6, TREE6], [7, 19])
    q, k, v = s.qkv(12)
    s.backend.init_forward_metadata(fb)
    before = tree_backend.calls["tree_attn"]
    via_extend = s.backend.forward_extend(q, k, v, s.layer, fb, save_kv_cache=True)
    via_forward = s.backend.forward(q, k, v, s.layer, fb)
    assert tree_backend.calls["tree_attn"] == before + 2
    assert torch.equal(via_extend, via_forward)


def test_two_layers_share_the_forward_plan(tree_env):
    """The plan is built once per forward and serves every layer of that shape; a second forward plans again."""
    from sglang.srt.layers.radix_attention import RadixAttention

    s = Setup(H=4, Hkv=2, seed=5)
    fb, prefix, _ = s.verify_batch([TREE6], [12])
    s.backend.init_forward_metadata(fb)
    for lid in (0, 0):
        q, k, v = s.qkv(6)
        s.backend.forward(q, k, v, s.layer, fb)
    assert len(s.backend._sp_verify.plans) == 1
    other = RadixAttention(8, D, D ** -0.5, 2, 0)
    q = torch.randn(6, 8 * D, generator=s.g).to(DT)
    s.backend.forward(q, k, v, other, fb)
    assert len(s.backend._sp_verify.plans) == 2


def test_not_ancestor_closed_raises(tree_env):
    s = Setup(H=4, Hkv=4, seed=6)
    mask = _sglang_mask([TREE6], [10], "full").view(6, 16)
    mask[5, 10 + 0] = False  # token 5 sees its parent 2, which sees 0, but 5 no longer sees 0
    fb, _, _ = s.verify_batch([TREE6], [10], mask=mask.reshape(-1))
    with pytest.raises(ValueError, match=r"specpilot\.sglang\.tree_attn: .*request 0 is not ancestor-closed: "
                                         r"draft token 5 sees token 2, which sees token 0.*; each draft token"):
        s.backend.init_forward_metadata(fb)


def test_missing_own_bit_raises(tree_env):
    s = Setup(H=4, Hkv=4, seed=7)
    mask = _sglang_mask([CHAIN5, CHAIN5], [3, 4], "qlen").view(2, 5, 5)
    mask[1, 2, 2] = False
    fb, _, _ = s.verify_batch([CHAIN5, CHAIN5], [3, 4], mask=mask.reshape(-1))
    with pytest.raises(ValueError, match=r"specpilot\.sglang\.tree_attn: .*request 1 does not let draft token 2 see "
                                         r"itself"):
        s.backend.init_forward_metadata(fb)


def test_short_mask_raises(tree_env):
    s = Setup(H=4, Hkv=4, seed=8)
    fb, _, _ = s.verify_batch([CHAIN5], [20], mask=torch.ones(30, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"specpilot\.sglang\.tree_attn: spec_info\.custom_mask has 30 entries"):
        s.backend.init_forward_metadata(fb)


def _padded(s, fb, pad, fill=1):
    """What SGLang's graph runner gives a replay of `fb` on a graph captured for `pad` more rows: the metadata view
    from SGLang's own `build_replay_fb_view` over buffers filled as the runner fills them (`DecodeInputBuffers`:
    padded rows at req_to_token row 0 with `fill` prefix tokens), and the padded ForwardBatch the captured forward
    reads (the padded rows' draft tokens written to slot 0, SGLang's padding slot)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import build_replay_fb_view

    n = int(fb.spec_info.draft_token_num)
    raw, bs = fb.batch_size, fb.batch_size + pad
    idx = torch.cat([fb.req_pool_indices, torch.zeros(pad, dtype=fb.req_pool_indices.dtype)])
    lens = torch.cat([fb.seq_lens, torch.full((pad,), fill, dtype=fb.seq_lens.dtype)])
    buffers = types.SimpleNamespace(input_ids=torch.zeros(bs * n, dtype=torch.int64),
                                    positions=torch.zeros(bs * n, dtype=torch.int64), req_pool_indices=idx,
                                    seq_lens=lens, seq_lens_cpu=lens.clone(), encoder_lens=None,
                                    mamba_track_indices=None)
    view = build_replay_fb_view(forward_batch=fb, buffers=buffers, bs=bs, raw_bs=raw, num_tokens=bs * n,
                                global_num_tokens_cpu=None, seq_len_fill_value=fill,
                                capture_forward_mode=fb.forward_mode, is_encoder_decoder=False)
    assert view.num_padding == pad and view.batch_size == bs
    loc = torch.cat([fb.out_cache_loc, torch.zeros(pad * n, dtype=fb.out_cache_loc.dtype)])
    full = ForwardBatch(forward_mode=fb.forward_mode, batch_size=bs, input_ids=torch.zeros(bs * n, dtype=torch.int64),
                        req_pool_indices=idx, seq_lens=lens, out_cache_loc=loc, seq_lens_sum=int(lens.sum()),
                        seq_lens_cpu=lens.clone(), spec_info=fb.spec_info)
    return view, full


def _check_rows(s, out, q, k, v, trees, prefix):
    """The real requests' rows of a padded forward against the fp64 reference."""
    T = len(trees) * len(trees[0])
    ref64 = s.reference(q[:T], k[:T], v[:T], trees, prefix, torch.float64)
    ref32 = s.reference(q[:T], k[:T], v[:T], trees, prefix, torch.float32)
    assert_close(out[:T].view(-1, s.H, D), ref64, ref32.to(DT), factor=2.0)


def test_verify_graph_capture_and_replays_with_new_trees(tree_env):
    """SGLang's graph runner on target verify: capture (a placeholder batch of 3 chains), a warm-up forward that
    builds the fixed-buffer plan, then replays of other trees, prefixes and 1-2 padded rows. Each replay refills the
    captured plan in place (the same plan object and buffers, which a CUDA graph would read) and the real rows
    equal the fp64 reference; an eager forward afterwards gets a plan of its own."""
    from specpilot.sglang import tree_backend

    s = Setup(H=8, Hkv=2, slots=512, seed=9)
    n = 6
    cap, _, _ = s.verify_batch([CHAIN5 + [4]] * 3, [1, 1, 1])
    s.backend.init_forward_metadata_out_graph(cap, in_capture=True)
    st = s.backend._sp_verify
    assert st.graph and st.max_nodes == n and st.kv_capacity == 3 * 128
    q, k, v = s.qkv(3 * n)
    s.backend.forward(q, k, v, s.layer, cap)  # the warm-up forward: the plan with fixed buffers
    (plan,) = st.plans.values()
    ptrs = [t.data_ptr() for t in (plan.kv_indices, plan.items, plan.tree_mask)]
    for trees, lens in (([TREE6, [-1, 0, 1, 2, 3, 4]], [9, 40]), ([[-1, 0, 0, 0, 0, 0]], [101]),
                        ([TREE6, [-1, 0, 1, 0, 3, 4], [-1, 0, 1, 1, 0, 4]], [3, 77, 12])):
        fb, prefix, _ = s.verify_batch(trees, lens)
        view, full = _padded(s, fb, 3 - len(trees))
        s.backend.init_forward_metadata_out_graph(view)  # the replay's metadata: no init_forward_metadata call
        assert s.backend._sp_verify is st and tuple(st.plans.values()) == (plan,)
        assert [t.data_ptr() for t in (plan.kv_indices, plan.items, plan.tree_mask)] == ptrs
        q, k, v = s.qkv(3 * n)
        before = tree_backend.calls["tree_attn"]
        out = s.backend.forward(q, k, v, s.layer, full)
        assert tree_backend.calls["tree_attn"] == before + 1
        _check_rows(s, out, q, k, v, trees, prefix)
    fb, _, _ = s.verify_batch([TREE6] * 3, [5, 6, 7])
    s.backend.init_forward_metadata(fb)  # eager: not the captured state
    assert s.backend._sp_verify is not st and not s.backend._sp_verify.graph


def test_verify_graph_replay_refuses_what_the_capture_cannot_hold(tree_env):
    """A replay whose draft token count differs from the capture's, a replay tree that is not ancestor-closed, and a
    ragged verify batch (per-request draft counts) raise with the reason; decode capture stays the inner
    backend's."""
    s = Setup(H=4, Hkv=4, seed=10)
    cap, _, _ = s.verify_batch([CHAIN5] * 2, [1, 1])
    s.backend.init_forward_metadata_out_graph(cap, in_capture=True)
    s.backend.forward(*s.qkv(10), s.layer, cap)
    fb, _, _ = s.verify_batch([TREE6, TREE6], [4, 4])
    view, _ = _padded(s, fb, 0)
    with pytest.raises(ValueError, match=r"specpilot\.sglang\.tree_attn: a replay of 12 draft tokens on a graph "
                                         r"captured for 10"):
        s.backend.init_forward_metadata_out_graph(view)
    bad = _sglang_mask([CHAIN5, CHAIN5], [4, 4], "full")
    bad[4 * 9 + 4 + 1] = False  # request 0 ([5, 4 + 5]): token 4 no longer sees token 1 (it sees 3, which does)
    fb, _, _ = s.verify_batch([CHAIN5, CHAIN5], [4, 4], mask=bad)
    view, _ = _padded(s, fb, 0)
    with pytest.raises(ValueError, match="not ancestor-closed"):
        s.backend.init_forward_metadata_out_graph(view)
    fb, _, _ = s.verify_batch([CHAIN5, CHAIN5], [4, 4])
    fb.spec_info.ragged_verify_layout = object()  # SGLang's ragged verify mode: per-request draft counts
    with pytest.raises(ValueError, match=r"specpilot\.sglang\.tree_attn: a ragged verify batch"):
        s.backend.init_forward_metadata(fb)
    cap.forward_mode = type(cap.forward_mode).DECODE  # other modes' capture is the inner backend's (a no-op here)
    s.backend.init_forward_metadata_out_graph(cap, in_capture=True)
    assert "specpilot_tree plans target verify on the host" in s.backend.glue_target_verify_metadata()


def test_it_is_the_inner_backend_for_every_other_mode(tree_env):
    """A decode forward through specpilot_tree equals the same forward through SGLang's torch_native backend."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode


    s = Setup(H=4, Hkv=2, seed=10)
    assert isinstance(s.backend, TorchNativeAttnBackend)
    assert type(s.backend).__name__ == "SpecPilotTreeTorchNativeAttnBackend"
    plain = TorchNativeAttnBackend(s.runner)
    B, lens = 2, [9, 14]
    rows = [1, 2]
    for r, L in zip(rows, lens):
        s.req_pool.req_to_token[r, :L] = torch.tensor(s.take(L), dtype=torch.int32)
    loc = torch.tensor([int(s.req_pool.req_to_token[r, L - 1]) for r, L in zip(rows, lens)])
    seq = torch.tensor(lens)
    fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=B, input_ids=torch.zeros(B, dtype=torch.int64),
                      req_pool_indices=torch.tensor(rows), seq_lens=seq, out_cache_loc=loc, seq_lens_sum=sum(lens),
                      seq_lens_cpu=seq.clone())
    q, k, v = s.qkv(B)
    s.backend.init_forward_metadata(fb)
    got = s.backend.forward(q, k, v, s.layer, fb)
    plain.init_forward_metadata(fb)
    want = plain.forward(q, k, v, s.layer, fb)
    assert torch.equal(got, want)
    assert s.backend._sp_verify is None  # no tree plan outside target verify


def test_inner_name_must_be_a_backend(tree_env, monkeypatch):
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    s = Setup(H=4, Hkv=4, seed=11)
    monkeypatch.setenv("SPECPILOT_SGLANG_TREE_ATTN_INNER", "no_such_backend")
    with pytest.raises(ValueError, match=r"specpilot\.sglang\.tree_attn: SPECPILOT_SGLANG_TREE_ATTN_INNER="
                                         r"'no_such_backend' is not an SGLang attention backend"):
        ATTENTION_BACKENDS["specpilot_tree"](s.runner)


def test_inner_default(sglang_tp1, monkeypatch):
    """Unset, the inner backend is SGLang's default for the model on a GPU runner; other devices must name it."""
    from sglang.srt.arg_groups.model_override_base import get_default_attn_backend
    from sglang.srt.arg_groups.overrides import model_config_of, use_mla_backend

    from specpilot.sglang.tree_backend import inner_backend_name

    monkeypatch.delenv("SPECPILOT_SGLANG_TREE_ATTN_INNER", raising=False)
    sa = sglang_tp1.server_args
    runner = types.SimpleNamespace(device="cuda", server_args=sa, use_mla_backend=use_mla_backend(sa),
                                   model_config=model_config_of(sa))
    assert inner_backend_name(runner) == get_default_attn_backend(sa, False, runner.model_config)
    runner.device = "cpu"
    with pytest.raises(RuntimeError, match=r"specpilot\.sglang\.tree_attn: on device 'cpu' the inner backend is "
                                           r"not resolved automatically; set SPECPILOT_SGLANG_TREE_ATTN_INNER"):
        inner_backend_name(runner)


def test_layers_tree_attn_cannot_take_run_the_inner_backend(tree_env, caplog):
    """A logit-capped layer's verify goes to the inner backend's forward (one warning per reason). The inner here,
    torch_native, has no verify path of its own: it runs extend attention over the batch's extend fields, so only
    the routing is checked, not its values."""
    import logging

    from sglang.srt.layers.radix_attention import RadixAttention

    from specpilot.sglang import tree_backend

    s = Setup(H=4, Hkv=2, seed=13)
    fb, _, _ = s.verify_batch([CHAIN5], [6])
    fb.extend_prefix_lens, fb.extend_seq_lens = torch.tensor([1]), torch.tensor([5])  # torch_native's extend fields
    s.backend.init_forward_metadata(fb)
    capped = RadixAttention(4, D, D ** -0.5, 2, 0, logit_cap=30.0)
    before = dict(tree_backend.calls)
    with caplog.at_level(logging.WARNING, logger="specpilot.sglang"):
        for _ in range(2):
            q, k, v = s.qkv(5)
            out = s.backend.forward(q, k, v, capped, fb)
            assert out.shape == q.shape
    assert tree_backend.calls["inner"] == before["inner"] + 2 and tree_backend.calls["tree_attn"] == before["tree_attn"]
    warned = [r.getMessage() for r in caplog.records if "runs the inner backend" in r.getMessage()]
    assert len(warned) == 1 and "a logit cap" in warned[0], warned
    for layer, why in ((RadixAttention(4, D, 1.0, 2, 0, sliding_window_size=16), "a sliding window"),
                       (RadixAttention(4, 96, 1.0, 2, 0), "head dims qk=96"),
                       (RadixAttention(4, D, 1.0, 2, 0, v_head_dim=32), "head dims qk=64, v=32")):
        assert why in s.backend._sp_unsupported(q, k, v, layer, {}, s.kv_pool.get_key_buffer(0))
    assert s.backend._sp_unsupported(q, k, v, s.layer, {}, s.kv_pool.get_key_buffer(0)) is None
    fp8 = s.kv_pool.get_key_buffer(0).to(torch.float8_e4m3fn)
    assert "KV cache of torch.float8_e4m3fn" in s.backend._sp_unsupported(q, k, v, s.layer, {}, fp8)
    assert "extra attention inputs ['sinks']" in s.backend._sp_unsupported(q, k, v, s.layer, {"sinks": q}, fp8)
    assert s.backend._sp_unsupported(q, k, v, s.layer, {"sinks": None}, s.kv_pool.get_key_buffer(0)) is None
