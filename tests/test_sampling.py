"""Speculative sampling follows the target's own sampling distribution, checked on whole token sequences.

With a 6-token vocabulary the target's exact distribution over every 4-token continuation (1,296 sequences) can be
enumerated by running the target on every prefix. Speculative decoding with a draft unlike the target and k = 2 then
exercises every part of the rejection rule: the first token (from the target's prefill), acceptance at two draft
positions, the residual at a rejection, the bonus token after k acceptances, and a second, shorter round after an
early rejection. A chi-square goodness-of-fit test compares the sampled sequences with the exact distribution.

Significance: alpha = 1e-3, so a correct sampler fails with probability 0.1% for an arbitrary choice of seeds; the
seeds are fixed, so the test is deterministic. The mutation check (experiments/mutation_check.py) shows that a bonus
token from the wrong position, q from the wrong draft step, an unnormalised residual and top-p applied to q only
all fail it.
"""

import collections

import pytest
import torch
from scipy.stats import chi2  # scipy comes with scikit-learn, a dependency

from rift_ada.policies import make_policy
from rift_ada.speculative import SpeculativeDecoder
from tests.conftest import random_model

VOCAB, NEW_TOKENS, K = 6, 4, 2
SAMPLES = 2000
ALPHA = 1e-3
MIN_EXPECTED = 5  # chi-square's usual rule: cells expected fewer times are pooled


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float) -> tuple[torch.Tensor, float]:
    """The target's sampling distribution, written independently of the decoder: softmax at ``temperature``, then
    the most likely tokens until their mass reaches ``top_p`` (the one crossing it included), renormalised. Also
    returns how far the nearest cumulative mass lies from ``top_p``, so a test can make sure rounding cannot move the
    cut."""
    p = torch.softmax(logits.double() / temperature, -1)
    if top_p >= 1:
        return p, 1.0
    sorted_p, order = p.sort(-1, descending=True)
    cum = sorted_p.cumsum(-1)
    keep = torch.zeros_like(p, dtype=torch.bool).scatter(-1, order, cum - sorted_p < top_p)
    p = p * keep
    return p / p.sum(-1, keepdim=True), float((cum - top_p).abs().min())


@torch.no_grad()
def sequence_distribution(target, prompt: list[int], n: int, temperature: float, top_p: float):
    """Exact probability of every ``n``-token continuation under the target's own sampling."""
    dist, margin = {(): 1.0}, 1.0
    for _ in range(n):
        prefixes = [s for s, pr in dist.items() if pr > 0]
        logits = target(torch.tensor([prompt + list(s) for s in prefixes])).logits[:, -1]
        probs, m = sampling_probs(logits, temperature, top_p)
        margin = min(margin, m)
        dist = {s + (t,): dist[s] * float(probs[j, t]) for j, s in enumerate(prefixes) for t in range(VOCAB)}
    return dist, margin


def chi_square(counts: collections.Counter, dist: dict, n: int) -> tuple[float, int]:
    """(statistic, degrees of freedom) over the possible sequences; cells expected < MIN_EXPECTED times are pooled
    into one cell (merged with the smallest other cell if the pool itself is too small)."""
    cells = sorted(((n * pr, counts[s]) for s, pr in dist.items() if pr > 0), reverse=True)
    big = [c for c in cells if c[0] >= MIN_EXPECTED]
    pool = [sum(c[0] for c in cells[len(big):]), sum(c[1] for c in cells[len(big):])]
    if 0 < pool[0] < MIN_EXPECTED:
        e, o = big.pop()
        pool = [pool[0] + e, pool[1] + o]
    if pool[0] > 0:
        big.append(tuple(pool))
    stat = sum((o - e) ** 2 / e for e, o in big)
    return stat, len(big) - 1


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
        counts[tuple(dec.generate(prompt, NEW_TOKENS, controller).tokens)] += 1
    return counts


def check_rift_dyn_sampling(target, draft) -> tuple[SpeculativeDecoder, list[int]]:
    """For other model families (tests/test_architectures.py, tests/test_hybrid.py): a random 24-token prompt, rift-dyn
    budget 12 refreshed before every round, k = 2, temperature 1; the 4-token sequences sampled by speculative
    decoding must follow the target's own distribution (chi-square at alpha 1e-3). Returns the decoder and prompt."""
    prompt = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    dist, _ = sequence_distribution(target, prompt, NEW_TOKENS, 1.0, 1.0)
    pol = make_policy("rift-dyn", budget=12, period=1, obs_window=8)
    dec = SpeculativeDecoder(target, draft, pol.layout, draft_length=K, temperature=1.0)
    counts = sample_sequences(dec, prompt, SAMPLES, pol.controller)
    assert not {s for s in counts if dist.get(s, 0.0) == 0.0}
    stat, dof = chi_square(counts, dist, SAMPLES)
    critical = chi2.ppf(1 - ALPHA, dof)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f} (dof {dof}, alpha {ALPHA})"
    return dec, prompt


# rift-dyn with budget 12 on a 24-token prompt compresses the draft's cache and refreshes it before the second round.
CONFIGS = {
    "full-top_p=1": (make_policy("full"), 1.0),
    "rift-dyn-top_p=0.8": (make_policy("rift-dyn", budget=12, period=1, obs_window=8), 0.8),
}


@pytest.mark.slow
@pytest.mark.parametrize("config", list(CONFIGS))
def test_joint_distribution_of_sequences_matches_target(config):
    policy, top_p = CONFIGS[config]
    target, draft, prompt = models()
    dist, margin = sequence_distribution(target, prompt, NEW_TOKENS, 1.0, top_p)
    assert abs(sum(dist.values()) - 1) < 1e-9
    assert margin > 1e-3, "a cumulative mass lies at top_p: rounding could move the cut; pick another prompt"

    dec = SpeculativeDecoder(target, draft, policy.layout, draft_length=K, temperature=1.0, top_p=top_p)
    counts = sample_sequences(dec, prompt, SAMPLES, policy.controller)
    impossible = {s: c for s, c in counts.items() if dist.get(s, 0.0) == 0.0}
    assert not impossible, f"sequences the target never samples (outside top-p): {impossible}"
    stat, dof = chi_square(counts, dist, SAMPLES)
    critical = chi2.ppf(1 - ALPHA, dof)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f} (dof {dof}, alpha {ALPHA})"


@pytest.mark.parametrize("config", list(CONFIGS))
def test_setting_exercises_every_branch(config):
    """The sampled runs above reach every branch of the acceptance rule (else the test would prove little)."""
    policy, top_p = CONFIGS[config]
    target, draft, prompt = models()
    dec = SpeculativeDecoder(target, draft, policy.layout, draft_length=K, temperature=1.0, top_p=top_p)
    first_round, refreshed = collections.Counter(), 0
    for seed in range(200):
        dec.seed = seed
        res = dec.generate(prompt, NEW_TOKENS, policy.controller)
        first_round[res.rounds[0].accepted] += 1
        refreshed += res.refreshes
    # Rejection at the first and at the second draft, and k acceptances (bonus token), each in >= 5% of runs.
    assert all(first_round[a] >= 10 for a in range(K + 1)), first_round
    if policy.name != "full":
        assert dec.dcache.active_tokens() < len(prompt) and refreshed >= 20, "the draft's cache is compressed"
