"""Speculative decoding: proposers (n-gram prompt lookup), the verification of a step's
samples against the proposals, the rejection rule for sampled drafts, and its counters."""
