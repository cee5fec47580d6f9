"""Speculative sampling follows the target's own sampling distribution, checked on whole token sequences.

With a 6-token vocabulary the target's exact distribution over every 4-token continuation (1,296 sequences) can be
enumerated by running the target on every prefix. Speculative decoding with a draft unlike the target and k = 2 then
exercises every part of the rejection rule: the first token (from the target's prefill), acceptance at two draft
positions, the residual at a rejection, the bonus token after k acceptances, and a second, shorter round after an
early rejection. A chi-square goodness-of-fit test compares the sampled sequences with the exact distribution, and
any sampled sequence the target cannot produce (outside top-p) fails at once.

Sizes: 2,000 samples per setting. The cells are the possible sequences, those expected fewer than 5 times pooled
into one: 85 cells at temperature 1, 42 at top-p 0.8, 37 at temperature 0.7 and top-p 0.85. Critical value
chi2.ppf(1 - 1e-3, cells - 1), so a correct sampler fails with probability 0.1% for an arbitrary choice of seeds
(the seeds are fixed: the test is deterministic). Three settings, each with a draft unlike the target: the full
draft cache at temperature 1; rift-dyn (budget 12 of 24 prompt tokens, refreshed every round) at top-p 0.8; the full
draft cache at temperature 0.7 and top-p 0.85.

Power: with a full draft cache the speculative sampler's exact sequence distribution is also computable by
enumeration (``speculative_distribution``), for the exact rule, where it equals the target's to 1e-12 (checked), and
for each planted bug of ``BUGS``. Under a bug the chi-square statistic is approximately noncentral chi-square with
the cells' degrees of freedom and noncentrality lambda = n * sum((p_bug - p)^2 / p) over the pooled cells:
power = P(ncx2(dof, lambda) > critical value), or, where the bug puts mass m outside top-p, at least
1 - (1 - m)^n from that check alone. ``test_sample_sizes_have_power`` asserts power >= 0.99 for the bugs each
setting must reject; ``python tests/test_sampling.py`` prints the table, with the power simulated from 2,000
multinomial draws as a cross-check. At n = 2,000, lambda (mass outside top-p) -> power:

| bug (``BUGS``)                              | full, T 1, top-p 1  | full, T 0.7, top-p 0.85     |
|---------------------------------------------|---------------------|-----------------------------|
| one uniform for all of a round's decisions  | 40 -> 0.37          | 161 -> 1 - 4e-10            |
| temperature applied as logits * T           | 0 (none at T 1)     | 598 (43%) -> 1              |
| residual resampled from p                   | 212 -> 1 - 8e-11    | 274 -> 1                    |
| residual not normalised                     | 906 -> 1            | 690 -> 1                    |
| q from the previous draft step              | 172 -> 1 - 2e-7     | 33 (2.5%) -> 1              |
| bonus token from the last draft's position  | 1102 -> 1           | 287 (27%) -> 1              |
| top-p applied to q only                     | 0 (none at top-p 1) | 72 (19%) -> 1               |

One uniform per round makes a round's decisions dependent: P(both drafts accepted) = min(1, r1, r2) instead of
min(1, r1) min(1, r2), r = p/q. The temperature-0.7 setting rejects it and the inverted temperature, which every
test at temperature 1 passes. The rift-dyn setting's q comes from a compressed cache, so its distribution under a
bug is not enumerated; top-p applied to q only puts 29% of its mass outside top-p 0.8 with a full cache. The bugs
are also planted in the code by experiments/mutation_check.py, where these tests kill each one.
"""

import collections
import dataclasses
import functools
import itertools

import pytest
import torch
from scipy.stats import chi2, ncx2  # scipy comes with scikit-learn, a dependency

from rift_ada.evaluate import decode
from rift_ada.policies import make_policy
from rift_ada.speculative import SpeculativeDecoder
from tests.conftest import random_model

VOCAB, NEW_TOKENS, K = 6, 4, 2
SAMPLES = 2000
ALPHA = 1e-3
MIN_EXPECTED = 5  # chi-square's usual rule: cells expected fewer times are pooled
MIN_POWER = 0.99


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float,
                   top_k: int = 0) -> tuple[torch.Tensor, float]:
    """The target's sampling distribution, written independently of the decoder: softmax at ``temperature``, then
    (``top_k``) the k most likely tokens, then the most likely tokens until their mass reaches ``top_p`` (the one
    crossing it included), renormalised. Also returns how far the nearest cumulative mass lies from ``top_p``, so a
    test can make sure rounding cannot move the cut."""
    p = torch.softmax(logits.double() / temperature, -1)
    if top_k:
        p = torch.where(p >= p.sort(-1, descending=True).values[..., top_k - 1:top_k], p, 0.0)
        p = p / p.sum(-1, keepdim=True)
    if top_p >= 1:
        return p, 1.0
    sorted_p, order = p.sort(-1, descending=True)
    cum = sorted_p.cumsum(-1)
    keep = torch.zeros_like(p, dtype=torch.bool).scatter(-1, order, cum - sorted_p < top_p)
    p = p * keep
    return p / p.sum(-1, keepdim=True), float((cum - top_p).abs().min())


@torch.no_grad()
def sequence_distribution(target, prompt: list[int], n: int, temperature: float, top_p: float, top_k: int = 0):
    """Exact probability of every ``n``-token continuation under the target's own sampling."""
    dist, margin = {(): 1.0}, 1.0
    for _ in range(n):
        prefixes = [s for s, pr in dist.items() if pr > 0]
        logits = target(torch.tensor([prompt + list(s) for s in prefixes])).logits[:, -1]
        probs, m = sampling_probs(logits, temperature, top_p, top_k)
        margin = min(margin, m)
        dist = {s + (t,): dist[s] * float(probs[j, t]) for j, s in enumerate(prefixes) for t in range(VOCAB)}
    return dist, margin


def pooled_cells(dist: dict, n: int) -> list[list[tuple]]:
    """The chi-square's cells: one per sequence expected >= MIN_EXPECTED times in ``n`` samples, the rest pooled
    into one cell (merged with the smallest other cell if the pool itself is expected fewer times)."""
    seqs = sorted((s for s, pr in dist.items() if pr > 0), key=lambda s: -dist[s])
    big = [[s] for s in seqs if n * dist[s] >= MIN_EXPECTED]
    pool = seqs[len(big):]
    if 0 < n * sum(dist[s] for s in pool) < MIN_EXPECTED:
        pool += big.pop()
    return big + ([pool] if pool else [])


def chi_square(counts: collections.Counter, dist: dict, n: int) -> tuple[float, int]:
    """(statistic, degrees of freedom) over the possible sequences, cells as ``pooled_cells``."""
    cells = [(n * sum(dist[s] for s in c), sum(counts[s] for s in c)) for c in pooled_cells(dist, n)]
    return sum((o - e) ** 2 / e for e, o in cells), len(cells) - 1


def models():
    # init 0.3: distributions spread enough that rejections, residuals and bonus tokens are all frequent, yet
    # different enough between contexts that a distribution taken from the wrong position shows (at 0.1-0.2 every
    # distribution is near-uniform). The draft is another random model, so q differs from p everywhere.
    target = random_model("llama", vocab=VOCAB, hidden=32, heads=2, kv_heads=1, layers=2, seed=0, init=0.3)
    draft = random_model("llama", vocab=VOCAB, hidden=32, heads=2, kv_heads=1, layers=1, seed=7, init=0.3)
    prompt = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    return target, draft, prompt


def sample_sequences(dec: SpeculativeDecoder, prompt: list[int], n: int, controller) -> collections.Counter:
    counts = collections.Counter()
    for seed in range(n):
        dec.seed = seed
        counts[tuple(decode(dec, prompt, NEW_TOKENS, controller).tokens)] += 1
    return counts


def check_rift_dyn_sampling(target, draft, step: str = "model") -> tuple[SpeculativeDecoder, list[int]]:
    """For other model families (tests/test_architectures.py, tests/test_hybrid.py): a random 24-token prompt, rift-dyn
    budget 12 refreshed before every round, k = 2, temperature 1; the 4-token sequences sampled by speculative
    decoding must follow the target's own distribution (chi-square at alpha 1e-3). Returns the decoder and prompt."""
    prompt = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    dist, _ = sequence_distribution(target, prompt, NEW_TOKENS, 1.0, 1.0)
    pol = make_policy("rift-dyn", budget=12, period=1, obs_window=8)
    dec = SpeculativeDecoder(target, draft, pol.layout, draft_length=K, temperature=1.0, draft_step=step,
                             verify_step=step)
    counts = sample_sequences(dec, prompt, SAMPLES, pol.controller)
    assert not {s for s in counts if dist.get(s, 0.0) == 0.0}
    stat, dof = chi_square(counts, dist, SAMPLES)
    critical = chi2.ppf(1 - ALPHA, dof)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f} (dof {dof}, alpha {ALPHA})"
    return dec, prompt


# name: (draft cache policy, temperature, top_p). rift-dyn with budget 12 on a 24-token prompt compresses the
# draft's cache and refreshes it before the second round.
CONFIGS = {
    "full-top_p=1": (make_policy("full"), 1.0, 1.0),
    "rift-dyn-top_p=0.8": (make_policy("rift-dyn", budget=12, period=1, obs_window=8), 1.0, 0.8),
    "full-T=0.7-top_p=0.85": (make_policy("full"), 0.7, 0.85),
}


@pytest.mark.slow
@pytest.mark.parametrize("config,step", [(c, "model") for c in CONFIGS]
                         + [(c, "static") for c in ("rift-dyn-top_p=0.8", "full-T=0.7-top_p=0.85")])
def test_joint_distribution_of_sequences_matches_target(config, step):
    """``step="static"``: both static steps, so every round runs on the device (the draft step draws each draft,
    ``rounds.accept_on_device`` the acceptance test): the same chi-square checks its rule, in the compressed setting
    and in the one that rejects one uniform per round and an inverted temperature."""
    policy, temperature, top_p = CONFIGS[config]
    target, draft, prompt = models()
    dist, margin = sequence_distribution(target, prompt, NEW_TOKENS, temperature, top_p)
    assert abs(sum(dist.values()) - 1) < 1e-9
    assert margin > 1e-3, "a cumulative mass lies at top_p: rounding could move the cut; pick another prompt"

    dec = SpeculativeDecoder(target, draft, policy.layout, draft_length=K, temperature=temperature, top_p=top_p,
                             draft_step=step, verify_step=step)
    assert dec.device_round == (step == "static")
    counts = sample_sequences(dec, prompt, SAMPLES, policy.controller)
    impossible = {s: c for s, c in counts.items() if dist.get(s, 0.0) == 0.0}
    assert not impossible, f"sequences the target never samples (outside top-p): {impossible}"
    stat, dof = chi_square(counts, dist, SAMPLES)
    critical = chi2.ppf(1 - ALPHA, dof)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f} (dof {dof}, alpha {ALPHA})"


@pytest.mark.parametrize("config", list(CONFIGS))
def test_setting_exercises_every_branch(config):
    """The sampled runs above reach every branch of the acceptance rule (else the test would prove little)."""
    policy, temperature, top_p = CONFIGS[config]
    target, draft, prompt = models()
    dec = SpeculativeDecoder(target, draft, policy.layout, draft_length=K, temperature=temperature, top_p=top_p)
    first_round, refreshed = collections.Counter(), 0
    for seed in range(200):
        dec.seed = seed
        res = decode(dec, prompt, NEW_TOKENS, policy.controller)
        first_round[res.rounds[0].accepted] += 1
        refreshed += res.refreshes
    # Rejection at the first and at the second draft, and k acceptances (bonus token), each in >= 5% of runs.
    assert all(first_round[a] >= 10 for a in range(K + 1)), first_round
    if policy.name != "full":
        assert dec.dcache.active_tokens() < len(prompt) and refreshed >= 20, "the draft's cache is compressed"


# --- the power of the check: the exact distribution of a speculative sampler, with and without planted bugs ------

@dataclasses.dataclass(frozen=True)
class Rule:
    """How a speculative sampler accepts and resamples: the defaults are the exact rule, each field a planted bug."""

    shared_uniform: bool = False  # one uniform for all of a round's acceptance tests
    inverted_temperature: bool = False  # softmax(logits * T): p and q at temperature 1 / T
    residual: str = "normalised"  # "unnormalised" (inverse CDF on max(p - q, 0)), or "p" (resample from p)
    q_previous_step: bool = False  # the acceptance test at draft i uses q of draft i - 1
    bonus_previous_position: bool = False  # after k acceptances the bonus token comes from p at position k - 1
    p_without_top_p: bool = False  # the acceptance test and the residual use p before top-p (q has it)


BUGS = {
    "one-uniform-per-round": Rule(shared_uniform=True),
    "temperature-inverted": Rule(inverted_temperature=True),
    "residual-from-p": Rule(residual="p"),
    "residual-unnormalised": Rule(residual="unnormalised"),
    "q-wrong-step": Rule(q_previous_step=True),
    "bonus-position": Rule(bonus_previous_position=True),
    "top-p-only-on-q": Rule(p_without_top_p=True),
}
# The bugs each full-cache setting must reject with power >= MIN_POWER (at temperature 1 an inverted temperature
# changes nothing, and one uniform per round changes too little for 2,000 samples: the temperature-0.7 setting
# rejects both).
MUST_REJECT = {
    "full-top_p=1": ["residual-from-p", "residual-unnormalised", "q-wrong-step", "bonus-position"],
    "full-T=0.7-top_p=0.85": list(BUGS),
}


def next_token_probs(model, prompt, temperature, top_p):
    """ctx (tuple) -> sampling distribution (list) of the next token after prompt + ctx."""
    @functools.lru_cache(maxsize=None)
    def probs(ctx):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(ctx)])).logits[0, -1]
        return sampling_probs(logits, temperature, top_p)[0].tolist()
    return probs


def stop_probabilities(ratios: list[float], rule: Rule) -> list[float]:
    """P(the first rejection is at draft i) for each i, then P(all accepted); acceptance test i passes when
    u_i <= p_i(x_i) / q_i(x_i) = ratios[i]."""
    accepted, out = 1.0, []
    for r in ratios:
        # One uniform: passing test i means u <= every ratio so far; independent uniforms multiply.
        now = min(accepted, r) if rule.shared_uniform else accepted * min(1.0, r)
        out.append(accepted - now)
        accepted = now
    return out + [accepted]


def resample(p: list[float], q: list[float], rule: Rule) -> list[float]:
    """The distribution of the token that replaces a rejected draft."""
    residual = [max(a - b, 0.0) for a, b in zip(p, q)]
    total = sum(residual)
    if rule.residual == "p" or total <= 0:
        return p
    if rule.residual == "unnormalised":  # inverse CDF: a uniform beyond the total lands on the last such token
        last = max(i for i, x in enumerate(residual) if x > 0)
        return [x + (1 - total if i == last else 0.0) for i, x in enumerate(residual)]
    return [x / total for x in residual]


def round_distribution(P, Q, P_test, ctx: tuple, k: int, rule: Rule) -> dict:
    """Exact distribution of the tokens one round appends after ``ctx`` (k drafts; k = 0: one token from p);
    ``P_test`` is the p of the acceptance test and the residual (``P`` but for a planted bug)."""
    out = collections.defaultdict(float)
    for drafts in itertools.product(range(VOCAB), repeat=k):
        qs = [Q(ctx + drafts[:i]) for i in range(k)]
        prob = functools.reduce(lambda a, i: a * qs[i][drafts[i]], range(k), 1.0)
        if prob == 0:
            continue
        ps, p_test = [P(ctx + drafts[:i]) for i in range(k + 1)], [P_test(ctx + drafts[:i]) for i in range(k)]
        q_test = [qs[max(i - 1, 0)] for i in range(k)] if rule.q_previous_step else qs
        ratios = [p_test[i][x] / q_test[i][x] if q_test[i][x] > 0 else float("inf") for i, x in enumerate(drafts)]
        stops = stop_probabilities(ratios, rule)
        ends = [resample(p_test[i], q_test[i], rule) for i in range(k)]
        ends.append(ps[k - 1] if rule.bonus_previous_position and k else ps[k])
        for i, (stop, end) in enumerate(zip(stops, ends)):
            for y, py in enumerate(end):
                if stop * py > 0:
                    out[drafts[:i] + (y,)] += prob * stop * py
    return out


def speculative_distribution(target, draft, prompt, temperature, top_p, rule: Rule = Rule()) -> dict:
    """Exact distribution of the NEW_TOKENS-token sequences the decoder samples with full caches and k = K, round
    by round as SpeculativeDecoder runs them: the first token from the target's prefill, then rounds of
    min(K, tokens left - 1) drafts."""
    t = 1 / temperature if rule.inverted_temperature else temperature
    P, Q = next_token_probs(target, prompt, t, top_p), next_token_probs(draft, prompt, t, top_p)
    P_test = next_token_probs(target, prompt, t, 1.0) if rule.p_without_top_p else P
    dist = collections.defaultdict(float)

    def extend(seq, prob):
        if len(seq) == NEW_TOKENS:
            dist[seq] += prob
            return
        for tokens, p in round_distribution(P, Q, P_test, seq, min(K, NEW_TOKENS - len(seq) - 1), rule).items():
            extend(seq + tokens, prob * p)

    for t0, p0 in enumerate(P(())):
        if p0 > 0:
            extend((t0,), p0)
    return dist


def power(null: dict, bug: dict, n: int = SAMPLES) -> tuple[float, float, float]:
    """(noncentrality, mass outside the null's support, power) of this module's check against ``bug``."""
    cells = pooled_cells(null, n)
    p0 = [sum(null[s] for s in c) for c in cells]
    p1 = [sum(bug.get(s, 0.0) for s in c) for c in cells]
    outside = max(1 - sum(p1), 0.0)
    lam = n * sum((b - a) ** 2 / a for a, b in zip(p0, p1))
    dof = len(cells) - 1
    return lam, outside, max(ncx2.sf(chi2.ppf(1 - ALPHA, dof), dof, lam), 1 - (1 - outside) ** n)


@pytest.mark.parametrize("config", list(MUST_REJECT))
def test_sample_sizes_have_power(config):
    """The enumerated speculative distribution under the exact rule is the target's own (so the enumeration is
    right), and at SAMPLES samples the check above rejects each planted bug of MUST_REJECT with power >=
    MIN_POWER (the sizes cannot be cut without this failing)."""
    _, temperature, top_p = CONFIGS[config]
    target, draft, prompt = models()
    exact = speculative_distribution(target, draft, prompt, temperature, top_p)
    own, _ = sequence_distribution(target, prompt, NEW_TOKENS, temperature, top_p)
    assert max(abs(exact.get(s, 0.0) - p) for s, p in own.items()) < 1e-12 and set(exact) <= set(own)
    rows = {name: power(exact, speculative_distribution(target, draft, prompt, temperature, top_p, BUGS[name]))
            for name in MUST_REJECT[config]}
    weak = {name: row for name, row in rows.items() if row[2] < MIN_POWER}
    assert not weak, f"(lambda, mass outside top-p, power) below power {MIN_POWER}: {weak}"


def simulated_power(null: dict, bug: dict, n: int = SAMPLES, runs: int = 2000, seed: int = 0) -> float:
    """The same power by simulation: the share of ``runs`` multinomial samples from ``bug`` that the check rejects
    (a cross-check of the noncentral chi-square approximation)."""
    import numpy as np

    seqs = sorted(set(null) | set(bug))
    draws = np.random.default_rng(seed).multinomial(n, [bug.get(s, 0.0) for s in seqs], size=runs)
    critical = chi2.ppf(1 - ALPHA, len(pooled_cells(null, n)) - 1)
    rejected = 0
    for row in draws:
        counts = collections.Counter({s: c for s, c in zip(seqs, row) if c})
        rejected += any(null.get(s, 0.0) == 0 for s in counts) or chi_square(counts, null, n)[0] >= critical
    return rejected / runs


if __name__ == "__main__":  # the docstring's power table
    for name in MUST_REJECT:
        _, temperature, top_p = CONFIGS[name]
        target, draft, prompt = models()
        null = speculative_distribution(target, draft, prompt, temperature, top_p)
        print(f"{name}: {len(pooled_cells(null, SAMPLES))} cells")
        for bug, rule in BUGS.items():
            dist = speculative_distribution(target, draft, prompt, temperature, top_p, rule)
            lam, outside, pw = power(null, dist)
            print(f"  {bug:>24}: lambda {lam:7.1f}, outside top-p {outside:.3f}, power {pw:.4f} (misses "
                  f"{1 - pw:.1e}; simulated {simulated_power(null, dist):.4f})")
