"""Speculative decoding: proposers that guess the next few tokens for the target model to verify."""
