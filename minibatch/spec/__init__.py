"""Speculative decoding: proposers, the exact rejection sampler, k policies, the executor."""

from minibatch.spec.proposers import DraftModelProposer, NgramProposer, ngram_lookup
from minibatch.spec.rejection_sampler import greedy_verify, processed_probs, rejection_sample, sample_verify
from minibatch.spec.runner import SpeculativeRunner
from minibatch.spec.forward_cost import forward_time_s, measure_verify_cost
from minibatch.spec.speculator import AdaptiveK, FixedK, SpecDecodingStats, best_k, expected_tokens, predicted_speedup

__all__ = ["AdaptiveK", "DraftModelProposer", "FixedK", "NgramProposer", "SpecDecodingStats", "SpeculativeRunner",
           "best_k", "expected_tokens", "forward_time_s", "measure_verify_cost", "greedy_verify", "ngram_lookup",
           "predicted_speedup", "processed_probs", "rejection_sample", "sample_verify"]
