"""Experimental: a hand-set copying circuit composed with a trained language model into one ordinary HF Llama.

Not used by the shipped testbed. Why it exists: the testbed v2 models learn Python from data (stage 8: code top-1
0.66 for the target) and induction heads form in them, but a 4-layer model copies by matching the last token or two,
so greedy copying derails at the first line that occurs twice in the prompt (greedy copy 0.11 at 2K after 40 minutes
of copy-only training; ../shared/notes/TESTBED.md). A large pretrained LM matches on a long context; this circuit
is a disclosed stand-in for that. ``python experiments/circuit_probe.py`` measures it.

What ``compose`` builds, from a trained Llama ``lm`` with tied embeddings (hidden h, head_dim d, nq / nkv heads):

- a Llama of hidden ``h + C`` (untied) and head_dim ``2d``, with at least 3 layers; its first ``h`` residual dims
  and first ``nq`` heads *are* the trained model (weights copied, query/key dims of rotary pair f moved to pair f of
  the wider head, queries scaled by sqrt(2) for the wider head's 1/sqrt(head_dim)); with ``boost=0`` its logits
  equal ``lm``'s up to the circuit's share of each RMSNorm (tested);
- rotary frequencies via ``longrope`` per-pair factors: pairs 0..d/2-1 turn exactly as in ``lm``; pairs d/2..d-1 do
  not turn, so the match head compares content at any distance;
- the circuit lives in the other ``C`` residual dims and extra heads, which the trained weights never read:
  * layer 0: positional heads (rotary kernels fitted below) write the match codes of x_{t-1} .. x_{t-exact} and
    rarity-weighted averages over windows of offsets into slots; its MLP computes each key window's squared norm;
  * layer 1: the match head scores key j by [x_t .. x_{t-exact+1}] . [x_{j-1} .. x_{j-exact}] (exact slots) and
    -|query window - key window|^2 / 2 (the query's windows sit one token nearer, so a true match aligns them), and
    fetches x_j's output code; a twin head (same query and keys) fetches key j's context; the MLP scores how well
    that context agrees with the query's (SiLU(K + x) y - SiLU(K) y = x y: one product per neuron);
  * layer 2's MLP passes the fetched code in proportion to that agreement (0 below ``gate[0]``, 1 above
    ``gate[1]``), and the unembedding turns it into a bonus of about ``boost`` logits for the copied token. Novel
    code rarely has a long match, so the trained model's predictions stand there.

Why each piece (each was measured without it on 12 held-out 2K prompts, teacher-forced copy errors; greedy copying
needs about 1 in 1,000, since one slip shifts every later position): a dot product of window averages favours
windows with more repeats of the query's tokens (1.2% errors; with the distance: 0.46%); two exact slots cannot
place a key inside a run of newlines (four: 0.26%; 0 in the final form); misaligned windows make the
query's own position the best key; unweighted windows match any indentation-heavy context; one wide window cannot
tell a key inside a periodic run ("int, int, int,") from the true source (4K greedy copy 0.87 -> 1.00 with three);
without the gate a bonus large enough to beat the trained prior (wrong by up to 11 logits beyond its 2K training
context) turns spurious matches into errors on novel code.

Each token's circuit entries in the embedding scale with the RMS of its trained embedding, so layer 0 reads them at
exactly unit norm (the positional kernels need it); later reads vary with the trained residual's RMS (about 10%).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

FROZEN = 1e30  # longrope factor that stops a rotary pair from turning (inverse frequency ~1e-35)


@dataclass(frozen=True)
class CopyCircuit:
    exact: int = 4  # previous tokens matched one by one (offsets 1..exact at the key)
    windows: tuple = ((4, 8), (8, 16), (16, 40))  # key offsets averaged into one slot each: longer, order-free
    # contexts (narrow ones near the query tell a key inside a periodic run, "int, int, int,", from the true source)
    match_dim: int = 9  # dims of a token's random match code (per slot)
    out_dim: int = 64  # dims of a token's random output code
    scale: float = 0.05  # norm of each circuit vector over the mean norm of a trained embedding row (small: the
    # trained layers' RMSNorms barely see the circuit)
    sharpness: float = 12.0  # match logit per fully matched slot
    window_weight: float = 1.5
    boost: float = 16.0  # logit bonus for the copied token when the gate is open (the trained model is wrong by up
    # to ~11 logits on copies beyond its 2K training context)
    gate: tuple = (0.4, 0.65)  # agreement at which the copied code starts to pass, and passes fully
    gate_windows: float = 0.5  # weight of the windows' squared distance, subtracted from the agreement
    gate_k: float = 20.0  # the constant that puts SiLU in its linear range, where it multiplies

    def slots(self) -> int:
        """Slots the match head compares."""
        return self.exact + len(self.windows)


@functools.lru_cache(maxsize=64)  # every compose with the same rotary base and offsets fits the same kernels
def _positional_kernel(omegas: tuple, lo: int, hi: int) -> torch.Tensor:
    return _fit_positional_kernel(list(omegas), _offset_target(lo, hi))


def _fit_positional_kernel(omegas: list[float], target, t_max: int = 8192, steps: int = 600) -> torch.Tensor:
    """Query (a_f, b_f) per rotary pair so that, with a constant key (1, 0), the head's attention over distance
    D = t - j, softmax_D(sum_f a_f cos(D w_f) - b_f sin(D w_f)), matches ``target(t)`` for query positions t
    from 0 to t_max. Linear in (a, b): a small convex fit."""
    w = torch.tensor(omegas, dtype=torch.float64)
    d = torch.arange(t_max, dtype=torch.float64)
    cos, sin = torch.cos(d[:, None] * w), torch.sin(d[:, None] * w)
    ts = sorted(set(range(0, 64)) | {96, 128, 200, 300, 512, 777, 1024, 1500, 2048, 3000, 4096, 6000, t_max - 1})
    targets = [(t, target(t)) for t in ts]
    targets = [(t, p) for t, p in targets if p is not None]
    n = len(omegas)
    with torch.enable_grad():
        p = torch.zeros(2 * n, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.Adam([p], lr=0.5)
        for _ in range(steps):
            s = cos @ p[:n] - sin @ p[n:]
            loss = sum(-(tg * torch.log_softmax(s[:t + 1], 0)).sum() for t, tg in targets)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return p.detach().float()


def _offset_target(lo: int, hi: int):
    def target(t):
        if t < hi:
            return None
        v = torch.zeros(t + 1, dtype=torch.float64)
        v[lo:hi + 1] = 1 / (hi - lo + 1)
        return v
    return target


@torch.no_grad()
def _mean_rms(lm, calibration: list[list[int]]) -> tuple[list[float], list[float], float]:
    """Mean RMS over positions of the residual entering each layer, entering each layer's MLP, and entering the
    final norm of ``lm``."""
    layers = lm.model.layers
    norms = [layer.input_layernorm for layer in layers] + [layer.post_attention_layernorm for layer in layers]
    norms.append(lm.model.norm)
    sums = [0.0] * len(norms)
    count = 0
    hooks = [n.register_forward_pre_hook(lambda mod, args, k=k: sums.__setitem__(
        k, sums[k] + args[0].float().pow(2).mean(-1).sqrt().sum().item())) for k, n in enumerate(norms)]
    try:
        for ids in calibration:
            lm(torch.tensor([ids], device=lm.device))
            count += len(ids)
    finally:
        for h in hooks:
            h.remove()
    rms = [x / count for x in sums]
    return rms[:len(layers)], rms[len(layers):2 * len(layers)], rms[-1]


@torch.no_grad()
def compose(lm, circuit: CopyCircuit, calibration: list[list[int]], seed: int = 0):
    """The trained Llama ``lm`` with ``circuit`` beside it, as one ``LlamaForCausalLM`` (float32, eval mode).
    ``calibration``: token lists of plain text, for the trained residual's mean RMS and the tokens' rarity."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = lm.config
    h, d, nq, nkv, n_layers = (cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
                               cfg.num_hidden_layers)
    if cfg.model_type != "llama" or not cfg.tie_word_embeddings:
        raise ValueError("compose needs a Llama with tied embeddings")
    md, od, ex, nw = circuit.match_dim, circuit.out_dim, circuit.exact, len(circuit.windows)
    if ex < 1 or any(not 2 <= lo <= hi for lo, hi in circuit.windows):
        raise ValueError("exact must be >= 1 and each window (lo, hi) must have 2 <= lo <= hi")
    hd = 2 * d
    if circuit.slots() * md > d:
        raise ValueError(f"{circuit.slots()} slots x {md} dims exceed the {d} non-turning head dims")
    if od > hd:
        raise ValueError(f"out_dim {od} exceeds head_dim {hd}")
    lo_gate, hi_gate = circuit.gate
    if not lo_gate < hi_gate:
        raise ValueError("gate must be (lo, hi) with lo < hi")
    group = nq // nkv
    # Layer 0's positional heads: exact offsets, then key windows, then query windows (one token nearer). Exact and
    # window heads read different codes, so they sit in different KV heads.
    ex_kv, win_kv = -(-ex // group), -(-2 * nw // group)
    ckv = max(2, ex_kv + win_kv)  # layer 1 needs two: the match head and its twin
    cq = ckv * group
    offsets = [(k, k) for k in range(1, ex + 1)] + [tuple(w) for w in circuit.windows] + \
        [(lo - 1, hi - 1) for lo, hi in circuit.windows]
    pos_heads = list(range(ex)) + [ex_kv * group + k for k in range(2 * nw)]  # circuit q-head index of each slot
    a = circuit.scale * lm.model.embed_tokens.weight.float().norm(dim=1).mean().item()
    theta = cfg.rope_parameters["rope_theta"]
    # Residual layout of the circuit: [const | match code | window code | stored output code s | copied output code
    # u | slots | key windows' squared norm | fetched key context | agreement | gated copied code]
    CONST, M = h, h + 1
    WIN = M + md
    S = WIN + md
    U = S + od
    slot = [U + od + k * md for k in range(len(offsets))]
    NSQ = slot[-1] + md
    CBAR = NSQ + 1
    G = CBAR + circuit.slots() * md
    V = G + 1
    used = V + od
    H = -(-used // (nq + cq)) * (nq + cq)  # Llama's config wants a multiple of the head count; the rest stays 0
    extra = max(circuit.slots() * md + 1, 2 * od)  # MLP neurons of the circuit (agreement, gate, window norms)
    out_layers = max(n_layers, 3)

    factors = [theta ** (g / d) for g in range(d // 2)] + [FROZEN] * (d // 2)
    new_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=H, intermediate_size=cfg.intermediate_size + extra,
        num_hidden_layers=out_layers, num_attention_heads=nq + cq, num_key_value_heads=nkv + ckv, head_dim=hd,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={"rope_type": "longrope", "rope_theta": theta, "short_factor": factors,
                         "long_factor": factors, "original_max_position_embeddings": cfg.max_position_embeddings,
                         "factor": 1.0, "attention_factor": 1.0},
        # Untied: the input embedding stores a token's output code where only the match head's values read it,
        # and the unembedding reads the copied code from elsewhere, so a token never boosts itself.
        tie_word_embeddings=False, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id, attention_bias=False,
    )
    model = LlamaForCausalLM(new_cfg).to(lm.device)
    for p in model.parameters():
        p.zero_()

    # --- the trained model, copied --------------------------------------------------------------------------------
    rms_in, rms_mlp, rms_final = _mean_rms(lm, calibration)
    # Layers added for the circuit pass the trained residual through unchanged.
    rms_in += [rms_final] * (out_layers - n_layers)
    rms_mlp += [rms_final] * (out_layers - n_layers)
    shrink = math.sqrt(h / H)  # RMS over H dims of a vector that lives in the first h
    half, new_half = d // 2, hd // 2
    head_dims = torch.tensor([f if f < half else f - half + new_half for f in range(d)])

    def rows(head: int, dims) -> torch.Tensor:
        return head * hd + dims

    emb_lm = lm.model.embed_tokens.weight
    model.model.embed_tokens.weight[:, :h] = emb_lm
    model.lm_head.weight[:, :h] = emb_lm
    n_mlp = cfg.intermediate_size
    for src, dst in zip(lm.model.layers, model.model.layers):
        sa, da = src.self_attn, dst.self_attn
        for i in range(nq):
            da.q_proj.weight[rows(i, head_dims), :h] = sa.q_proj.weight[i * d:(i + 1) * d] * math.sqrt(hd / d)
            da.o_proj.weight[:h, rows(i, torch.arange(d))] = sa.o_proj.weight[:, i * d:(i + 1) * d]
        for j in range(nkv):
            da.k_proj.weight[rows(j, head_dims), :h] = sa.k_proj.weight[j * d:(j + 1) * d]
            da.v_proj.weight[rows(j, torch.arange(d)), :h] = sa.v_proj.weight[j * d:(j + 1) * d]
        for name in ("gate_proj", "up_proj"):
            getattr(dst.mlp, name).weight[:n_mlp, :h] = getattr(src.mlp, name).weight
        dst.mlp.down_proj.weight[:h, :n_mlp] = src.mlp.down_proj.weight
        dst.input_layernorm.weight[:h] = src.input_layernorm.weight * shrink
        dst.post_attention_layernorm.weight[:h] = src.post_attention_layernorm.weight * shrink
    for li, dst in enumerate(model.model.layers):
        # The circuit reads its unit vectors (stored at norm `a`) back at unit norm.
        dst.input_layernorm.weight[h:] = rms_in[li] * shrink / a
        dst.post_attention_layernorm.weight[h:] = rms_mlp[li] * shrink / a
    model.model.norm.weight[:h] = lm.model.norm.weight * shrink

    # --- the circuit ------------------------------------------------------------------------------------------------
    g = torch.Generator().manual_seed(seed)
    m_code = torch.randn(cfg.vocab_size, md, generator=g)
    u_code = torch.randn(cfg.vocab_size, od, generator=g)
    m_code, u_code = m_code / m_code.norm(dim=1, keepdim=True), u_code / u_code.norm(dim=1, keepdim=True)
    # Window code: the match code weighted by rarity (log inverse frequency in the calibration text, mean square 1
    # over its tokens); unweighted, a window of indentation and punctuation matches any other such window.
    counts = torch.bincount(torch.tensor([i for ids in calibration for i in ids]), minlength=cfg.vocab_size)
    idf = torch.log((counts.sum() + 1) / (counts + 1).float())
    idf = idf / ((idf ** 2 * counts).sum() / counts.sum()).sqrt()
    # Each token's circuit entries scale with the RMS of its trained embedding, so layer 0 reads them back at
    # exactly unit norm (the positional heads' rotary kernels need that precision).
    tok_rms = emb_lm.float().pow(2).mean(-1).sqrt()[:, None] / rms_in[0]
    emb = model.model.embed_tokens.weight
    emb[:, CONST] = a * tok_rms[:, 0]
    emb[:, M:M + md] = a * tok_rms * m_code
    emb[:, WIN:WIN + md] = a * tok_rms * idf[:, None] * m_code
    emb[:, S:S + od] = a * tok_rms * u_code

    omegas = [theta ** (-2 * f / d) for f in range(half)]
    free = list(range(half, new_half)) + list(range(half + new_half, hd))  # non-turning dims of the wider head
    K = circuit.gate_k
    md_ = torch.arange(md)

    # Layer 0: positional heads write the codes at each offset (window) into slots.
    attn = model.model.layers[0].self_attn
    for s, ((lo, hi), qh) in enumerate(zip(offsets, pos_heads)):
        q_head, kv_head = nq + qh, nkv + qh // group
        ab = _positional_kernel(tuple(omegas), lo, hi)  # cached: only read below
        attn.q_proj.weight[rows(q_head, torch.arange(half)), CONST] = ab[:half] * math.sqrt(hd)
        attn.q_proj.weight[rows(q_head, torch.arange(half) + new_half), CONST] = ab[half:] * math.sqrt(hd)
        attn.k_proj.weight[rows(kv_head, torch.arange(half)), CONST] = 1.0
        attn.v_proj.weight[rows(kv_head, md_), (M if s < ex else WIN) + md_] = 1.0
        attn.o_proj.weight[slot[s] + md_, rows(q_head, md_)] = a * math.sqrt(hi - lo + 1)
    k_src = slot[:ex + nw]  # the key's context: x_{j-1} .. x_{j-exact}, windows
    q_src = [M] + slot[:ex - 1] + slot[ex + nw:]  # the query's: x_t .. x_{t-exact+1}, windows one token nearer
    weights = [1.0] * ex + [circuit.window_weight] * nw

    def products(mlp, terms, out: int, unit: float) -> None:
        """Circuit MLP neurons: residual[out] += unit * sum of (gate . x)(up . x) over ``terms`` (pairs of
        {column: weight}), each as SiLU(K + gate . x)(up . x), less K (sum of up . x) in one shared neuron."""
        cancel = n_mlp + len(terms)
        for n, (gate, up) in enumerate(terms, start=n_mlp):
            mlp.gate_proj.weight[n, CONST] = K
            for col, w in gate.items():
                mlp.gate_proj.weight[n, col] = w
            for col, w in up.items():
                mlp.up_proj.weight[n, col] = w
                mlp.up_proj.weight[cancel, col] -= w
        mlp.gate_proj.weight[cancel, CONST] = K
        mlp.down_proj.weight[out, n_mlp:cancel + 1] = unit

    # Layer 0's MLP: NSQ = window_weight x sum over key windows of |window|^2, stored at 1/nsq_shrink of the
    # circuit's unit (it runs to ~3 units; the trained layers' RMSNorms should barely see the circuit).
    nsq_shrink = 4.0
    products(model.model.layers[0].mlp, [({col: 1.0}, {col: circuit.window_weight})
                                         for s in range(ex, ex + nw) for col in range(slot[s], slot[s] + md)],
             NSQ, a / nsq_shrink)

    # Layer 1: the match head and its twin (same query and keys, so the same attention).
    attn = model.model.layers[1].self_attn
    match_q, match_kv = nq, nkv
    twin_q, twin_kv = nq + group, nkv + 1
    for s in range(circuit.slots()):
        dims = torch.tensor(free[s * md:(s + 1) * md])
        attn.q_proj.weight[rows(match_q, dims), q_src[s] + md_] = circuit.sharpness * weights[s] * math.sqrt(hd)
        attn.k_proj.weight[rows(match_kv, dims), k_src[s] + md_] = 1.0
    # -|key windows|^2 / 2 (with q . k above: -|q - k|^2 / 2 up to a per-query constant) rides on the slowest
    # turning pair but one (< 0.04 rad over 8K tokens).
    slow = torch.tensor([half - 2])
    attn.q_proj.weight[rows(match_q, slow), CONST] = -0.5 * circuit.sharpness * math.sqrt(hd)
    attn.k_proj.weight[rows(match_kv, slow), NSQ] = nsq_shrink
    attn.q_proj.weight[rows(twin_q, torch.arange(hd))] = attn.q_proj.weight[rows(match_q, torch.arange(hd))]
    attn.k_proj.weight[rows(twin_kv, torch.arange(hd))] = attn.k_proj.weight[rows(match_kv, torch.arange(hd))]
    attn.v_proj.weight[rows(match_kv, torch.arange(od)), S + torch.arange(od)] = 1.0
    attn.o_proj.weight[U + torch.arange(od), rows(match_q, torch.arange(od))] = a
    for s in range(circuit.slots()):
        dims = s * md + md_
        attn.v_proj.weight[rows(twin_kv, dims), k_src[s] + md_] = 1.0
        attn.o_proj.weight[CBAR + dims, rows(twin_q, dims)] = a

    # Layer 1's MLP: agreement G = mean over exact slots of query . fetched - gate_windows x sum over windows of
    # |query - fetched|^2. A spurious short match (common in code) has the exact slots but not the windows.
    terms = [({q_src[s] + i: 1.0}, {CBAR + s * md + i: 1.0 / ex}) for s in range(ex) for i in range(md)]
    for s in range(ex, ex + nw):
        for i in range(md):
            diff = {q_src[s] + i: 1.0, CBAR + s * md + i: -1.0}
            terms.append((diff, {c: -circuit.gate_windows * w for c, w in diff.items()}))
    products(model.model.layers[1].mlp, terms, G, a)

    # Layer 2's MLP: v = clamp((G - lo) / (hi - lo), 0, 1) x u, as SiLU(c (G - lo)) - SiLU(c (G - hi)) times u.
    slope = 4.0 / (hi_gate - lo_gate)  # SiLU bends over about 4 units; beyond, the difference saturates
    mlp = model.model.layers[2].mlp
    for i in range(od):
        for n, edge, sign in ((n_mlp + 2 * i, lo_gate, 1.0), (n_mlp + 2 * i + 1, hi_gate, -1.0)):
            mlp.gate_proj.weight[n, G] = slope
            mlp.gate_proj.weight[n, CONST] = -slope * edge
            mlp.up_proj.weight[n, U + i] = sign
            mlp.down_proj.weight[V + i, n] = a / (slope * (hi_gate - lo_gate))
    # Unembedding: the gated code (norm ~`scale`) against each token's code (norm `scale`) -> ~boost.
    model.lm_head.weight[:, V:V + od] = a * u_code
    model.model.norm.weight[V:V + od] = circuit.boost * rms_final * shrink / (a * a)
    model.eval()
    return model


__all__ = ["CopyCircuit", "compose"]
