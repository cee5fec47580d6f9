"""The draft teacher-forced over a continuation once per refresh time: the rows of a replay table.

Row r of a table is the draft as it decodes after a refresh at history length ``t_r = prompt + r * grid`` (the
refresh grid, ``CacheLayout.refresh_grid``): it keeps the importance positions ``S_r`` that scoring the history up to
``t_r`` selects (per layer and KV head, through ``select_importance``, as ``RiftCache.refresh`` does), and every query
at position i >= t_r sees S_r plus the window band [i - window, i], which is what the decoder's cache shows it
(``RiftLayer.window_mask``). Teacher-forced over the emitted continuation, one pass per row gives, at every later
position, the draft's distribution (hence whether its argmax is the emitted token, or q(x)) and the signals a
controller reads there.

The history before t_r comes from one dense pass (keys, values and the observation queries of positions < t_r as
the full-cache draft computes them). In the decoder they were computed under whatever selection was in force at
their time: that is the table's one approximation (docs/replay.md measures what it costs).

Rows run in groups as one batch (plain tensor code over Llama-family drafts, as ``rift_ada.static``): positions from
the group's first refresh time on; positions before a row's own t_r take the dense pass's keys and values (their
computed ones are discarded), and attention is computed per block of queries over [S_r | band], not over the whole
history, so a row costs what its positions cost, not the context's square.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ..cache import RiftCache
from ..layout import CacheLayout
from ..rounds import entropy, sampling_probs
from ..selection import observation_window, select_importance
from ..signals import RUNWAY_CAP
from ..static import decoder_stack, check_static


@dataclass
class Dense:
    """The draft's dense pass over prompt + continuation: per layer post-RoPE keys and values (1, kv_heads, T, d) and
    queries (1, q_heads, T, d), and the logits at every position (T, vocab)."""

    keys: list
    values: list
    queries: list
    logits: torch.Tensor


@torch.inference_mode()
def dense_pass(draft, ids: torch.Tensor) -> Dense:
    """One full-cache forward over ``ids`` (1, T) recording every layer's keys, values and queries."""
    from ..attention import use_rift_attention

    use_rift_attention(draft)
    n = ids.shape[1]
    cache = RiftCache.for_config(draft.config, CacheLayout("full"), extra_queries=n)
    logits = draft(ids, cache=cache, position_ids=torch.arange(n, device=ids.device)[None], rift_observer=cache,
                   logits_to_keep=0).logits[0]
    layers = cache.rift_layers
    return Dense([x.keys for x in layers], [x.values for x in layers], [x.queries for x in layers], logits.float())


def selections(dense: Dense, starts: list[int], layout: CacheLayout) -> list[torch.Tensor]:
    """Per layer (rows, kv_heads, n_imp) sorted positions: what a refresh scoring the history up to each start keeps
    (candidates before its window, its last ``obs_window`` queries: ``RiftLayer.reselect``)."""
    scorer = layout.make_scorer()
    out = []
    for k, q in zip(dense.keys, dense.queries):
        qpos = torch.arange(q.shape[2], device=q.device)
        out.append(torch.cat([select_importance(scorer, k, t, layout.n_imp, layout.tail_keep,
                                                *observation_window(q[:, :, :t], qpos[:t], layout.obs_window))
                              for t in starts]))
    return out


def _runs(pos: torch.Tensor, cap: int) -> torch.Tensor:
    """Per importance entry: how many of the positions right after it its KV head keeps (capped), as
    ``RiftLayer.read_ahead`` counts (a block never reaches the window in a row: it ends before t_r - window)."""
    n = pos.shape[-1]
    brk = torch.ones_like(pos, dtype=torch.bool)
    brk[..., :-1] = pos[..., 1:] != pos[..., :-1] + 1
    idx = torch.arange(n, device=pos.device)
    end = torch.where(brk, idx, n).flip(-1).cummin(-1).values.flip(-1)
    return (end - idx).clamp(max=cap)


@dataclass
class RowValues:
    """What a group of rows gives, indexed (row, u) with u = query position + 1 - prompt length: the prediction of
    continuation token u and the signals at history length prompt + u (valid where u > row's t - prompt)."""

    q: np.ndarray  # (rows, U) float32: q(x_u) (sampling) or 1.0 / 0.0 for argmax == x_u (greedy)
    entropy: np.ndarray  # (rows, U) float32, nats
    focus: np.ndarray  # (rows, U) float32
    runway: np.ndarray  # (rows, U) float32, tokens (<= RUNWAY_CAP)
    drift: np.ndarray  # (rows, U) float32


class RowPass:
    """Teacher-forced passes of ``draft`` over ``ids`` (prompt + continuation) under groups of rows."""

    def __init__(self, draft, ids: torch.Tensor, prompt_len: int, layout: CacheLayout, dense: Dense,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, block: int = 128):
        check_static(draft)  # Llama-family, every layer full attention, SDPA: the plain tensor code below
        self.draft, self.ids, self.P, self.layout, self.dense = draft, ids, prompt_len, layout, dense
        self.inner, lm_head = decoder_stack(draft)
        self.lm_head = _Linear(lm_head)
        cfg = draft.config
        g = cfg.num_attention_heads // cfg.num_key_value_heads
        self.plans = [_LayerPlan(layer, g, layer.self_attn.head_dim) for layer in self.inner.layers]
        self.T = ids.shape[1]
        self.W, self.obs = layout.tail_keep, layout.obs_window
        self.floor = None
        if layout.tail_limit is None:  # snapkv: nothing evicted, every query sees the prompt's tail and all after it
            self.W, self.floor = self.T - 1 - prompt_len + layout.tail_keep, prompt_len - layout.tail_keep
            if self.W > prompt_len:
                raise ValueError(f"a {layout.kind} row needs a prompt of at least {self.W} tokens (the continuation "
                                 f"plus {layout.tail_keep}), got {prompt_len}")
        self.temperature, self.top_k, self.top_p, self.block = temperature, top_k, top_p, block

    @torch.inference_mode()
    def run(self, starts: list[int], sel: list[torch.Tensor]) -> RowValues:
        """The rows refreshed at ``starts`` (absolute history lengths, ascending), with their selections ``sel``
        (:func:`selections`, per layer (rows, kv_heads, n))."""
        P, T, W, obs = self.P, self.T, self.W, self.obs
        s = starts[0]
        R, Lq = len(starts), T - 1 - s  # queries at positions s .. T - 2
        dev = self.ids.device
        t = torch.tensor(starts, device=dev)
        qpos = torch.arange(s, T - 1, device=dev)
        own = qpos[None] >= t[:, None]  # (R, Lq): positions a row computes itself
        h = self.inner.embed_tokens(self.ids[:, s:T - 1]).expand(R, -1, -1)
        cos, sin = self.inner.rotary_emb(h, qpos[None])
        U = T - P  # u = position + 1 - P in 1 .. T - 1 - P; column u of the outputs
        focus = torch.zeros(R, Lq, device=dev)
        runway = torch.zeros(R, Lq, device=dev)
        drift = torch.zeros(R, Lq, device=dev)
        for li, layer in enumerate(self.inner.layers):
            h, f_l, r_l, cos_l = self._layer(layer, li, h, cos, sin, s, t, own, sel[li])
            better = (f_l > focus) | ((f_l == focus) & (r_l > runway))  # max over layers of (focus, runway)
            focus, runway = torch.where(better, f_l, focus), torch.where(better, r_l, runway)
            drift += cos_l
        drift = 1.0 - drift / len(self.inner.layers)
        logits = self.lm_head(self.inner.norm(h)).float()  # (R, Lq, V): query s + j predicts token s + j + 1
        x = self.ids[0, s + 1:T]
        probs = sampling_probs(logits, self.temperature, self.top_k, self.top_p)
        if probs is None:
            acc = (logits.argmax(-1) == x).float()
        else:
            acc = probs.gather(-1, x[None, :, None].expand(R, -1, 1))[..., 0]
        ent = entropy(logits)
        out = []
        for v in (acc, ent, focus, runway, drift):
            full = torch.full((R, U), float("nan"), device=dev)
            full[:, s + 1 - P:] = v
            full[~torch.cat([torch.zeros(R, s + 1 - P, dtype=torch.bool, device=dev), own], 1)] = float("nan")
            out.append(full.cpu().numpy())
        return RowValues(*out)

    def _layer(self, layer, li, h, cos, sin, s, t, own, sel):
        """One decoder layer for the group; returns (h, focus, runway, summed drift cosine) per (row, query)."""
        d, plan, attn = self.dense, self.plans[li], layer.self_attn
        R, Lq, _ = h.shape
        T, W = self.T, self.W
        n = sel.shape[-1]
        runs = _runs(sel, RUNWAY_CAP).float()  # (R, kv_heads, n)
        if len(plan.kv) == 0:  # every query zero: uniform attention, writes nothing (read_ahead's view of it)
            uniform = torch.full((R, Lq), 1.0 / (n + W), device=h.device)
            return plan.mlp(h, layer.post_attention_layernorm(h)), uniform, runs[:, :1, 0].expand(R, Lq), 0.0
        x = layer.input_layernorm(h)
        hd = attn.head_dim
        q = plan.q(x).view(R, Lq, -1, hd)
        k = plan.k(x).view(R, Lq, -1, hd)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm per head before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        v = plan.v(x).view(R, Lq, -1, hd).transpose(1, 2)
        kv, heads = plan.kv, plan.heads
        dk, dv, dq = d.keys[li][:, kv], d.values[li][:, kv], d.queries[li][:, heads]
        m = own[:, None, :, None]
        k = torch.where(m, k, dk[:, :, s:T - 1])  # before its refresh a row holds the dense history
        v = torch.where(m, v, dv[:, :, s:T - 1])
        q_obs = torch.where(m, q, dq[:, :, s:T - 1])
        band_k = torch.cat([dk[:, :, s - W:s].expand(R, -1, -1, -1), k], 2)  # positions s - W .. T - 2
        band_v = torch.cat([dv[:, :, s - W:s].expand(R, -1, -1, -1), v], 2)
        idx = sel[:, kv, :, None].expand(-1, -1, -1, hd)
        imp_k = dk[0].expand(R, -1, -1, -1).gather(2, idx)
        imp_v = dv[0].expand(R, -1, -1, -1).gather(2, idx)
        runs = runs[:, kv]
        hkv = len(kv)
        g = len(heads) // hkv
        out = torch.empty_like(q)
        focus = torch.empty(R, Lq, device=h.device)
        runway = torch.empty(R, Lq, device=h.device)
        B = self.block
        qi = torch.arange(B, device=h.device)[:, None]
        c = torch.arange(B + W, device=h.device)[None]
        band_ok = ((c >= qi) & (c <= qi + W)).repeat(g, 1)  # query (j, qi) sees band column c: position i - W + c - qi
        for b0 in range(0, Lq, B):
            nb = min(B, Lq - b0)
            qb = q[:, :, b0:b0 + nb].reshape(R, hkv, g * nb, hd) * attn.scaling  # query heads kv * g + j
            # softmax over [importance | band] without concatenating the keys: one max, two exp-sums
            s_imp = qb @ imp_k.transpose(-1, -2)  # (R, hkv, g * nb, n)
            s_band = qb @ band_k[:, :, b0:b0 + nb + W].transpose(-1, -2)  # (R, hkv, g * nb, nb + W)
            ok = band_ok if nb == B else ((c[:, :nb + W] >= qi[:nb]) & (c[:, :nb + W] <= qi[:nb] + W)).repeat(g, 1)
            if self.floor is not None:  # band column c is position s + b0 - W + c
                ok = ok & (c[:, :nb + W] >= self.floor - s - b0 + W)
            s_band.masked_fill_(~ok, float("-inf"))
            top_s, j = s_imp.max(-1)
            mx = torch.maximum(top_s, s_band.amax(-1))
            e_imp, e_band = (s_imp - mx[..., None]).exp_(), (s_band - mx[..., None]).exp_()
            z = e_imp.sum(-1) + e_band.sum(-1)  # (R, hkv, g * nb)
            o = (e_imp @ imp_v + e_band @ band_v[:, :, b0:b0 + nb + W]) / z[..., None]
            out[:, :, b0:b0 + nb] = o.view(R, hkv * g, nb, hd)
            # Read-ahead (RiftCache.read_ahead after the round): the newest query over the cache once its window
            # has slid, i.e. without the band's oldest entry (position i - window), then the sharpest head.
            oldest = e_band.view(R, hkv, g, nb, -1).diagonal(dim1=-2, dim2=-1).reshape(R, hkv, g * nb)
            top = (top_s - mx).exp_() / (z - oldest).clamp_min(1e-30)
            flat = top.view(R, hkv, g, nb).permute(0, 3, 1, 2).reshape(R, nb, hkv * g)  # heads as read_ahead orders
            best = flat.argmax(-1)
            focus[:, b0:b0 + nb] = flat.gather(-1, best[..., None])[..., 0]
            jb = j.view(R, hkv, g, nb).permute(0, 3, 1, 2).reshape(R, nb, hkv * g).gather(-1, best[..., None])[..., 0]
            runway[:, b0:b0 + nb] = _pick(runs, best // g, jb)
        h = plan.o.add_to(h, out.transpose(1, 2).reshape(R, Lq, -1))
        h = plan.mlp(h, layer.post_attention_layernorm(h))
        return h, focus, runway, self._drift_cos(li, q_obs, dq, s, t)

    def _drift_cos(self, li, q_obs, dq, s, t):
        """(R, Lq): per history length L = s + 1 .. T - 1, the cosine between the mean of the last ``obs_window``
        queries before L and the mean the row's selection was scored with, summed over the computed heads (the
        others have zero queries: cosine 0), divided by all heads (``RiftCache.query_drift`` averages over heads)."""
        obs = self.obs
        R, _, Lq, _ = q_obs.shape
        qx = torch.cat([dq[:, :, s - obs:s].expand(R, -1, -1, -1), q_obs], 2)
        c = torch.nn.functional.pad(qx.cumsum(2), (0, 0, 1, 0))
        win = c[:, :, obs + 1:obs + 1 + Lq] - c[:, :, 1:1 + Lq]  # sum over the window ending at position s + j
        ref = torch.stack([dq[0, :, int(x) - obs:int(x)].float().mean(1) for x in t])
        ref = torch.nn.functional.normalize(ref, dim=-1)[:, :, None]  # (R, heads, 1, d)
        # normalize(mean) . ref, with F.normalize's floor on the norm (an all-zero head has cosine 0)
        dot = (win * ref).sum(-1)
        norm = win.norm(dim=-1).clamp_min(1e-12 * obs)
        return (dot / norm).sum(1) / self.plans[li].hq


def _nonzero(x: torch.Tensor, dim: int) -> torch.Tensor:
    return (x != 0).any(dim)


class _Linear:
    """``x[..., cols] @ W[rows, cols].T + b[rows]``: the part of a linear layer that is not structurally zero (the
    outputs ``rows`` it can write, the inputs ``cols`` it reads). Exactly the layer's numbers on that part; a dense
    pretrained model keeps every row and column, the composed testbed's hand-set weights are mostly zero blocks."""

    def __init__(self, linear, rows: torch.Tensor | None = None):
        w, b = linear.weight.detach(), linear.bias
        rows = torch.arange(w.shape[0], device=w.device) if rows is None else rows
        w = w[rows]
        cols = _nonzero(w, 0).nonzero()[:, 0]
        self.cols = None if len(cols) == w.shape[1] else cols
        self.w = (w if self.cols is None else w[:, cols]).t().contiguous()
        self.b = None if b is None else b.detach()[rows]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = (x if self.cols is None else x.index_select(-1, self.cols)) @ self.w
        return y if self.b is None else y + self.b


class _Writer:
    """A linear layer that adds into the residual stream only the dimensions it can write (its nonzero rows)."""

    def __init__(self, linear, cols: torch.Tensor):
        w = linear.weight.detach()[:, cols]
        b = linear.bias
        rows = _nonzero(w, 1) | (False if b is None else b.detach() != 0)
        self.rows = rows.nonzero()[:, 0]
        self.linear = _Linear(_Slice(w, b), self.rows)

    def add_to(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if len(self.rows) == 0:
            return h
        return h.index_add(-1, self.rows, self.linear(x))


class _Slice:
    """A weight and bias standing in for a linear layer."""

    def __init__(self, weight, bias):
        self.weight, self.bias = weight, bias


class _LayerPlan:
    """What a decoder layer computes for the rows: the query heads that matter (those whose queries or outputs are
    not structurally zero, with the rest of their KV group), their KV heads, and the MLP units that can be nonzero.
    A head left out has zero queries (uniform attention, cosine 0 in the drift) and writes nothing."""

    def __init__(self, layer, g: int, head_dim: int):
        attn = layer.self_attn
        hq = attn.q_proj.weight.shape[0] // head_dim
        q_live = _nonzero(attn.q_proj.weight.detach().view(hq, head_dim, -1), -1).any(-1)
        if attn.q_proj.bias is not None:
            q_live |= _nonzero(attn.q_proj.bias.detach().view(hq, head_dim), -1)
        q_live |= _nonzero(attn.o_proj.weight.detach().view(-1, hq, head_dim), -1).any(0)
        self.kv = q_live.view(-1, g).any(-1).nonzero()[:, 0]  # KV groups with a head that matters
        self.heads = (self.kv[:, None] * g + torch.arange(g, device=self.kv.device)).reshape(-1)
        self.hq = hq

        def rows(heads):
            return (heads[:, None] * head_dim + torch.arange(head_dim, device=heads.device)).reshape(-1)

        self.q = _Linear(attn.q_proj, rows(self.heads))
        self.k = _Linear(attn.k_proj, rows(self.kv))
        self.v = _Linear(attn.v_proj, rows(self.kv))
        self.o = _Writer(attn.o_proj, rows(self.heads))
        mlp = layer.mlp
        units = _nonzero(mlp.up_proj.weight.detach(), 1) & _nonzero(mlp.down_proj.weight.detach(), 0)
        zero = mlp.act_fn(torch.zeros(1, dtype=mlp.gate_proj.weight.dtype, device=units.device))
        if float(zero) == 0.0 and mlp.gate_proj.bias is None:  # act(0) = 0: a zero gate row contributes nothing
            units &= _nonzero(mlp.gate_proj.weight.detach(), 1)
        if mlp.up_proj.bias is not None:
            units |= mlp.up_proj.bias.detach() != 0
        units = units.nonzero()[:, 0]
        self.gate, self.up = _Linear(mlp.gate_proj, units), _Linear(mlp.up_proj, units)
        self.down = _Writer(mlp.down_proj, units)
        self.act = mlp.act_fn

    def mlp(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.down.add_to(h, self.act(self.gate(x)) * self.up(x))


def _pick(runs: torch.Tensor, kv: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """runs (R, kv_heads, n) at (row, kv[row, b], j[row, b]) -> (R, B)."""
    R, hkv, n = runs.shape
    flat = runs.reshape(R, hkv * n)
    return flat.gather(1, kv * n + j)
