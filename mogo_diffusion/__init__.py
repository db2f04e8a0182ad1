"""mogo_diffusion: multi-reward RL fine-tuning of Stable Diffusion 3 with the DiffusionNFT loss.

The package is being built; see the issues for its plan. It depends on :mod:`mogo`, never the
reverse.
"""
