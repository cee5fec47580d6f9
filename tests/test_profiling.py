"""rift_ada.profiling: a profiled decode is the same decode, and its time split adds up."""

import pytest


def test_profile_decode_matches_generate_and_splits_round_time(testbed_target, testbed_draft, tokenizer):
    from rift_ada.data import build_tasks, encode
    from rift_ada.policies import make_policy
    from rift_ada.profiling import profile_decode
    from rift_ada.speculative import SpeculativeDecoder

    ids = encode(tokenizer, build_tasks(tokenizer, "low", n=1, input_tokens=1024)[0].prompt)
    pol = make_policy("rift-dyn", 256, period=8)
    dec = SpeculativeDecoder(testbed_target, testbed_draft, pol.layout, 4)
    ref = dec.generate(ids, 40, pol.controller).tokens
    prof = profile_decode(dec, ids, 40, pol.controller)
    assert prof.tokens == ref
    assert dec.result.refreshes >= 1 and prof.refresh_seconds > 0
    assert 0 < prof.forward_seconds < prof.step_seconds < prof.seconds
    assert prof.forward_seconds + prof.refresh_seconds + prof.overhead_seconds == pytest.approx(prof.step_seconds)
    assert 0 <= prof.overhead_share < 1
    # The hooks are gone afterwards.
    assert not testbed_target._forward_hooks and not testbed_target._forward_pre_hooks
    assert not testbed_draft._forward_hooks and not testbed_draft._forward_pre_hooks
