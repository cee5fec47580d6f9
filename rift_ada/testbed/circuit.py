"""Experimental: a hand-set copying circuit composed with a trained language model into one ordinary HF Llama.

Not used by the shipped testbed. Why it exists: the testbed v2 models learn Python from data (stage 8: code top-1
0.66 for the target) and induction heads form in them, but a 4-layer model copies by matching the last token or two,
so greedy copying derails at the first line that occurs twice in the prompt (greedy copy 0.11 at 2K after 40 minutes
of copy-only training; ../shared/notes/TESTBED.md). A large pretrained LM matches on a long context; this circuit
is a disclosed stand-in for that. ``python experiments/circuit_probe.py`` measures it.

What ``compose`` builds, from a trained Llama ``lm`` with tied embeddings (hidden h, head_dim d, nq / nkv heads):

- a Llama of hidden ``h + C`` (untied) and head_dim ``2d``, with at least 3 layers (4 with ``label_dim``); its
  first ``h`` residual dims and first ``nq`` heads *are* the trained model (weights copied, query/key dims of rotary
  pair f moved to pair f of the wider head, queries scaled by sqrt(2) for the wider head's 1/sqrt(head_dim)); with
  ``boost=0`` its logits equal ``lm``'s up to the circuit's share of each RMSNorm (tested);
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

With ``label_dim`` (the target's, for the ``sort`` family) a label circuit rides on the same layers. The copy
alone fails a reordered copy in two places: at a later header's label it offers the *prompt's* next label (the
passages sit in label order there), and for ~40 tokens after a header its windows still hold the passage before,
which the order changed, so the match head picks the header that followed that passage in the prompt. So:

- flags from the header's tokens (``# passage K``; ``sort_labels`` reads them off the tokenizer) shut the copy at a
  label; there the match head, which finds the prompt header after the passage just copied, fetches the label
  *before* that header's (PRED); layer 2 finds PRED in the order line (keys: label tokens whose label two, or
  three, tokens back is PRED) and fetches the next label's code, which the unembedding reads where the agreement
  is open (at the first header it is not, and the trained model reads the order line itself); the second token
  of a two-token label (' ', 'K') is carried to the next position by layer 3;
- a layer-1 head finds a header's label within the last ~40 tokens (keys at labels get ~28; every key loses 0.7
  per token of distance on four slow rotary pairs, so the nearest label wins and fades after ~40 tokens: CL, SF);
  a start-match head (exact slots, the nearest window as a dot product, CL at query and key) copies there, where
  the main gate's agreement is low, and the main gate needs 0.3 more agreement near a header;
- the order line's first tokens are never copied into a passage (after the prompt's last passage comes
  ``# order``).

Measured (greedy, 12 held-out 2K sort prompts, stage-8 target): sort accuracy 0.435 without, 0.763 with; the
remaining failures are a previous passage that was the prompt's last (its successor is the order line, so PRED
is unknown and the trained model guesses), repeated lines inside a passage near its start, and repeats in bodies.

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
    # The sort family's passage labels (0: none; else the dims of the label codes; needs compose(labels=...)):
    label_dim: int = 0

    def slots(self) -> int:
        """Slots the match head compares."""
        return self.exact + len(self.windows)


@dataclass(frozen=True)
class SortLabels:
    """Token ids of the ``sort`` family's header (``# passage K``) and labels, as the model's tokenizer splits them."""
    pass_tok: int  # the two tokens before a header's label (' pass', 'age' in the testbed tokenizer)
    age_tok: int
    labels: tuple  # per label, in prompt order: its tokens (one, or a shared first token and one more)
    space: int | None  # the shared first token of two-token labels
    order: tuple  # the order line's first two tokens ('#', ' or')

    @property
    def identity(self) -> list[int]:
        """The token that names each label (its last)."""
        return [toks[-1] for toks in self.labels]

    @property
    def emit(self) -> list[int]:
        """Every token a label is written with."""
        return self.identity + ([self.space] if self.space is not None else [])


def sort_labels(tokenizer) -> SortLabels:
    """The header and label tokens of ``rift_ada.data.tasks``'s sort prompts under ``tokenizer``."""
    from ..data.tasks import LABELS, ORDER_LINE, PASSAGE_HEADER

    heads = [tokenizer.encode(PASSAGE_HEADER.format(label=label), add_special_tokens=False) for label in LABELS]
    stem = 0  # tokens every header shares before its label
    while all(len(h) > stem + 1 and h[stem] == heads[0][stem] for h in heads):
        stem += 1
    if stem < 2:
        raise ValueError("sort headers share fewer than two tokens before their labels")
    out, firsts = [], set()
    for label, head in zip(LABELS, heads):
        toks = tuple(head[stem:-1])
        # The label as the order line writes it (after ', ') must be the same tokens.
        line = tokenizer.encode(ORDER_LINE.format(order="A, " + label), add_special_tokens=False)
        if not 1 <= len(toks) <= 2 or tuple(line[-1 - len(toks):-1]) != toks:
            raise ValueError(f"label {label!r} does not tokenize alike in a header and the order line")
        if len(toks) == 2:
            firsts.add(toks[0])
        out.append(toks)
    if len(firsts) > 1:
        raise ValueError("two-token labels must share their first token")
    order = tuple(tokenizer.encode(ORDER_LINE.format(order="A"), add_special_tokens=False)[:2])
    return SortLabels(pass_tok=heads[0][stem - 2], age_tok=heads[0][stem - 1], labels=tuple(out),
                      space=firsts.pop() if firsts else None, order=order)


@functools.lru_cache(maxsize=8)
def _label_codes(n: int, dim: int) -> torch.Tensor:
    """``n`` unit vectors in ``dim`` dims with small pairwise overlaps (a deterministic descent from a seeded
    start), so that one label's code barely matches another's."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, dim, generator=g, dtype=torch.float64)
    with torch.enable_grad():
        x.requires_grad_(True)
        opt = torch.optim.Adam([x], lr=0.02)
        for _ in range(400):
            u = x / x.norm(dim=1, keepdim=True)
            gram = u @ u.T - torch.eye(n, dtype=torch.float64)
            loss = torch.logsumexp(12 * gram.abs().flatten(), 0)
            opt.zero_grad()
            loss.backward()
            opt.step()
    x = x.detach()
    return (x / x.norm(dim=1, keepdim=True)).float()


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
def compose(lm, circuit: CopyCircuit, calibration: list[list[int]], seed: int = 0, labels: SortLabels | None = None):
    """The trained Llama ``lm`` with ``circuit`` beside it, as one ``LlamaForCausalLM`` (float32, eval mode).
    ``calibration``: token lists of plain text, for the trained residual's mean RMS and the tokens' rarity.
    ``labels``: the sort family's tokens (``sort_labels(tokenizer)``), for a circuit with ``label_dim``."""
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
    ld = circuit.label_dim
    if ld and labels is None:
        raise ValueError("a circuit with label_dim needs labels=sort_labels(tokenizer)")
    if ld and (ex < 3 or nw < 1 or od + ld > hd or md + 4 + ld > hd or (ex + 1) * md + ld > d or
               circuit.slots() * md >= d):
        raise ValueError("label_dim needs exact >= 3 and label_dim + out_dim, label_dim + match_dim + 2 <= head_dim")
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
    if ld:  # the label circuit's flags (one dim each), then its label-code fields
        F_PASS, QA, QS, HFA, HFS, ISL, HLR, HL, SF, SFC, F_HASH, OM, ORDM = range(used, used + 13)
        LID, P2L, P3L, PRED, LV, LV2, LV2G, VL, CL = (used + 13 + k * ld for k in range(9))
        U2 = CL + ld
        W2 = U2 + od
        used = W2 + od
    H = -(-used // (nq + cq)) * (nq + cq)  # Llama's config wants a multiple of the head count; the rest stays 0
    # MLP neurons of the circuit per layer (window norms + header flags | agreement | gates | label carry)
    extra = max(nw * md + 1 + (8 if ld else 0), circuit.slots() * md + 3, 2 * od + (2 * od + 4 * ld if ld else 0),
                3 * ld + 2 * od)
    out_layers = max(n_layers, 4 if ld else 3)

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
    if ld:
        # Label circuit (target only). A later header's label follows the previous passage's label in the order
        # line, not in the prompt: at "# passage" (flag HFA; HFS for the second token of a two-token label) the
        # copy is shut; the match head, which finds the prompt header after the passage just copied, fetches the
        # label before that header's (PRED: the prompt's passages are in label order); layer 2 looks that label up
        # in the order line (keys: labels whose label two, or three, tokens back matches) and fetches the next
        # label's code LV (its second token's, LV2, for the step after); the unembedding reads it from VL.
        codes = _label_codes(len(labels.emit), ld)
        code = dict(zip(labels.emit, codes))

        def put(tok, col, value):
            emb[tok, col:col + (value.numel() if torch.is_tensor(value) else 1)] = a * tok_rms[tok, 0] * value

        put(labels.pass_tok, F_PASS, 1.0)
        put(labels.age_tok, QA, 1.0)
        if labels.space is not None:
            put(labels.space, QS, 1.0)
            put(labels.space, HLR, -2.0)
        put(labels.order[0], F_HASH, 1.0)
        put(labels.order[1], OM, 1.0)  # OM = [x_t is ' or'] + [x_t-1 is '#']: 2 at the order line's start
        for k, toks in enumerate(labels.labels):
            ident = toks[-1]
            put(ident, ISL, 1.0)
            put(ident, LID, code[ident])
            put(ident, LV, code[toks[0]])
            if len(toks) == 2:
                put(ident, LV2, code[ident])
            elif k > 0:  # a two-token label's first token is shared, so it cannot name its predecessor
                put(toks[0], PRED, code[labels.identity[k - 1]])

    omegas = [theta ** (-2 * f / d) for f in range(half)]
    free = list(range(half, new_half)) + list(range(half + new_half, hd))  # non-turning dims of the wider head
    K = circuit.gate_k
    md_ = torch.arange(md)

    def attend_offsets(attn, q_head: int, kv_head: int, lo: int, hi: int) -> None:
        """Query and key of a head that attends evenly to offsets lo..hi (a rotary kernel on CONST)."""
        ab = _positional_kernel(tuple(omegas), lo, hi)  # cached: only read here
        attn.q_proj.weight[rows(q_head, torch.arange(half)), CONST] = ab[:half] * math.sqrt(hd)
        attn.q_proj.weight[rows(q_head, torch.arange(half) + new_half), CONST] = ab[half:] * math.sqrt(hd)
        attn.k_proj.weight[rows(kv_head, torch.arange(half)), CONST] = 1.0

    # Layer 0: positional heads write the codes at each offset (window) into slots.
    attn = model.model.layers[0].self_attn
    for s, ((lo, hi), qh) in enumerate(zip(offsets, pos_heads)):
        q_head, kv_head = nq + qh, nkv + qh // group
        attend_offsets(attn, q_head, kv_head, lo, hi)
        attn.v_proj.weight[rows(kv_head, md_), (M if s < ex else WIN) + md_] = 1.0
        attn.o_proj.weight[slot[s] + md_, rows(q_head, md_)] = a * math.sqrt(hi - lo + 1)
        if ld and s < 3:  # previous tokens' header flags and label codes
            attn.v_proj.weight[rows(kv_head, torch.tensor([md, md + 1])), torch.tensor([F_PASS, QA])] = 1.0
            attn.v_proj.weight[rows(kv_head, md + 2 + torch.arange(ld)), LID + torch.arange(ld)] = 1.0
            attn.v_proj.weight[rows(kv_head, torch.tensor([md + 2 + ld, md + 3 + ld])),
                               torch.tensor([QS, F_HASH])] = 1.0
            # Flags are sums of "token k back is ..." (v dims: md ' pass', md+1 'age', md+2+ld ' ', md+3+ld '#'):
            # QA = [x_t is 'age'] + [x_t-1 is ' pass']; QS = [x_t is ' '] + [x_t-1 is 'age'] + [x_t-2 is ' pass'];
            # HLR (2 at a header's label, its last token) = [x_t-1 is 'age'] + [x_t-2 is ' pass'], or
            # [x_t-1 is ' '] + [x_t-2 is 'age'] (less 2 if x_t is ' ' itself); OM = [x_t is ' or'] + [x_t-1 is '#']
            if s == 0:
                for col, v in ((QA, md), (QS, md + 1), (HLR, md + 1), (HLR, md + 2 + ld), (OM, md + 3 + ld)):
                    attn.o_proj.weight[col, rows(q_head, torch.tensor([v]))] = a
            elif s == 1:
                for col, v in ((QS, md), (HLR, md), (HLR, md + 1)):
                    attn.o_proj.weight[col, rows(q_head, torch.tensor([v]))] = a
            if s > 0:  # the label codes two and three tokens back
                attn.o_proj.weight[(P2L if s == 1 else P3L) + torch.arange(ld),
                                   rows(q_head, md + 2 + torch.arange(ld))] = a
    k_src = slot[:ex + nw]  # the key's context: x_{j-1} .. x_{j-exact}, windows
    q_src = [M] + slot[:ex - 1] + slot[ex + nw:]  # the query's: x_t .. x_{t-exact+1}, windows one token nearer
    weights = [1.0] * ex + [circuit.window_weight] * nw

    def products(mlp, terms, out: int, unit: float, start: int = n_mlp) -> int:
        """Circuit MLP neurons from ``start``: residual[out] += unit * sum of (gate . x)(up . x) over ``terms``
        (pairs of {column: weight}), each as SiLU(K + gate . x)(up . x), less K (sum of up . x) in one shared
        neuron. Returns the next free neuron."""
        cancel = start + len(terms)
        for n, (gate, up) in enumerate(terms, start=start):
            mlp.gate_proj.weight[n, CONST] = K
            for col, w in gate.items():
                mlp.gate_proj.weight[n, col] = w
            for col, w in up.items():
                mlp.up_proj.weight[n, col] = w
                mlp.up_proj.weight[cancel, col] -= w
        mlp.gate_proj.weight[cancel, CONST] = K
        mlp.down_proj.weight[out, start:cancel + 1] = unit
        return cancel + 1

    def clamp(mlp, n: int, x: dict, lo: float, hi: float, up: dict, out: int, gain: float = 1.0) -> int:
        """Neurons n, n+1: residual[out] += gain * clamp((x - lo) / (hi - lo), 0, 1) * (up . x), as
        SiLU(c (x - lo)) - SiLU(c (x - hi)); ``x`` is {column: weight} (CONST for a constant)."""
        c = 4.0 / (hi - lo)  # SiLU bends over about 4 units; beyond, the difference saturates
        for m, edge, sign in ((n, lo, 1.0), (n + 1, hi, -1.0)):
            for col, w in x.items():
                mlp.gate_proj.weight[m, col] += c * w
            mlp.gate_proj.weight[m, CONST] -= c * edge
            for col, w in up.items():
                mlp.up_proj.weight[m, col] = sign * w
            mlp.down_proj.weight[out, m] = gain * a / (c * (hi - lo))
        return n + 2

    # Layer 0's MLP: NSQ = window_weight x sum over key windows of |window|^2, stored at 1/nsq_shrink of the
    # circuit's unit (it runs to ~3 units; the trained layers' RMSNorms should barely see the circuit).
    nsq_shrink = 4.0
    n0 = products(model.model.layers[0].mlp, [({col: 1.0}, {col: circuit.window_weight})
                                              for s in range(ex, ex + nw) for col in range(slot[s], slot[s] + md)],
                  NSQ, a / nsq_shrink)
    if ld:  # header flags: HFA at "# passage" (QA = 2), HFS at a two-token label's first token (QS = 3)
        n0 = clamp(model.model.layers[0].mlp, n0, {QA: 1.0}, 1.2, 1.8, {CONST: 1.0}, HFA)
        n0 = clamp(model.model.layers[0].mlp, n0, {QS: 1.0}, 2.2, 2.8, {CONST: 1.0}, HFS)
        n0 = clamp(model.model.layers[0].mlp, n0, {HLR: 1.0}, 1.1, 1.5, {CONST: 1.0}, HL)
        clamp(model.model.layers[0].mlp, n0, {OM: 1.0}, 1.2, 1.8, {CONST: 1.0}, ORDM)

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
    if ld:  # never copy the order line's start into a passage ("# order" after the prompt's last passage)
        spare = torch.tensor([free[circuit.slots() * md]])
        attn.q_proj.weight[rows(match_q, spare), CONST] = -100.0 * math.sqrt(hd)
        attn.k_proj.weight[rows(match_kv, spare), ORDM] = 1.0
    attn.q_proj.weight[rows(twin_q, torch.arange(hd))] = attn.q_proj.weight[rows(match_q, torch.arange(hd))]
    attn.k_proj.weight[rows(twin_kv, torch.arange(hd))] = attn.k_proj.weight[rows(match_kv, torch.arange(hd))]
    attn.v_proj.weight[rows(match_kv, torch.arange(od)), S + torch.arange(od)] = 1.0
    attn.o_proj.weight[U + torch.arange(od), rows(match_q, torch.arange(od))] = a
    if ld:
        attn.v_proj.weight[rows(match_kv, od + torch.arange(ld)), PRED + torch.arange(ld)] = 1.0
        attn.o_proj.weight[PRED + torch.arange(ld), rows(match_q, od + torch.arange(ld))] = a
        # CL: the label of a header within the last ~40 tokens, and SF: whether there is one. Keys at a header's
        # label (HL) get 40 x HL (~28); every key loses 0.7 per token of distance (-c sin(w D) on four slow
        # rotary pairs), so past ~40 tokens the nearest plain keys win and SF fades.
        cl_q, cl_kv = nq + 2 * group, nkv + 2
        ramp = [f for f in range(half) if omegas[f] * cfg.max_position_embeddings < math.pi / 2][:4]
        c = 0.7 / sum(omegas[f] for f in ramp)
        for f in ramp:
            attn.q_proj.weight[rows(cl_q, torch.tensor([f + new_half])), CONST] = c * math.sqrt(hd)
            attn.k_proj.weight[rows(cl_kv, torch.tensor([f])), CONST] = 1.0
        attn.q_proj.weight[rows(cl_q, torch.tensor([free[0]])), CONST] = 40.0 * math.sqrt(hd)
        attn.k_proj.weight[rows(cl_kv, torch.tensor([free[0]])), HL] = 1.0
        attn.v_proj.weight[rows(cl_kv, torch.arange(ld + 1)), torch.cat([LID + torch.arange(ld), torch.tensor([HL])])] \
            = 1.0
        attn.o_proj.weight[torch.cat([CL + torch.arange(ld), torch.tensor([SF])]), rows(cl_q, torch.arange(ld + 1))] \
            = a
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
    n1 = products(model.model.layers[1].mlp, terms, G, a)
    if ld:  # SFC: SF made a flag (0 or ~1)
        clamp(model.model.layers[1].mlp, n1, {SF: 1.0}, 0.15, 0.35, {CONST: 1.0}, SFC)

    # Layer 2's MLP: v = clamp((G - lo) / (hi - lo), 0, 1) x u, as SiLU(c (G - lo)) - SiLU(c (G - hi)) times u.
    # With the label circuit it is shut at a header's label (where it would offer the prompt's next label).
    shut = 100.0  # agreement units: far more than the agreement ever reaches
    # Near a header (SFC) the main copy needs 0.3 more agreement: its windows can agree with the wrong header.
    gate_in = {G: 1.0, **({HFA: -shut, HFS: -shut, SFC: -0.3} if ld else {})}
    mlp2 = model.model.layers[2].mlp
    n2 = n_mlp
    for i in range(od):
        n2 = clamp(mlp2, n2, gate_in, lo_gate, hi_gate, {U + i: 1.0}, V + i)
    if ld:
        # Passage starts: within ~40 tokens of a header the windows hold the passage before, which the requested
        # order changed, so the agreement stays low (or the match head goes wrong); there (SFC) a start-match head
        # copies instead: exact slots, the nearest window as a dot product (it covers the header, the same in both
        # places, a few tokens in) and the header's label (CL) at query and key. Its code U2 passes where the
        # agreement is low (W2, the complement of the main gate), times SFC in layer 3's MLP.
        attn = model.model.layers[2].self_attn
        st_q, st_kv = nq + group, nkv + 1
        for s in range(ex):
            dims = torch.tensor(free[s * md:(s + 1) * md])
            attn.q_proj.weight[rows(st_q, dims), q_src[s] + md_] = circuit.sharpness * math.sqrt(hd)
            attn.k_proj.weight[rows(st_kv, dims), k_src[s] + md_] = 1.0
        dims = torch.tensor(free[ex * md:(ex + 1) * md])
        attn.q_proj.weight[rows(st_q, dims), q_src[ex] + md_] = 0.5 * circuit.sharpness * math.sqrt(hd)
        attn.k_proj.weight[rows(st_kv, dims), k_src[ex] + md_] = 1.0
        dims = torch.tensor(free[(ex + 1) * md:(ex + 1) * md + ld])
        attn.q_proj.weight[rows(st_q, dims), CL + torch.arange(ld)] = 2 * circuit.sharpness * math.sqrt(hd)
        attn.k_proj.weight[rows(st_kv, dims), CL + torch.arange(ld)] = 1.0
        attn.v_proj.weight[rows(st_kv, torch.arange(od)), S + torch.arange(od)] = 1.0
        attn.o_proj.weight[U2 + torch.arange(od), rows(st_q, torch.arange(od))] = a
        start_in = {G: -1.0, SFC: 0.3, HFA: -shut, HFS: -shut}
        for i in range(od):
            n2 = clamp(mlp2, n2, start_in, -hi_gate, -lo_gate, {U2 + i: 1.0}, W2 + i)
        # Layer 2: the order line's next label. Query: PRED (the previous label); keys: label tokens (ISL) whose
        # label two (one-token labels) or three (two-token) tokens back is PRED. Values: LV, LV2.
        lab = torch.tensor(free[:ld])
        attn.q_proj.weight[rows(nq, lab), PRED + torch.arange(ld)] = 30.0 * math.sqrt(hd)
        attn.k_proj.weight[rows(nkv, lab), P2L + torch.arange(ld)] = 1.0
        attn.k_proj.weight[rows(nkv, lab), P3L + torch.arange(ld)] = 1.0
        attn.q_proj.weight[rows(nq, torch.tensor([free[ld]])), CONST] = 30.0 * math.sqrt(hd)
        attn.k_proj.weight[rows(nkv, torch.tensor([free[ld]])), ISL] = 1.0
        attn.v_proj.weight[rows(nkv, torch.arange(2 * ld)),
                           torch.cat([LV + torch.arange(ld), LV2 + torch.arange(ld)])] = 1.0
        attn.o_proj.weight[LV + torch.arange(ld), rows(nq, torch.arange(ld))] = a
        attn.o_proj.weight[LV2 + torch.arange(ld), rows(nq, ld + torch.arange(ld))] = a
        # Its MLP passes LV and LV2 where the agreement is open (the match head found the prompt's next header;
        # at the first header it did not, and the trained model reads the order line itself): LV into P2L's dims
        # (free after layer 2's keys; 0 at a header), LV2 into LV2G.
        for i in range(ld):
            n2 = clamp(mlp2, n2, {G: 1.0}, lo_gate, hi_gate, {LV + i: 1.0}, P2L + i)
            n2 = clamp(mlp2, n2, {G: 1.0}, lo_gate, hi_gate, {LV2 + i: 1.0}, LV2G + i)
        # Layer 3: LV2G from the position before into P3L's dims (0 at a header's second token); its MLP adds
        # HFA x P2L + HFS x P3L to VL, which the unembedding reads.
        attn = model.model.layers[3].self_attn
        attend_offsets(attn, nq, nkv, 1, 1)
        attn.v_proj.weight[rows(nkv, torch.arange(ld)), LV2G + torch.arange(ld)] = 1.0
        attn.o_proj.weight[P3L + torch.arange(ld), rows(nq, torch.arange(ld))] = a
        n3 = n_mlp
        for i in range(od):
            n3 = products(model.model.layers[3].mlp, [({SFC: 1.0}, {W2 + i: 1.0})], V + i, a, start=n3)
        for i in range(ld):
            n3 = products(model.model.layers[3].mlp, [({HFA: 1.0}, {P2L + i: 1.0}), ({HFS: 1.0}, {P3L + i: 1.0})],
                          VL + i, a, start=n3)
    # Unembedding: the gated code (norm ~`scale`) against each token's code (norm `scale`) -> ~boost.
    model.lm_head.weight[:, V:V + od] = a * u_code
    model.model.norm.weight[V:V + od] = circuit.boost * rms_final * shrink / (a * a)
    if ld:
        model.lm_head.weight[labels.emit, VL:VL + ld] = a * codes
        model.model.norm.weight[VL:VL + ld] = circuit.boost * rms_final * shrink / (a * a)
    model.eval()
    return model


__all__ = ["CopyCircuit", "SortLabels", "compose", "sort_labels"]
