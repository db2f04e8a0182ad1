"""mogo_diffusion: multi-reward RL fine-tuning of Stable Diffusion 3 with the DiffusionNFT loss.

Modules: ``models`` (loading, tiny SD3, LoRA), ``sampling``, ``nft``, ``advantages``, ``rewards``,
``config``, ``checkpoint`` and ``train`` (``python -m mogo_diffusion.train``, or ``mogo-train``).
Importing the package imports none of them, so ``import mogo_diffusion.rewards`` stays light. It
depends on :mod:`mogo`, never the reverse.
"""
