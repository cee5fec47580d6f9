"""rift_ada.profiling: a profiled decode is the same decode, and its time split adds up."""

import pytest


def test_profile_decode_matches_generate_and_splits_round_time(testbed_target, testbed_draft, tokenizer):
    from rift_ada.data import build_tasks, encode
    from rift_ada.evaluate import decode
    from rift_ada.policies import make_policy
    from rift_ada.profiling import profile_decode
    from rift_ada.speculative import SpeculativeDecoder

    ids = encode(tokenizer, build_tasks(tokenizer, "low", n=1, input_tokens=1024)[0].prompt)
    pol = make_policy("rift-dyn", 256, period=8)
    dec = SpeculativeDecoder(testbed_target, testbed_draft, pol.layout, 4)
    ref = decode(dec, ids, 40, pol.controller)
    ref_refreshed = [r.refreshed for r in ref.rounds]
    prof = profile_decode(dec, ids, 40, pol.controller)
    rounds = dec.result.rounds
    assert prof.tokens == ref.tokens and [r.refreshed for r in rounds] == ref_refreshed and any(ref_refreshed)
    # The hooks saw every forward of the rounds: one verify per round (a Llama target never replays) and one draft
    # forward per drafted token; the prefill runs before them.
    assert prof.forward_calls == len(rounds) + sum(r.draft_length for r in rounds)
    assert prof.refresh_seconds == sum(r.refresh_seconds for r in rounds)
    # Orderings that hold by construction (nested or disjoint intervals of one clock), so load cannot flip them.
    assert prof.forward_seconds + prof.refresh_seconds <= prof.step_seconds <= prof.seconds
    assert prof.forward_seconds + prof.refresh_seconds + prof.overhead_seconds == pytest.approx(prof.step_seconds)
    assert prof.overhead_share == prof.overhead_seconds / prof.step_seconds
    # The hooks are gone afterwards.
    assert not testbed_target._forward_hooks and not testbed_target._forward_pre_hooks
    assert not testbed_draft._forward_hooks and not testbed_draft._forward_pre_hooks
