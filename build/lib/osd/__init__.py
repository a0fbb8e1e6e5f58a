"""osd: online speculative decoding.

Serve a target causal LM with speculative decoding and keep improving the draft online from the
target's own verification results (Liu et al., ICML 2024).
"""

__version__ = "0.1.0"
