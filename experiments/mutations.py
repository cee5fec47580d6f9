"""The bugs ``experiments/mutation_check.py`` plants, each a textual patch of the source, and the tests that must catch
them.

A patch's ``old`` text must occur exactly once in its file (``python experiments/mutation_check.py --check`` says
whether every patch still applies); a change to a patched line updates its ``old`` and ``new`` here.
"""

from dataclasses import dataclass

SAMPLING = ["tests/test_sampling.py::test_joint_distribution_of_sequences_matches_target"]
TOP_P = ["tests/test_sampling.py::test_joint_distribution_of_sequences_matches_target[rift-dyn-top_p=0.8]"]
COLD = ["tests/test_sampling.py::test_joint_distribution_of_sequences_matches_target[full-T=0.7-top_p=0.85]"]
WINDOW = ["tests/test_cache.py::test_eviction_keeps_exactly_the_layout_positions",
          "tests/test_cache.py::test_tight_budget_holding_everything_equals_dense",
          "tests/test_speculative.py::test_greedy_equals_target_generate_testbed_policies"]

BATCH = ["tests/test_batch.py::test_each_row_decodes_as_its_own_decoder"]
FAR_GATE = ["tests/test_circuit.py::test_far_gate_switches_the_far_window_off_after_a_sort_header"]


@dataclass
class Mutation:
    name: str
    what: str
    patches: list[tuple[str, str, str]]  # (file, old, new)
    tests: list[str]


MUTATIONS = [
    Mutation("keep-worst-selection", "selection keeps the lowest-scored positions",
             [("rift_ada/selection.py",
               'masked = scores.float().masked_fill(~candidates.to(scores.device), float("-inf"))\n'
               "    return masked.topk(n, dim=-1).indices",
               'masked = scores.float().masked_fill(~candidates.to(scores.device), float("inf"))\n'
               "    return masked.topk(n, dim=-1, largest=False).indices")],
             ["tests/test_cache.py::test_selection_keeps_the_best_scored_positions_per_head",
              "tests/test_regression.py::test_selection_beats_the_sliding_window"]),
    Mutation("window-keeps-one-more", "sliding window evicts one token too few",
             [("rift_ada/rift_layer.py", "drop = 0 if keep is None else self.n_tail - keep\n",
               "drop = 0 if keep is None else self.n_tail - keep - 1\n")], WINDOW),
    Mutation("window-keeps-one-less", "sliding window evicts one token too many",
             [("rift_ada/rift_layer.py", "drop = 0 if keep is None else self.n_tail - keep\n",
               "drop = 0 if keep is None else self.n_tail - keep + 1\n")], WINDOW),
    Mutation("bonus-position", "after k acceptances the bonus token comes from the last draft's position",
             [("rift_ada/rounds.py", "bonus = t_logits[len(drafts)]", "bonus = t_logits[len(drafts) - 1]")],
             SAMPLING),
    Mutation("q-wrong-step", "the acceptance test uses the previous draft step's distribution q",
             [("rift_ada/rounds.py", "enumerate(zip(drafts, q_probs))",
               "enumerate(zip(drafts, q_probs[:1] + q_probs[:-1]))")], SAMPLING),
    Mutation("residual-unnormalised", "at a rejection, sample from max(p - q, 0) without dividing by its sum",
             [("rift_ada/rounds.py", "sample(residual / total if total > 0 else p",
               "sample(residual if total > 0 else p")], SAMPLING),
    Mutation("top-p-only-on-q", "the target's p in the acceptance test skips top-p (the draft's q has it)",
             [("rift_ada/rounds.py", "p = sampling_probs(t_logits[i], temperature, top_k, top_p)",
               "p = torch.softmax(t_logits[i].float() / temperature, -1)")], TOP_P),
    Mutation("temperature-inverted", "the sampling distribution is softmax(logits * T) instead of softmax(logits / T)",
             [("rift_ada/rounds.py", "p = torch.softmax(logits.float() / temperature, -1)",
               "p = torch.softmax(logits.float() * temperature, -1)")], COLD),
    Mutation("one-uniform-per-round", "one uniform draw decides every draft of a round (decisions not independent)",
             [("rift_ada/rounds.py",
               "    for i, (x, q) in enumerate(zip(drafts, q_probs)):\n"
               "        p = sampling_probs(t_logits[i], temperature, top_k, top_p)\n"
               "        u = torch.rand((), generator=generator, device=generator.device)\n",
               "    u = torch.rand((), generator=generator, device=generator.device)\n"
               "    for i, (x, q) in enumerate(zip(drafts, q_probs)):\n"
               "        p = sampling_probs(t_logits[i], temperature, top_k, top_p)\n")], COLD),
    Mutation("residual-from-p", "at a rejection, resample from p instead of norm(max(p - q, 0))",
             [("rift_ada/rounds.py", "sample(residual / total if total > 0 else p, t_logits[i], generator)",
               "sample(p, t_logits[i], generator)")], SAMPLING),
    Mutation("rollback-keeps-rejected", "the draft cache keeps one rejected token after a rollback",
             [("rift_ada/speculative.py", "self.dcache.rollback(fed_drafts - n)",
               "self.dcache.rollback(max(fed_drafts - n - 1, 0))")],
             ["tests/test_speculative.py::test_rollback_leaves_caches_as_if_never_fed"]),
    Mutation("draft-feeds-rejected-at-k-1", "a round that rejects only its last draft feeds that draft to the draft",
             [("rift_ada/speculative.py", "        if n <= fed_drafts:\n", "        if n < fed_drafts:\n")],
             ["tests/test_speculative.py::test_rollback_leaves_caches_as_if_never_fed"]),
    Mutation("hybrid-replay-skips-last-rejection",
             "a hybrid target does not replay when only the last draft is rejected",
             [("rift_ada/recurrent.py", "if len(kept) < fed and self.layers:",
               "if len(kept) < fed - 1 and self.layers:")],
             ["tests/test_hybrid.py::test_rollback_equals_recomputing_from_scratch"]),
    Mutation("target-sliding-untrimmed-after-full-accept",
             "a round that accepts every draft skips the target's crop (its sliding layers keep the round's tokens)",
             [("rift_ada/recurrent.py", "        self.cache.crop(len(kept) - fed)\n",
               "        if len(kept) < fed:\n            self.cache.crop(len(kept) - fed)\n")],
             ["tests/test_architectures.py::test_rollback_with_sliding_layers_meets_every_accepted_count"]),
    Mutation("evaluate-drops-controller", "evaluate() decodes without the controller it is given (never refreshes)",
             [("rift_ada/evaluate.py", "res = decode(decoder, ids, max_new_tokens, controller)",
               "res = decode(decoder, ids, max_new_tokens)")],
             ["tests/test_controllers.py::test_exported_controller_drives_decoding_without_training_libraries"]),
    Mutation("refresh-keeps-drift", "a refresh does not remember its observation queries (the drift is not reset)",
             [("rift_ada/cache.py", "self._capacity(), upto)\n        self._remember_queries(upto)\n",
               "self._capacity(), upto)\n")],
             ["tests/test_cache.py::test_refresh_scores_from_scratch_resets_drift_and_rolls_back_exactly"]),
    Mutation("window-mask-off", "mid-round draft queries see the tail beyond their window (the round's start decides)",
             [("rift_ada/rift_layer.py", "        if self.window is None or self.n_tail <= self.window + 1:\n",
               "        if True:\n")],
             ["tests/test_cache.py::test_eviction_keeps_exactly_the_layout_positions",
              "tests/test_cache.py::test_one_token_less_differs"]),
    Mutation("replay-row-ignores-pending", "a replayed refresh scores history up to the tokens generated, pending "
             "included", [("rift_ada/replay/process.py", "self.row = (g - self.pending) // self.G",
                           "self.row = g // self.G")],
             ["tests/test_replay.py::test_greedy_replay_follows_the_decoder_round_for_round"]),
    Mutation("replay-accepts-q", "sampled replay keeps a draft with probability q(x) instead of min(1, q/p)",
             [("rift_ada/replay/table.py", "return np.minimum(1.0, self.q / self.p[None])", "return self.q")],
             ["tests/test_replay.py::test_sampled_replay_keeps_drafts_with_the_rejection_rule_probability"]),
    Mutation("oracle-free-refresh", "the oracle's program forgets the refresh price it is asked for", [(
        "rift_ada/replay/oracle.py", "go = keep[r_new] + refresh_price", "go = keep[r_new]")],
        ["tests/test_replay.py::test_oracle_is_the_cheapest_of_every_schedule"]),
    Mutation("since-refresh-not-reset", "tokens_since_refresh keeps counting through a refresh",
             [("rift_ada/signals.py", "return (0 if refreshed else count) + emitted", "return count + emitted")],
             ["tests/test_speculative.py::test_tokens_since_refresh_restarts_at_each_refresh"]),
    Mutation("make-scorer-drops-unknown-options", "make_scorer silently drops options its scorer does not take",
             [("rift_ada/scorers/__init__.py", "    if unknown:\n", "    if False:\n")],
             ["tests/test_cache.py::test_policy_and_layout_errors"]),
    Mutation("refresh-cost-over-all-rounds", "the measured refresh cost is the median over every round",
             [("rift_ada/costs.py", "refresh_s=median(r.refresh_seconds for r in refreshed)",
               "refresh_s=median(r.refresh_seconds for r in rounds)")],
             ["tests/test_env.py::test_measured_costs_are_the_rounds_medians"]),
    Mutation("savings-not-interpolated",
             "the refresh rate periodic needs for an AL is its next point's, not interpolated",
             [("rift_ada/tradeoff.py", "return float(r1 if a1 == a0 else r0 + (al - a0) * (r1 - r0) / (a1 - a0))",
               "return float(r1)")],
             ["tests/test_train_controller.py::test_matched_comparison_on_known_points"]),
    Mutation("far-gate-never-fires", "the testbed target's far gate never counts a sort header",
             [("testbed/circuit.py", "ctx.rows(q_head, torch.tensor([c.match_dim + 1]))] = a * (hi - lo + 1)",
               "ctx.rows(q_head, torch.tensor([c.match_dim + 1]))] = 0.0")], FAR_GATE),
    Mutation("far-gate-keeps-the-far-query", "the far gate fires but leaves the far query window in place",
             [("testbed/circuit.py", "{col: 1.0}, col, gain=-1.0)", "{col: 1.0}, col, gain=0.0)")], FAR_GATE),
    Mutation("refresh-ignores-generated", "a refresh rescores only the prompt part of the backing store",
             [("rift_ada/cache.py", "        upto = self.refresh_point()\n", "        upto = self.prompt_len\n")],
             ["tests/test_cache.py::test_per_head_selection_and_refresh_reaches_generated_tokens",
              "tests/test_regression.py::test_pinned_acceptance_length[self/rift-dyn]"]),
    Mutation("priced-by-learned-costs", "a priced joint controller ignores the deciding machine's costs",
             [("rift_ada/joint/control.py",
               "return price_vector(self.prices or self.costs, self.choices, ctx, state.since_draft)",
               "return price_vector(self.costs, self.choices, ctx, state.since_draft)")],
             ["tests/test_joint.py::test_a_tokens_controller_is_priced_by_the_costs_of_the_machine_it_decides_on"]),
    Mutation("rate-takes-the-dearest-period", "the oracle ceiling's rate point takes each prompt's dearest period",
             [("experiments/oracle_ceiling.py", "        per.append([min([periodic[n][i]",
               "        per.append([max([periodic[n][i]")],
             ["tests/test_replay.py::test_oracle_ceiling_bounds_each_prompt_and_says_what_a_learner_needs"]),
    Mutation("bench-unpaired-repeats", "the bench's interval draws the base row's repeats apart from the joint row's",
             [("rift_ada/studies/joint_bench.py",
               "for f, (p, r) in picks.items()) for j in (0, 1)]\n",
               "for f, (p, r) in picks.items()) for j in (0, 1)]\n"
               "        picks = {f: (p, rng.integers(0, arr[f].shape[2], r.shape)) for f, (p, r) in picks.items()}\n"
               "        tok_s[1] = (sum(arr[f][1, p, r, 0].sum() for f, (p, r) in picks.items())\n"
               "                    / sum(arr[f][1, p, r, 1].sum() for f, (p, r) in picks.items()))\n")],
             ["tests/test_joint.py::test_the_bench_ratio_interval_resamples_prompts_and_their_repeats"]),
    Mutation("batch-padding-visible", "a batched forward lets each row attend to the padding after its entries",
             [("rift_ada/batch.py", "        mask = torch.zeros(len(rows), 1, q, width, dtype=torch.bool, device=device)\n",
               "        mask = torch.ones(len(rows), 1, q, width, dtype=torch.bool, device=device)\n")], BATCH),
    Mutation("batch-shared-generator", "every row of a batch drafts from the first row's random numbers",
             [("rift_ada/batch.py", "tok = greedy[j] if greedy is not None else sample(q, logits[j], r.generator)",
               "tok = greedy[j] if greedy is not None else sample(q, logits[j], rows[0].generator)")],
             ["tests/test_batch.py::test_each_row_decodes_as_its_own_decoder[1.0-model]"]),
    Mutation("static-batch-ignores-the-window", "the batched static draft step attends the whole tail mid-round",
             [("rift_ada/static_batch.py", "band = slots >= slot[:, None] - window[:, None]",
               "band = slots >= 0")],
             ["tests/test_batch.py::test_each_row_decodes_as_its_own_decoder"]),
    Mutation("batch-row-store-misplaced", "the target's store writes a row's new entries one slot late",
             [("rift_ada/ragged.py",
               "        self.store.k[self.layer_idx][self.row, :, self.stored:self.stored + q] = key_states\n",
               "        self.store.k[self.layer_idx][self.row, :, self.stored + 1:self.stored + q + 1] = key_states\n")],
             ["tests/test_batch.py::test_batched_plain_greedy_equals_greedy"]),
    Mutation("proposer-keeps-a-rejected-draft", "the engine-side draft pool keeps one draft too many at rollback",
             [("rift_ada/proposer.py", "kept = min(fed, before + min(n, max(k - 1, 0)))",
               "kept = min(fed, before + min(n + 1, max(k - 1, 0)))")],
             ["tests/test_proposer.py::test_pool_drafts_what_the_decoder_drafts"]),
    Mutation("self-adapter-verifies", "a self-drafter's LoRA adapter stays on in the target's verify",
             [("rift_ada/speculative.py", "            switch.set(False)  # whatever state it came in: off at rest\n"
               "            self.drafting = switch.on\n", "            switch.set(True)\n")],
             ["tests/test_self_adapter.py::test_greedy_equals_the_target_with_the_adapter_drafting"]),
]
