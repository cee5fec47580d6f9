"""Experimental: a hand-set copying circuit composed with a trained language model into one ordinary HF Llama.

Not used by the shipped testbed. Why it exists: the testbed v2 models learn Python from data (stage 8: code top-1
0.66 for the target) and induction heads form in them, but a 4-layer model copies by matching the last token or two,
so greedy copying derails at the first line that occurs twice in the prompt (greedy copy 0.11 at 2K after 40 minutes
of copy-only training; ../shared/notes/TESTBED.md). A large pretrained LM matches on a long context; this circuit
is a disclosed stand-in for that. Measured by ``python experiments/circuit_probe.py`` (12 held-out 2K ``low``
prompts, 128 greedy tokens, stage-8 target): greedy copy 0.21 -> 0.60, code top-1 0.648 -> 0.623, NLL 1.61 -> 1.82,
parameters 3.4M -> 11.1M. The 0.90 copy bar is not met. What limits it: without a long match the head must attend
somewhere; its fallback (the query's own position, ``self_weight``) also outscores a genuine match right after a
wrong token, so greedy copying does not resynchronise, and a stronger ``boost`` turns spurious matches into errors.

What ``compose`` builds, from a trained Llama ``lm`` with tied embeddings (hidden h, head_dim d, nq / nkv heads):

- a Llama of hidden ``h + C`` (untied) and head_dim ``2d``; its first ``h`` residual dims and first ``nq`` heads
  *are* the trained model (weights copied, query/key dims of rotary pair f moved to pair f of the wider head, queries
  scaled by sqrt(2) for the wider head's 1/sqrt(head_dim)); with ``boost=0`` its logits equal ``lm``'s up to the
  circuit's share of each RMSNorm (tested);
- rotary frequencies via ``longrope`` per-pair factors: pairs 0..d/2-1 turn exactly as in ``lm``; pairs d/2..d-1 do
  not turn, so the circuit's match head compares content at any distance;
- the circuit lives in the other ``C`` residual dims and two extra KV heads per layer: layer 0's heads are positional
  (offset 1, 2, ... or an even window of offsets; rotary kernels fitted below) and write the match code of the
  tokens there into slots; layer 1's match head compares [x_t, x_{t-1}, windows at t] with [x_{j-1}, x_{j-2},
  windows at j] and copies x_j's output code, which the unembedding turns into a bonus of about ``boost`` logits.
  The trained heads and MLPs never read the circuit's dims and the circuit never reads theirs.

Each token's circuit entries in the embedding scale with the RMS of its trained embedding, so layer 0 reads them at
exactly unit norm (the positional kernels need it); later reads vary with the trained residual's RMS (about 8%).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FROZEN = 1e30  # longrope factor that stops a rotary pair from turning (inverse frequency ~1e-35)


@dataclass(frozen=True)
class CopyCircuit:
    exact: int = 2  # previous tokens matched one by one (offsets 1..exact at the key)
    windows: tuple = ((2, 10), (10, 40))  # offsets averaged into one slot each: a longer, order-free context
    match_dim: int = 16  # dims of a token's random match code (per slot)
    out_dim: int = 64  # dims of a token's random output code
    scale: float = 0.05  # norm of each circuit vector over the mean norm of a trained embedding row (small: the
    # trained layers' RMSNorms barely see the circuit)
    sharpness: float = 12.0  # match logit per fully matched slot
    window_weight: float = 1.5
    boost: float = 5.0  # logit bonus for the copied token when the match is sharp
    self_weight: float = 0.5  # match logit (x sharpness) a query gives its own position: the fallback key

    def slots(self) -> int:
        return self.exact + len(self.windows)


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
def _mean_rms(lm, calibration: list[list[int]]) -> list[float]:
    """Mean RMS over positions of the residual entering each layer and the final norm of ``lm``."""
    norms = [layer.input_layernorm for layer in lm.model.layers] + [lm.model.norm]
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
    return [s / count for s in sums]


@torch.no_grad()
def compose(lm, circuit: CopyCircuit, calibration: list[list[int]], seed: int = 0):
    """The trained Llama ``lm`` with ``circuit`` beside it, as one ``LlamaForCausalLM`` (float32, eval mode)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = lm.config
    h, d, nq, nkv, n_layers = (cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
                               cfg.num_hidden_layers)
    if cfg.model_type != "llama" or not cfg.tie_word_embeddings:
        raise ValueError("compose needs a Llama with tied embeddings")
    if n_layers < 2:
        raise ValueError("the circuit needs at least 2 layers (positional heads, then the match head)")
    group = nq // nkv
    cq = 2 * group  # circuit query heads per layer: two KV heads' worth
    if circuit.slots() > cq:
        raise ValueError(f"{circuit.slots()} positional heads do not fit in layer 0's {cq} circuit heads")
    md, od = circuit.match_dim, circuit.out_dim
    a = circuit.scale * lm.model.embed_tokens.weight.float().norm(dim=1).mean().item()
    hd = 2 * d
    if circuit.slots() * md > d:
        raise ValueError(f"{circuit.slots()} slots x {md} dims exceed the {d} non-turning head dims")
    if od > hd:
        raise ValueError(f"out_dim {od} exceeds head_dim {hd}")
    theta = cfg.rope_parameters["rope_theta"]
    # Residual layout of the circuit: [const | match code m | stored output code s | copied output code u | slots]
    CONST, M = h, h + 1
    S = M + md
    U = S + od
    slot = [U + od + k * md for k in range(circuit.slots())]
    used = U + od + circuit.slots() * md
    H = -(-used // (nq + cq)) * (nq + cq)  # Llama's config wants a multiple of the head count; the rest stays 0

    factors = [theta ** (g / d) for g in range(d // 2)] + [FROZEN] * (d // 2)
    new_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=H, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=n_layers, num_attention_heads=nq + cq, num_key_value_heads=nkv + 2, head_dim=hd,
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
    rms = _mean_rms(lm, calibration)
    shrink = math.sqrt(h / H)  # RMS over H dims of a vector that lives in the first h
    half, new_half = d // 2, hd // 2
    head_dims = torch.tensor([f if f < half else f - half + new_half for f in range(d)])

    def rows(head: int, dims) -> torch.Tensor:
        return head * hd + dims

    emb_lm = lm.model.embed_tokens.weight
    model.model.embed_tokens.weight[:, :h] = emb_lm
    model.lm_head.weight[:, :h] = emb_lm
    for li, (src, dst) in enumerate(zip(lm.model.layers, model.model.layers)):
        sa, da = src.self_attn, dst.self_attn
        for i in range(nq):
            da.q_proj.weight[rows(i, head_dims), :h] = sa.q_proj.weight[i * d:(i + 1) * d] * math.sqrt(hd / d)
            da.o_proj.weight[:h, rows(i, torch.arange(d))] = sa.o_proj.weight[:, i * d:(i + 1) * d]
        for j in range(nkv):
            da.k_proj.weight[rows(j, head_dims), :h] = sa.k_proj.weight[j * d:(j + 1) * d]
            da.v_proj.weight[rows(j, torch.arange(d)), :h] = sa.v_proj.weight[j * d:(j + 1) * d]
        for name in ("gate_proj", "up_proj"):
            getattr(dst.mlp, name).weight[:, :h] = getattr(src.mlp, name).weight
        dst.mlp.down_proj.weight[:h] = src.mlp.down_proj.weight
        dst.input_layernorm.weight[:h] = src.input_layernorm.weight * shrink
        dst.post_attention_layernorm.weight[:h] = src.post_attention_layernorm.weight * shrink
        # The circuit reads its unit vectors (stored at norm `a`) back at unit norm.
        dst.input_layernorm.weight[h:] = rms[li] * shrink / a
    model.model.norm.weight[:h] = lm.model.norm.weight * shrink

    # --- the circuit ------------------------------------------------------------------------------------------------
    g = torch.Generator().manual_seed(seed)
    m_code = torch.randn(cfg.vocab_size, md, generator=g)
    u_code = torch.randn(cfg.vocab_size, od, generator=g)
    m_code, u_code = m_code / m_code.norm(dim=1, keepdim=True), u_code / u_code.norm(dim=1, keepdim=True)
    # Each token's circuit entries scale with the RMS of its trained embedding, so layer 0 reads them back at
    # exactly unit norm (the positional heads' rotary kernels need that precision).
    tok_rms = emb_lm.float().pow(2).mean(-1).sqrt()[:, None] / rms[0]
    emb = model.model.embed_tokens.weight
    emb[:, CONST] = a * tok_rms[:, 0]
    emb[:, M:M + md] = a * tok_rms * m_code
    emb[:, S:S + od] = a * tok_rms * u_code
    model.lm_head.weight[:, U:U + od] = a * u_code

    omegas = [theta ** (-2 * f / d) for f in range(half)]
    npos = half  # every turning pair
    free = list(range(half, new_half)) + list(range(half + new_half, hd))  # non-turning dims of the wider head

    def positional(attn, q_head: int, kv_head: int, lo: int, hi: int) -> None:
        ab = _fit_positional_kernel(omegas[:npos], _offset_target(lo, hi))
        attn.q_proj.weight[rows(q_head, torch.arange(npos)), CONST] = ab[:npos] * math.sqrt(hd)
        attn.q_proj.weight[rows(q_head, torch.arange(npos) + new_half), CONST] = ab[npos:] * math.sqrt(hd)
        attn.k_proj.weight[rows(kv_head, torch.arange(npos)), CONST] = 1.0

    # Layer 0: positional heads write the match code of x_{t-1}, ..., x_{t-exact} and window averages into slots.
    attn = model.model.layers[0].self_attn
    offsets = [(k, k) for k in range(1, circuit.exact + 1)] + [tuple(w) for w in circuit.windows]
    for s, (lo, hi) in enumerate(offsets):
        q_head = nq + s
        kv_head = nkv + s // group
        positional(attn, q_head, kv_head, lo, hi)
        attn.v_proj.weight[rows(kv_head, torch.arange(md)), M + torch.arange(md)] = 1.0
        attn.o_proj.weight[slot[s] + torch.arange(md), rows(q_head, torch.arange(md))] = a * math.sqrt(hi - lo + 1)

    # Layer 1: the match head compares [x_t, x_{t-1}, ..., windows at t] with [x_{j-1}, x_{j-2}, ..., windows at j]
    # and copies x_j's stored output code into u, which the unembedding reads.
    attn = model.model.layers[1].self_attn
    match_q, match_kv = nq, nkv
    q_src = [M] + slot[:circuit.exact - 1] + slot[circuit.exact:]
    k_src = slot[:circuit.exact] + slot[circuit.exact:]
    weights = [1.0] * circuit.exact + [circuit.window_weight] * len(circuit.windows)
    for s in range(circuit.slots()):
        dims = torch.tensor(free[s * md:(s + 1) * md])
        src = torch.arange(md)
        attn.q_proj.weight[rows(match_q, dims), q_src[s] + src] = circuit.sharpness * weights[s] * math.sqrt(hd)
        attn.k_proj.weight[rows(match_kv, dims), k_src[s] + src] = 1.0
    # A key's own token against the query's: the query's own position (whose window slots also match themselves)
    # outscores every key but a long match, so without one the head copies the current token, which the
    # unembedding's own-token term below takes back.
    dims = torch.tensor(free[:md])
    attn.k_proj.weight[rows(match_kv, dims), M + torch.arange(md)] = circuit.self_weight
    attn.v_proj.weight[rows(match_kv, torch.arange(od)), S + torch.arange(od)] = 1.0
    attn.o_proj.weight[U + torch.arange(od), rows(match_q, torch.arange(od))] = a
    # Unembedding: the copied output code (norm ~`scale`) against each token's code (norm `scale`) -> ~boost.
    model.model.norm.weight[U:U + od] = circuit.boost * rms[-1] * shrink / (a * a)
    model.lm_head.weight[:, S:S + od] = a * u_code
    model.model.norm.weight[S:S + od] = -circuit.boost * rms[-1] * shrink / (a * a)
    model.eval()
    return model


__all__ = ["CopyCircuit", "compose"]
